"""Kill a job and ``--resume`` it, twice on one run directory: each resume is the job the next scenario kills.

    run 1 (fresh; 1 generator, 1 learner, checkpoint every 5 steps) trains two checkpoints and past the last;
        SIGKILL the whole job (the launcher and everything it started)
    run 2: --resume the run directory (its newest checkpoint, ckpt 1); it trains past a checkpoint of its own;
        SIGKILL its learner rank's process (pid from the control endpoint: {"op": "pids"})
        the launcher exits by itself, non-zero, within a bound: no hang, no process of the job left,
        one error line naming the learner failure and the checkpoint to resume from (ckpt 2)
    run 3: --resume ckpt 2 (the checkpoint itself) for a few more steps; it ends with exit 0

Before, each scenario had a fresh run and a resume of its own (four launches, each ~25 s of start-up); the resume
after the whole-job kill was a run that finished, and the learner was killed in a fresh run. Chained, the checks are
the same ones on the same kind of run:

- the whole-job kill: run 1 is the fresh run killed after two checkpoints and past the last, as before; every check
  reads ckpt 1 and the records at the kill (the prompt filter's count too: run 1's generator, fresh as before).
  Its resume must continue the run: run 2 prints ``resumed from`` ckpt 1, the lineage's metrics go on from ckpt 1
  (the records up to it are run 1's, the next one run 2's), every prompt pending at ckpt 1 is trained after it and
  none twice; the exit 0 and ``final_version`` of the finished resume are run 3's (a resume too: run 2 is stopped
  by the learner's death before it could finish; run 3 goes through the same ``run(cfg, resume=checkpoint)``, the
  two differ only in how ``--resume`` names the checkpoint, and ``resolve_resume`` of each form is checked here).
- the learner failure: run 2 is a running job whose learner is killed past a checkpoint, as the fresh run was; it
  must stop as before, ckpt 2 is checked as before, and run 3 resumes it: every check reads ckpt 2 and the records
  at the kill.

Run with one-digit sums: 80 training prompts, so they come back within a run and the prompt filter passes over
the uniform ones (the random policy gets every one wrong): passed-over prompts cross the resumes too.
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
    data_ledger,
    freeze_when,
    job_args,
    kill_session,
    learner_records,
    newest_checkpoint_step,
    past_every_checkpoint,
    past_last_checkpoint,
    resume_newest,
    session_pids,
    start_job,
    start_resume,
    thaw,
    wait_until,
)

from async_rlhf.driver.checkpoints import STAGING, checkpoints_dir, list_checkpoints, read_manifest, resolve_resume
from async_rlhf.driver.control import send_control

pytestmark = [pytest.mark.integration, pytest.mark.isolated]

EVERY = 5
MORE_STEPS = 8
STOP_WITHIN_S = 120


def _whole_job_killed(work: Path, run_dir: Path, model: Path) -> dict[str, Any]:
    """Run 1: a fresh run killed whole (SIGKILL) after two checkpoints and past the last."""
    log = work / "first.log"
    first = start_job(work, log.name, job_args(model, run_dir, EVERY, "task.digits=1",
                                               "prompts.skip_uninformative=on"))
    try:
        wait_until(lambda: newest_checkpoint_step(run_dir) >= 2 * EVERY, "a second checkpoint", first, log)
        # kill it at a moment when it has trained past its last checkpoint (those steps must be cut on resume)
        freeze_when(first, lambda: past_last_checkpoint(run_dir), "a step past the last checkpoint", log)
    finally:
        kill_session(first.pid)
    first.wait(timeout=30)
    assert not session_pids(first.pid), "processes of the killed job survived"
    ckpt = list_checkpoints(run_dir)[-1]
    return {"before": learner_records(run_dir), "ckpt": ckpt, "manifest": read_manifest(ckpt)}


def _learner_killed(work: Path, run_dir: Path, after_step: int) -> dict[str, Any]:
    """Run 2: ``--resume`` the run directory; its learner process is killed past a checkpoint of its own (after
    ``after_step``), and the job must stop by itself."""
    log = work / "resumed.log"
    job = start_resume(work, log.name, run_dir)
    try:
        wait_until(lambda: newest_checkpoint_step(run_dir) > after_step and past_last_checkpoint(run_dir),
                   "a step past a checkpoint of the resumed run", job, log)
        second = _second_driver(work, run_dir)  # a second --resume of the directory while run 2 runs
        pids = send_control(run_dir, {"op": "pids"})
        assert pids["ok"] and set(pids["learners"]) == {"0"}, pids
        learner_pid = pids["learners"]["0"]
        assert learner_pid in session_pids(job.pid), "the learner runs in the job's session"
        # the learner runs on while the pids are asked for: kill it at a moment it has trained past every
        # checkpoint, the staged ones included (once thawed, the driver may still commit one the learner saved
        # before it died), the whole job frozen meanwhile (the learner runs ahead of the driver's metrics, by
        # 6-20 steps on a fast learner: the buffer is stopped first, so that the driver's metrics catch up)
        frozen = freeze_when(job, lambda: past_every_checkpoint(run_dir), "a step past every checkpoint", log,
                             whole_job=True, starve_s=8.0)
        os.kill(learner_pid, signal.SIGKILL)
        thaw(frozen)
        t_kill = time.monotonic()
        try:
            job.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not stop within {STOP_WITHIN_S} s of its learner's death:\n"
                        f"{log.read_text()[-3000:]}")
        stop_s = time.monotonic() - t_kill
        leftover: list[int] = []
        deadline = time.monotonic() + 30  # ray's own processes end shortly after the driver
        while time.monotonic() < deadline:
            leftover = session_pids(job.pid)
            if not leftover:
                break
            time.sleep(0.5)
    finally:
        kill_session(job.pid)
    return {"returncode": job.returncode, "output": log.read_text(), "stop_s": stop_s, "leftover": leftover,
            "learner_pid": learner_pid, "resolved": resolve_resume(run_dir), "driver_pid": job.pid, "second": second,
            "staged": [p.name for p in checkpoints_dir(run_dir).iterdir() if p.name.startswith(STAGING)],
            "committed": {read_manifest(c)["step"] for c in list_checkpoints(run_dir)}}


def _second_driver(work: Path, run_dir: Path) -> dict[str, Any]:
    """``--resume`` of the run directory while its driver runs: refused before it changes anything."""
    before = sorted(p.name for p in checkpoints_dir(run_dir).iterdir())
    t0 = time.monotonic()
    done = subprocess.run([*LAUNCH, "--resume", str(run_dir), "train.steps=100000"], cwd=work, capture_output=True,
                          text=True, timeout=120)
    return {"returncode": done.returncode, "seconds": time.monotonic() - t0, "output": done.stdout + done.stderr,
            "checkpoints_before": before}


@pytest.fixture(scope="module")
def chain(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("resume")
    run_dir = work / "run"
    whole = _whole_job_killed(work, run_dir, tiny_model_dir)
    learner = _learner_killed(work, run_dir, whole["manifest"]["step"])
    # --resume the checkpoint itself; its records at the learner's death (before), ckpt 2 and its manifest
    final = resume_newest(work, run_dir, MORE_STEPS, by_checkpoint=True, log_name="final.log")
    return {"run_dir": run_dir, "whole": whole, "learner": learner, "final": final}


# -- run 1: the whole job killed, run 2 resumes it (run 3 finishes the lineage) ----------------------------------


def test_resume_continues_from_the_last_checkpoint(chain: dict[str, Any]) -> None:
    whole, final = chain["whole"], chain["final"]
    assert f"resumed from {whole['ckpt']}" in chain["learner"]["output"]  # run 2, --resume the run directory
    second = final["second"]  # the lineage's end: run 3
    assert second.returncode == 0, second.stderr[-3000:]
    assert max(r["step"] for r in whole["before"]) > whole["manifest"]["step"], \
        "the first run should have trained past its checkpoint before the kill"
    summary = json.loads((chain["run_dir"] / "summary.json").read_text())
    assert summary["final_version"] == final["steps"]


def test_metrics_continue_the_original_run(chain: dict[str, Any]) -> None:
    whole = chain["whole"]
    check_metrics_continue(chain["run_dir"], whole["manifest"], chain["final"]["steps"], whole["before"])


def test_no_prompt_lost_or_trained_twice_across_the_resume(chain: dict[str, Any]) -> None:
    check_prompts_once(chain["run_dir"], chain["whole"]["manifest"], chain["final"]["steps"])


def test_prompts_the_filter_passed_over_are_named_by_their_groups(chain: dict[str, Any]) -> None:
    whole = chain["whole"]
    lines = data_ledger(chain["run_dir"])
    passed = [g for x in lines for g in x["group_ids"] + x.get("skipped_ids", []) if "~" in g]
    assert passed, "no group names prompts passed over before it (prompts.skip_uninformative=on)"
    # the first run's generator counted at least the prompts its groups name, and the driver put that in metrics
    upto = whole["manifest"]["step"]
    named = sum(int(g.rpartition("~")[2]) for x in lines if x["step"] <= upto
                for g in x["group_ids"] + x.get("skipped_ids", []) if "~" in g)
    assert max(r.get("rollout/prompts_skipped", 0) for r in whole["before"]) >= max(named, 1)
    summary = json.loads((chain["run_dir"] / "summary.json").read_text())  # the resumed run's own counts
    assert summary["groups_generated"] > 0 and "prompts_skipped" in summary


# -- run 2: the learner killed, run 3 resumes it ----------------------------------------------------------------


def test_the_job_stops_cleanly_naming_the_failure_and_the_checkpoint(chain: dict[str, Any]) -> None:
    killed, ckpt = chain["learner"], chain["final"]["ckpt"]
    out = killed["output"]
    assert killed["returncode"] == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert "learner rank 0 failed" in errors[0] and f"--resume {ckpt}" in errors[0], errors[0]
    trace = Path(chain["run_dir"]) / "error.log"
    assert f"traceback in {trace}" in errors[0] and "LearnerFailure" in trace.read_text(), errors[0]
    assert "the run failed" not in out, "the launcher printed a traceback above the explained failure"
    assert f"a learner failed: the job stops; resume it with python launch/cluster.py --resume {ckpt}" in out
    assert not killed["leftover"], f"processes of the stopped job survived: {killed['leftover']}"
    with pytest.raises(ProcessLookupError):
        os.kill(killed["learner_pid"], 0)


def test_a_consistent_checkpoint_is_committed(chain: dict[str, Any]) -> None:
    killed, final = chain["learner"], chain["final"]
    ckpt, manifest = final["ckpt"], final["manifest"]
    assert killed["resolved"] == ckpt
    assert manifest["step"] > chain["whole"]["manifest"]["step"], "a checkpoint of the resumed run"
    assert manifest["step"] % EVERY == 0 and manifest["version"] == manifest["step"]
    assert max(r["step"] for r in final["before"]) > manifest["step"], "killed past the checkpoint"
    # its metrics and data ledger were written up to its step when it was committed
    assert manifest["metrics_lines"] >= manifest["step"] and manifest["data_lines"] == manifest["step"]
    # a checkpoint the learner was writing when it died (if any) stays staged, never committed
    staged, committed = killed["staged"], killed["committed"]
    assert all(int(name.rsplit("-", 1)[1]) not in committed for name in staged), staged


def test_resume_after_the_learner_failure_continues_the_run(chain: dict[str, Any]) -> None:
    final = chain["final"]
    second = final["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {final['ckpt']}" in second.stdout
    summary = json.loads((chain["run_dir"] / "summary.json").read_text())
    assert summary["final_version"] == final["steps"]
    args = chain["run_dir"], final["manifest"], final["steps"]
    check_metrics_continue(*args, final["before"])
    check_prompts_once(*args)


def test_a_second_driver_on_the_live_run_is_refused(chain: dict[str, Any]) -> None:
    """Two drivers on one directory would stage, commit and prune each other's checkpoints: the second one exits
    non-zero within 60 s with one ``error:`` line naming the live driver's pid (issue 44, defect 5)."""
    second, driver = chain["learner"]["second"], chain["learner"]["driver_pid"]
    assert second["returncode"] != 0 and second["seconds"] < 60, second
    errors = [line for line in second["output"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"in use by a live run (pid {driver} " in errors[0], second["output"][-2000:]
    assert "Traceback" not in second["output"]
