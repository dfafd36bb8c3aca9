"""Roles that fail for good stop the run with one error line instead of a run that never ends: a reward source
that always fails, a killed buffer (memory store), a learner that never gets data (the stall watchdog).

Each job joins the session's shared Ray (``RAY_ADDRESS``, as under ``ray job submit``): what fails is the job's own
(its reward source, its buffer actor, its prompts), and its actors end with its driver; the launcher's path on a
Ray of its own is the resume tests' and the demo's."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from jobs import foreign_lines, job_args, kill_session, start_job

pytestmark = pytest.mark.integration

LIMIT_S = 240.0


def test_a_reward_that_always_fails_stops_the_run_naming_the_source(tmp_path: Path, tiny_model_dir: Path,
                                                                    ray_address: str) -> None:
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def reward(prompt, completion, data):\n    raise ConnectionError('the scorer is down')\n")
    args = job_args(tiny_model_dir, tmp_path / "run", 0, "rewards.sources=function",
                    f"rewards.function={broken}:reward", "rewards.max_consecutive_failures=5",
                    "run.stall_timeout_s=120")
    t0 = time.monotonic()
    job = start_job(tmp_path, "job.log", args, ray_address)
    try:
        code = job.wait(timeout=LIMIT_S)
    finally:
        kill_session(job.pid)  # whatever the launcher left behind (nothing, when it stopped cleanly)
    took = time.monotonic() - t0
    out = (tmp_path / "job.log").read_text()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1, out[-3000:]
    assert len(errors) == 1, errors
    assert re.search(r"reward source\(s\) 'function' failed \d+ times in a row .*max_consecutive_failures=5", errors[0])
    assert "the scorer is down" in errors[0], errors[0]
    log = tmp_path / "run" / "logs" / "generator-0.log"  # the failing role's log, named on the console
    assert f"log: {log}" in errors[0] and log.is_file(), errors[0]
    assert foreign_lines(out) == [], out[-3000:]
    print(f"stopped {took:.0f} s after the launch: {errors[0]}")


def test_a_killed_buffer_stops_the_run_with_one_error_line(tmp_path: Path, tiny_model_dir: Path,
                                                           ray_address: str) -> None:
    import os
    import signal

    from async_rlhf.driver.control import send_control

    run_dir = tmp_path / "run"
    job = start_job(tmp_path, "job.log", job_args(tiny_model_dir, run_dir, 20), ray_address)
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (run_dir / "metrics.jsonl").is_file() or not any(
                '"step"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()):
            assert time.monotonic() < deadline and job.poll() is None, "the job never trained"
            time.sleep(0.5)
        pid = send_control(run_dir, {"op": "pids"})["buffer"]
        assert isinstance(pid, int) and pid > 0
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        code = job.wait(timeout=LIMIT_S)
        took = time.monotonic() - t_kill
    finally:
        kill_session(job.pid)
    out = (tmp_path / "job.log").read_text()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, out[-3000:]
    assert "the buffer actor died" in errors[0] and "lost" in errors[0], errors[0]
    assert "resume with --resume" in errors[0] or "no checkpoint" in errors[0], errors[0]
    print(f"stopped {took:.0f} s after the kill: {errors[0]}")


def test_a_learner_that_never_gets_data_is_stopped_by_the_watchdog(tmp_path: Path, tiny_model_dir: Path,
                                                                   ray_address: str) -> None:
    """The prompt source yields nothing (an exhausted stream): generators start no group, the learner waits for
    data; no step for run.stall_timeout_s prints what every role does and stops the run with the cause.

    5 s (it was 20): the timer starts when training does, after start-up and the first push, so the roles
    answer the watchdog's questions by then; the wait itself asserts nothing."""
    empty = tmp_path / "no_prompts.py"
    empty.write_text("def prompts():\n    return []\n")
    stall_s = 5
    args = job_args(tiny_model_dir, tmp_path / "run", 0, "prompts.source=python", f"prompts.path={empty}:prompts",
                    f"run.stall_timeout_s={stall_s}")
    t0 = time.monotonic()
    job = start_job(tmp_path, "job.log", args, ray_address)
    try:
        code = job.wait(timeout=LIMIT_S)
    finally:
        kill_session(job.pid)
    took = time.monotonic() - t0
    out = (tmp_path / "job.log").read_text()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    stalled = [line for line in out.splitlines() if line.startswith("stalled:")]
    assert code == 1, out[-3000:]
    assert len(errors) == 1, errors
    assert re.search(r"no learner step for \d+ s: generators have nothing in flight and the buffer is "
                     r"empty: .*the prompt source is exhausted", errors[0]), errors[0]
    assert any(line.startswith("stalled: learner 0:") for line in stalled), stalled
    assert any(line.startswith("stalled: generator 0:") for line in stalled), stalled
    assert any(line.startswith("stalled: buffer:") for line in stalled), stalled
    started = re.search(r"started 1 generator\(s\), 1 learner\(s\), buffer at \S+ in (\d+)s", out)
    assert started, out[-3000:]
    print(f"stopped {took:.0f} s after the launch (roles started in {started.group(1)} s, "
          f"stall_timeout_s={stall_s}): {errors[0]}")
