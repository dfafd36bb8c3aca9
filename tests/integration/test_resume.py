"""Kill the whole job (SIGKILL to the launcher and everything it started), then ``--resume`` it.

The first run checkpoints every few steps and keeps training past its last checkpoint before it is killed;
the resumed run must continue from that checkpoint: its metrics and data ledger go on from the
checkpoint's step and version, every prompt drawn but not trained at the checkpoint is trained after the
resume, and no prompt is trained twice in the run's lineage.
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
    LAUNCH,
    check_metrics_continue,
    check_prompts_once,
    kill_session,
    learner_records,
    newest_checkpoint_step,
    past_last_checkpoint,
    session_pids,
    start_job,
    wait_until,
)

from async_rlhf.checkpoint import list_checkpoints, read_manifest

pytestmark = pytest.mark.integration

EVERY = 5
MORE_STEPS = 8


@pytest.fixture(scope="module")
def resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("resume")
    run_dir = work / "run"
    first = start_job(work, "first.log", [
        "--generators", "1", "--learners", "1", "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
        "train.steps=100000", "train.batch_size=4", "train.group_size=4", "train.max_staleness=1",
        "generator.eval_every=0", "generator.groups_in_flight=4", f"run.checkpoint_every={EVERY}",
        "run.keep_checkpoints=2", "task.heldout_size=20", "run.log_every_s=5"])
    try:
        wait_until(lambda: newest_checkpoint_step(run_dir) >= 2 * EVERY, "a second checkpoint", first,
                   work / "first.log")
        # Kill it at a moment when it has trained past its last checkpoint (those steps must be cut on resume).
        # Only the driver writes metrics.jsonl and commits checkpoints, so freezing it (SIGSTOP) makes the
        # check and the kill atomic; without that, a poll ending exactly on a checkpoint step races the kill.
        deadline = time.monotonic() + 300
        while True:
            time.sleep(0.3)
            os.kill(first.pid, signal.SIGSTOP)
            if past_last_checkpoint(run_dir):
                break
            os.kill(first.pid, signal.SIGCONT)
            assert time.monotonic() < deadline, "the first run never trained past a checkpoint"
    finally:
        kill_session(first.pid)
    first.wait(timeout=30)
    assert not session_pids(first.pid), "processes of the killed job survived"
    before = learner_records(run_dir)
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = read_manifest(ckpt)
    steps = manifest["step"] + MORE_STEPS
    second = subprocess.run([*LAUNCH, "--resume", str(run_dir), f"train.steps={steps}"], cwd=work,
                            capture_output=True, text=True, timeout=900)
    return {"run_dir": run_dir, "before": before, "ckpt": ckpt, "manifest": manifest, "steps": steps,
            "second": second}


def test_resume_continues_from_the_last_checkpoint(resumed: dict[str, Any]) -> None:
    second = resumed["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {resumed['ckpt']}" in second.stdout
    assert max(r["step"] for r in resumed["before"]) > resumed["manifest"]["step"], \
        "the first run should have trained past its checkpoint before the kill"
    summary = json.loads((resumed["run_dir"] / "summary.json").read_text())
    assert summary["final_version"] == resumed["steps"]


def test_metrics_continue_the_original_run(resumed: dict[str, Any]) -> None:
    check_metrics_continue(resumed["run_dir"], resumed["manifest"], resumed["steps"], resumed["before"])


def test_no_prompt_lost_or_trained_twice_across_the_resume(resumed: dict[str, Any]) -> None:
    check_prompts_once(resumed["run_dir"], resumed["manifest"], resumed["steps"])
