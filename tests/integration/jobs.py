"""Helpers of the tests that drive the real launcher in a subprocess (kill, fail, resume a whole job).

The launcher runs in a session of its own (``start_new_session``): its Ray head and actors stay in that
session, so the session's live processes are exactly what the job left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from async_rlhf.driver.checkpoints import STAGING, checkpoints_dir, list_checkpoints, read_manifest
from async_rlhf.generator.stream import key_of_group, keys_of_group

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, str(ROOT / "launch" / "cluster.py")]


OUR_LINES = re.compile(
    r"(logs: |start-up[ :]|step +\d+/\d+ \||started \d+ generator|policy |held-out |no held-out figure|task\.name=|"
    r"checkpoint |resumed |resuming |buffer kept |stopping on |SIG[A-Z]+: stopping|stalled: |error: |warning: |"
    r"a learner failed|"
    r"\d+ finished prompt group|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (WARNING|ERROR) (async_rlhf|launch)[.:])")
"""What the launcher itself prints on the console (async_rlhf/run_logs.py): its first line, start-up progress,
the progress line, held-out figures, checkpoints, stops, our loggers' warnings and errors, the closing line."""


def foreign_lines(console: str) -> list[str]:
    """The console's lines the launcher did not print itself (the roles' and libraries' go to run.dir/logs)."""
    return [line for line in console.splitlines() if line.strip() and not OUR_LINES.match(line)]


def start_job(work: Path, log_name: str, args: list[str], ray_address: str | None = None) -> subprocess.Popen:
    """``launch/cluster.py args`` in its own session, output to ``work/log_name``. With ``ray_address`` the
    launcher joins that Ray (``RAY_ADDRESS``, as under ``ray job submit``; the session holds only the driver and
    the job's actors end with it), else it starts a Ray of its own in the session."""
    env = {**os.environ, "RAY_ADDRESS": ray_address} if ray_address else None
    return subprocess.Popen([*LAUNCH, *args], cwd=work, stdout=(work / log_name).open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)


