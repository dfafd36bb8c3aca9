"""A learner process killed with SIGKILL mid-run: the job stops cleanly, and ``--resume`` continues it.

    run (1 generator, 1 learner, checkpoint every 4 steps) trains past its first checkpoint
    SIGKILL the learner rank's process (pid from the control endpoint: {"op": "pids"})
    the launcher exits by itself, non-zero, within a bound: no hang, no process of the job left,
        one error line naming the learner failure and the checkpoint to resume from
    --resume that checkpoint: steps and versions continue, no prompt lost or trained twice
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import (
    check_metrics_continue,
    check_prompts_once,
    freeze_when,
    job_args,
    kill_session,
    past_every_checkpoint,
    past_last_checkpoint,
    resume_newest,
    session_pids,
    start_job,
    thaw,
    wait_until,
)

from async_rlhf.driver.checkpoints import STAGING, checkpoints_dir, list_checkpoints, read_manifest, resolve_resume
from async_rlhf.driver.fleet import send_control

pytestmark = pytest.mark.integration

EVERY = 4
MORE_STEPS = 6
STOP_WITHIN_S = 120


@pytest.fixture(scope="module")
def learner_killed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("learner_fault")
    run_dir = work / "run"
    log = work / "first.log"
    first = start_job(work, log.name, job_args(tiny_model_dir, run_dir, EVERY))
    try:
        wait_until(lambda: past_last_checkpoint(run_dir), "a step past the first checkpoint", first, log)
        pids = send_control(run_dir, {"op": "pids"})
        assert pids["ok"] and set(pids["learners"]) == {"0"}, pids
        learner_pid = pids["learners"]["0"]
        assert learner_pid in session_pids(first.pid), "the learner runs in the job's session"
        # the learner runs on while the pids are asked for: kill it at a moment it has trained past every
        # checkpoint, the staged ones included (once thawed, the driver may still commit one the learner saved
        # before it died), the whole job frozen meanwhile (the learner runs ahead of the driver's metrics, by
        # 6-20 steps on a fast learner: the buffer is stopped first, so that the driver's metrics catch up)
        frozen = freeze_when(first, lambda: past_every_checkpoint(run_dir), "a step past every checkpoint", log,
                             whole_job=True, starve_s=8.0)
        os.kill(learner_pid, signal.SIGKILL)
        thaw(frozen)
        t_kill = time.monotonic()
        try:
            first.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not stop within {STOP_WITHIN_S} s of its learner's death:\n"
                        f"{log.read_text()[-3000:]}")
        stop_s = time.monotonic() - t_kill
        leftover: list[int] = []
        deadline = time.monotonic() + 30  # ray's own processes end shortly after the driver
        while time.monotonic() < deadline:
            leftover = session_pids(first.pid)
            if not leftover:
                break
            time.sleep(0.5)
    finally:
        kill_session(first.pid)
    output = log.read_text()
    resolved = resolve_resume(run_dir)
    staged = [p.name for p in checkpoints_dir(run_dir).iterdir() if p.name.startswith(STAGING)]
    committed = {read_manifest(c)["step"] for c in list_checkpoints(run_dir)}
    return {**resume_newest(work, run_dir, MORE_STEPS, by_checkpoint=True), "returncode": first.returncode,
            "output": output, "stop_s": stop_s, "leftover": leftover, "learner_pid": learner_pid,
            "resolved": resolved, "staged": staged, "committed": committed}


def test_the_job_stops_cleanly_naming_the_failure_and_the_checkpoint(learner_killed: dict[str, Any]) -> None:
    out = learner_killed["output"]
    assert learner_killed["returncode"] == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert "learner rank 0 failed" in errors[0] and f"--resume {learner_killed['ckpt']}" in errors[0], errors[0]
    trace = Path(learner_killed["run_dir"]) / "error.log"
    assert f"traceback in {trace}" in errors[0] and "LearnerFailure" in trace.read_text(), errors[0]
    assert "the run failed" not in out, "the launcher printed a traceback above the explained failure"
    assert f"a learner failed: the job stops; resume it with python launch/cluster.py --resume " \
           f"{learner_killed['ckpt']}" in out
    assert not learner_killed["leftover"], f"processes of the stopped job survived: {learner_killed['leftover']}"
    with pytest.raises(ProcessLookupError):
        os.kill(learner_killed["learner_pid"], 0)


def test_a_consistent_checkpoint_is_committed(learner_killed: dict[str, Any]) -> None:
    ckpt, manifest = learner_killed["ckpt"], learner_killed["manifest"]
    assert learner_killed["resolved"] == ckpt
    assert manifest["step"] % EVERY == 0 and manifest["version"] == manifest["step"]
    assert max(r["step"] for r in learner_killed["before"]) > manifest["step"], "killed past the checkpoint"
    # its metrics and data ledger were written up to its step when it was committed
    assert manifest["metrics_lines"] >= manifest["step"] and manifest["data_lines"] == manifest["step"]
    # a checkpoint the learner was writing when it died (if any) stays staged, never committed
    staged, committed = learner_killed["staged"], learner_killed["committed"]
    assert all(int(name.rsplit("-", 1)[1]) not in committed for name in staged), staged


def test_resume_after_the_learner_failure_continues_the_run(learner_killed: dict[str, Any]) -> None:
    second = learner_killed["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {learner_killed['ckpt']}" in second.stdout
    summary = json.loads((learner_killed["run_dir"] / "summary.json").read_text())
    assert summary["final_version"] == learner_killed["steps"]
    args = learner_killed["run_dir"], learner_killed["manifest"], learner_killed["steps"]
    check_metrics_continue(*args, learner_killed["before"])
    check_prompts_once(*args)
