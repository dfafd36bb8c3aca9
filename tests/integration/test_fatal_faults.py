"""Roles that fail for good stop the run with one error line instead of a run that never ends: a reward source
that always fails, a killed buffer (memory store)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from jobs import job_args, kill_session, start_job

pytestmark = pytest.mark.integration

LIMIT_S = 240.0


def test_a_reward_that_always_fails_stops_the_run_naming_the_source(tmp_path: Path, tiny_model_dir: Path) -> None:
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def reward(prompt, completion, data):\n    raise ConnectionError('the scorer is down')\n")
    args = job_args(tiny_model_dir, tmp_path / "run", 0, "rewards.sources=function",
                    f"rewards.function={broken}:reward", "rewards.max_consecutive_failures=5",
                    "run.stall_timeout_s=120")
    t0 = time.monotonic()
    job = start_job(tmp_path, "job.log", args)
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
    print(f"stopped {took:.0f} s after the launch: {errors[0]}")


def test_a_killed_buffer_stops_the_run_with_one_error_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    import os
    import signal

    from async_rlhf.control import send_control

    run_dir = tmp_path / "run"
    job = start_job(tmp_path, "job.log", job_args(tiny_model_dir, run_dir, 20))
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
