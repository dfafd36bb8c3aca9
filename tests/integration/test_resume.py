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
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from async_rlhf.checkpoint import list_checkpoints, read_manifest
from async_rlhf.generator.stream import key_of_group

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EVERY = 5
MORE_STEPS = 8


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``: the launcher's Ray head and actors stay in it."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True).stdout
    rows = (line.split() for line in out.splitlines())
    return [int(p) for p, s, st in rows if int(s) == sid and not st.startswith("Z")]


def _kill_session(sid: int) -> None:
    """SIGKILL every process of the job's session (the launcher, its Ray head, actors): the whole job."""
    for _ in range(30):
        pids = _session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def _learner_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
            # the driver was stopped mid-line
    return [r for r in records if "step" in r and r.get("kind") != "eval"]


def _past_last_checkpoint(run_dir: Path) -> bool:
    """True when the metrics already hold a step after the newest committed checkpoint (read while frozen)."""
    ckpts = list_checkpoints(run_dir)
    records = _learner_records(run_dir)
    return bool(ckpts and records) and max(r["step"] for r in records) > read_manifest(ckpts[-1])["step"]


@pytest.fixture(scope="module")
def resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("resume")
    run_dir = work / "run"
    launch = [sys.executable, str(ROOT / "launch" / "cluster.py")]
    first = subprocess.Popen(
        [*launch, "--generators", "1", "--learners", "1", "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
         "train.steps=100000", "train.batch_size=4", "train.group_size=4", "train.max_staleness=1",
         "generator.eval_every=0", "generator.groups_in_flight=4", f"run.checkpoint_every={EVERY}",
         "run.keep_checkpoints=2", "task.heldout_size=20", "run.log_every_s=5"],
        cwd=work, stdout=(work / "first.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not any(read_manifest(c)["step"] >= 2 * EVERY for c in list_checkpoints(run_dir)):
            assert first.poll() is None, (work / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run wrote no second checkpoint in time"
            time.sleep(0.5)
        # Kill it at a moment when it has trained past its last checkpoint (those steps must be cut on resume).
        # Only the driver writes metrics.jsonl and commits checkpoints, so freezing it (SIGSTOP) makes the
        # check and the kill atomic; without that, a poll ending exactly on a checkpoint step races the kill.
        while True:
            time.sleep(0.3)
            os.kill(first.pid, signal.SIGSTOP)
            if _past_last_checkpoint(run_dir):
                break
            os.kill(first.pid, signal.SIGCONT)
            assert time.monotonic() < deadline, "the first run never trained past a checkpoint"
    finally:
        _kill_session(first.pid)
    first.wait(timeout=30)
    assert not _session_pids(first.pid), "processes of the killed job survived"
    before = _learner_records(run_dir)
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = read_manifest(ckpt)
    steps = manifest["step"] + MORE_STEPS
    second = subprocess.run([*launch, "--resume", str(run_dir), f"train.steps={steps}"], cwd=work,
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
    records = _learner_records(resumed["run_dir"])
    s = resumed["manifest"]["step"]
    assert [r["step"] for r in records] == list(range(1, resumed["steps"] + 1))
    assert [r["version"] for r in records] == [r["step"] for r in records], "versions kept increasing"
    assert records[:s] == resumed["before"][:s], "the records up to the checkpoint are the original ones"
    assert records[s]["time"] > resumed["before"][-1]["time"], "steps after the checkpoint come from the resume"


def test_no_prompt_lost_or_trained_twice_across_the_resume(resumed: dict[str, Any]) -> None:
    lines = [json.loads(x) for x in (resumed["run_dir"] / "data_ledger.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, resumed["steps"] + 1))
    keys = [key_of_group(g) for x in lines for g in x["group_ids"]]
    assert len(keys) == len(set(keys)), "a prompt was trained twice"
    s = resumed["manifest"]["step"]
    after = {key_of_group(g) for x in lines if x["step"] > s for g in x["group_ids"]}
    pending = {f"{gen}:{seq}" for gen, st in resumed["manifest"]["data"].items() for seq in st["pending"]}
    assert pending, "the first run had prompts in flight or in the buffer at its checkpoint"
    assert pending <= after, f"prompts drawn before the checkpoint were never trained: {sorted(pending - after)}"