def session_pids(sid: int, actor: str = "") -> list[int]:
    """Live (not zombie) processes of session ``sid``: the launcher's Ray head and actors stay in it. With
    ``actor``, only those running that Ray actor class (their process title is ``ray::<actor>``)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    rows = (line.split(None, 3) for line in out.splitlines())
    return [int(r[0]) for r in rows if int(r[1]) == sid and not r[2].startswith("Z")
            and (not actor or r[3:] and r[3].split()[0] == f"ray::{actor}")]


def kill_session(sid: int) -> None:
    """SIGKILL every process of the job's session (the launcher, its Ray head, actors): the whole job."""
    for _ in range(30):
        pids = session_pids(sid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def learner_records(run_dir: Path) -> list[dict[str, Any]]:
    """The learner records of ``metrics.jsonl`` (a last line cut by a kill is skipped)."""
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


def newest_checkpoint_step(run_dir: Path) -> int:
    ckpts = list_checkpoints(run_dir)
    return read_manifest(ckpts[-1])["step"] if ckpts else -1


def past_last_checkpoint(run_dir: Path) -> bool:
    """True when the metrics already hold a step after the newest committed checkpoint."""
    records = learner_records(run_dir)
    step = newest_checkpoint_step(run_dir)
    return step >= 0 and bool(records) and max(r["step"] for r in records) > step


def past_every_checkpoint(run_dir: Path) -> bool:
    """True when the metrics hold a step after every checkpoint, committed or still staged by the learner (which
    runs ahead of the driver): one the driver could still commit after a kill is older than those steps."""
    records = learner_records(run_dir)
    staged = [int(p.name.rsplit("-", 1)[1]) for p in checkpoints_dir(run_dir).glob(f"{STAGING}*")]
    newest = max([newest_checkpoint_step(run_dir), *staged])
    return newest >= 0 and bool(records) and max(r["step"] for r in records) > newest


def wait_until(cond: Any, what: str, job: subprocess.Popen, log: Path, timeout_s: float = 600.0) -> None:
    """Poll ``cond`` while the job runs; fail with the end of its log if it ends or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert job.poll() is None, f"the job ended while waiting for {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def job_args(model: Path, run_dir: Path, every: int, *extra: str, max_staleness: int = 1) -> list[str]:
    """The launcher's arguments for an endless tiny job (1 generator, 1 learner) checkpointing every ``every``
    steps, for a test to kill."""
    return ["--generators", "1", "--learners", "1", "--model", str(model), "--run-dir", str(run_dir),
            "train.steps=100000", "train.batch_size=4", "train.group_size=4", f"train.max_staleness={max_staleness}",
            "generator.eval_every=0", "generator.groups_in_flight=4", f"run.checkpoint_every={every}",
            "run.keep_checkpoints=2", "task.heldout_size=20", "run.log_every_s=5", *extra]


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def freeze_when(job: subprocess.Popen, cond: Any, what: str, log: Path, every_s: float = 0.3,
                timeout_s: float = 300.0, whole_job: bool = False, starve_s: float = 0.0) -> list[int]:
    """Return with the job's driver stopped (SIGSTOP) at a moment ``cond`` holds; the caller kills it, or resumes
    it with :func:`thaw` of the returned pids (the stopped processes).

    Only the driver writes metrics.jsonl and commits checkpoints, so while it is stopped what ``cond`` reads
    cannot change: the check and the caller's next step (a kill) are atomic. Without the freeze, a poll
    ending exactly on a checkpoint step races the kill (a CI failure of the resume test).
    ``whole_job`` stops every process of the job (learners, generators, buffer too) for a ``cond`` that reads
    their state as well, e.g. the buffer's version in Redis.
    ``starve_s`` first stops the job's buffer (returned with the other stopped pids) and waits up to that long
    for ``cond``: the learners and generators then wait on their next buffer request, and the driver, once its
    stats request to the buffer times out (5 s), commits the checkpoints the learners saved. A fast learner
    otherwise runs several steps past a checkpoint before the driver's progress loop (a 0.5 s poll) commits it,
    so a moment such as "the buffer's version is the newest committed checkpoint's" never comes. Requests wait
    30 s by default.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        time.sleep(every_s)
        assert job.poll() is None, f"the job ended while waiting for {what}:\n{log.read_text()[-3000:]}"
        buffer = session_pids(job.pid, "BufferActor") if starve_s else []
        _signal_all(buffer, signal.SIGSTOP)
        settled = time.monotonic() + starve_s
        while time.monotonic() < settled and not cond():
            time.sleep(0.2)
        pids = sorted(set(session_pids(job.pid) if whole_job else [job.pid]) | set(buffer))
        _signal_all(pids, signal.SIGSTOP)
        if cond():
            return pids
        _signal_all(pids, signal.SIGCONT)
        # a starved buffer must answer the driver again before the next try: the driver gives up on a buffer
        # silent for buffer.redis_retry_s + request_timeout_s in all, and retries back to back add up to that
        time.sleep(starve_s)
        assert time.monotonic() < deadline, f"timed out waiting for {what}"


def thaw(pids: list[int]) -> None:
    """Resume the processes :func:`freeze_when` stopped (those gone meanwhile are skipped)."""
    _signal_all(pids, signal.SIGCONT)


def start_resume(work: Path, log_name: str, target: Path, *extra: str) -> subprocess.Popen:
    """``launch/cluster.py --resume target`` (a run directory or a checkpoint) in its own session, endless
    (``train.steps=100000``), output to ``work/log_name``: a resumed job for a test to kill again."""
    return start_job(work, log_name, ["--resume", str(target), "train.steps=100000", *extra])


def resume_newest(work: Path, run_dir: Path, more_steps: int, by_checkpoint: bool = False,
                  log_name: str = "second.log") -> dict[str, Any]:
    """Resume the killed job from its newest committed checkpoint for ``more_steps`` more steps (``--resume``
    the run directory, or the checkpoint itself with ``by_checkpoint``); returns the first run's records
    (``before``), ``ckpt``, its ``manifest``, the step target ``steps`` and the finished resume ``second``
    (whose output is also in ``work/log_name``)."""
    before = learner_records(run_dir)
    ckpt = list_checkpoints(run_dir)[-1]
    manifest = read_manifest(ckpt)
    # enough steps (batches of 4 groups) to train every prompt pending at the checkpoint: a learner that ran
    # far ahead of the driver before the kill leaves more of them than ``more_steps`` batches hold
    pending = sum(len(st["pending"]) for st in manifest["data"].values())
    steps = manifest["step"] + max(more_steps, -(-pending // 4) + 2)
    second = subprocess.run([*LAUNCH, "--resume", str(ckpt if by_checkpoint else run_dir), f"train.steps={steps}"],
                            cwd=work, capture_output=True, text=True, timeout=900)
    (work / log_name).write_text(second.stdout + second.stderr)
    return {"run_dir": run_dir, "before": before, "ckpt": ckpt, "manifest": manifest, "steps": steps,
            "second": second}


def data_ledger(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "data_ledger.jsonl").read_text().splitlines()]


def check_metrics_continue(run_dir: Path, manifest: dict[str, Any], steps: int,
                           before: list[dict[str, Any]]) -> None:
    """The resumed run continued the original's metrics from checkpoint ``manifest``: steps and versions go
    on, the records up to the checkpoint are the original ones, the later ones the resumed run's."""
    records = learner_records(run_dir)
    s = manifest["step"]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["version"] for r in records] == [r["step"] for r in records], "versions kept increasing"
    assert records[:s] == before[:s], "the records up to the checkpoint are the original ones"
    assert records[s]["time"] > before[-1]["time"], "steps after the checkpoint come from the resume"


def check_prompts_once(run_dir: Path, manifest: dict[str, Any], steps: int) -> list[str]:
    """Every step's groups are in the data ledger, no prompt was trained twice in the lineage, and every
    prompt drawn but not trained at checkpoint ``manifest`` was trained (or skipped as uninformative) after it;
    returns the trained keys."""
    s = manifest["step"]
    lines = data_ledger(run_dir)
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    keys = [key_of_group(g) for x in lines for g in x["group_ids"]]
    assert keys == [k for x in lines for k in x["prompt_keys"]], "the ledger's prompt keys name its groups' prompts"
    assert len(keys) == len(set(keys)), "a prompt was trained twice"
    # used up: trained, dropped as zero-advantage (skipped_ids), or passed over by the prompt filter before either
    used = [k for x in lines for g in x["group_ids"] + x.get("skipped_ids", []) for k in keys_of_group(g)]
    assert len(used) == len(set(used)), "a prompt was used up twice (trained, skipped or passed over)"
    after = {k for x in lines if x["step"] > s for g in x["group_ids"] + x.get("skipped_ids", [])
             for k in keys_of_group(g)}
    pending = {f"{gen}:{seq}" for gen, st in manifest["data"].items() for seq in st["pending"]}
    assert pending, "the first run had prompts in flight or in the buffer at its checkpoint"
    assert pending <= after, f"prompts drawn before the checkpoint were never trained: {sorted(pending - after)}"
    return keys
