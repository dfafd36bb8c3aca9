"""Kill the whole job (SIGKILL to the launcher and everything it started), then ``--resume`` it.

The first run checkpoints every few steps and keeps training past its last checkpoint before it is killed;
the resumed run must continue from that checkpoint: its metrics and data ledger go on from the
checkpoint's step and version, every prompt drawn but not trained at the checkpoint is trained after the
resume, and no prompt is trained twice in the run's lineage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jobs import (
    check_metrics_continue,
    check_prompts_once,
    data_ledger,
    freeze_when,
    job_args,
    kill_session,
    newest_checkpoint_step,
    past_last_checkpoint,
    resume_newest,
    session_pids,
    start_job,
    wait_until,
)

pytestmark = pytest.mark.integration

EVERY = 5
MORE_STEPS = 8


@pytest.fixture(scope="module")
def resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("resume")
    run_dir = work / "run"
    log = work / "first.log"
    # one-digit sums: 80 training prompts, so they come back within the run and the prompt filter passes over
    # the uniform ones (the random policy gets every one wrong): passed-over prompts cross the resume too
    first = start_job(work, log.name, job_args(tiny_model_dir, run_dir, EVERY, "task.digits=1",
                                               "prompts.skip_uninformative=on"))
    try:
        wait_until(lambda: newest_checkpoint_step(run_dir) >= 2 * EVERY, "a second checkpoint", first, log)
        # kill it at a moment when it has trained past its last checkpoint (those steps must be cut on resume)
        freeze_when(first, lambda: past_last_checkpoint(run_dir), "a step past the last checkpoint", log)
    finally:
        kill_session(first.pid)
    first.wait(timeout=30)
    assert not session_pids(first.pid), "processes of the killed job survived"
    return resume_newest(work, run_dir, MORE_STEPS)


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


def test_prompts_the_filter_passed_over_are_named_by_their_groups(resumed: dict[str, Any]) -> None:
    lines = data_ledger(resumed["run_dir"])
    passed = [g for x in lines for g in x["group_ids"] + x.get("skipped_ids", []) if "~" in g]
    assert passed, "no group names prompts passed over before it (prompts.skip_uninformative=on)"
    # the first run's generator counted at least the prompts its groups name, and the driver put that in metrics
    upto = resumed["manifest"]["step"]
    named = sum(int(g.rpartition("~")[2]) for x in lines if x["step"] <= upto
                for g in x["group_ids"] + x.get("skipped_ids", []) if "~" in g)
    assert max(r.get("rollout/prompts_skipped", 0) for r in resumed["before"]) >= max(named, 1)
    summary = json.loads((resumed["run_dir"] / "summary.json").read_text())  # the resumed run's own counts
    assert summary["groups_generated"] > 0 and "prompts_skipped" in summary
