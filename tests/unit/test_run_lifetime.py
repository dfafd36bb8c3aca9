"""A run's life on disk: one driver per directory, a rollback sets the abandoned branch aside, the reference the run
started from is recorded and checked (issue 44: defects 1, 5 and 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from async_rlhf.config import ConfigError


def _commit_steps(run: Path, steps: list[int], keep: int = 10) -> None:
    from async_rlhf.checkpoint_layout import staging_dir
    from async_rlhf.driver.checkpoints import commit

    for step in steps:
        staged = staging_dir(run, step)
        (staged / "deepspeed").mkdir(parents=True)
        (staged / "policy").mkdir()
        commit(run, step, {"version": step}, keep=keep)


def test_second_driver_is_refused_naming_the_first(tmp_path: Path) -> None:
    from async_rlhf.driver.run_lock import RunDirInUse, hold_run_dir

    run = tmp_path / "run"
    first = hold_run_dir(run)
    with pytest.raises(RunDirInUse, match=rf"in use by a live run \(pid {os.getpid()} on .*launch/cluster.py stop"):
        hold_run_dir(run)  # flock is per open file: a second open in this process conflicts as another process would
    first.release()
    hold_run_dir(run).release()  # free again once released


def test_lock_of_a_killed_driver_is_free(tmp_path: Path) -> None:
    """A driver that dies by SIGKILL leaves the file, never the lock."""
    from async_rlhf.driver.run_lock import hold_run_dir, holder

    run = tmp_path / "run"
    code = ("import sys, time; from async_rlhf.driver.run_lock import hold_run_dir; "
            f"lock = hold_run_dir({str(run)!r}); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert holder(run)["pid"] == child.pid
        with pytest.raises(ConfigError, match=f"pid {child.pid}"):
            hold_run_dir(run)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    hold_run_dir(run).release()


def test_check_and_clear_leave_the_lock(tmp_path: Path) -> None:
    """The held lock file is no 'previous run' in a new directory, and run.overwrite never deletes it."""
    from async_rlhf.driver.checkpoints import check_run_dir, clear_run_dir
    from async_rlhf.driver.run_lock import LOCK_NAME, RunDirInUse, hold_run_dir

    run = tmp_path / "run"
    lock = hold_run_dir(run)
    check_run_dir(run, resume=False, overwrite=False)  # only our lock in it: still a new directory
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    clear_run_dir(run)
    assert [p.name for p in run.iterdir()] == [LOCK_NAME]
    with pytest.raises(RunDirInUse):
        hold_run_dir(run)  # still held after the clear
    lock.release()


def test_rollback_sets_the_newer_branch_aside(tmp_path: Path) -> None:
    from async_rlhf.driver.checkpoints import list_checkpoints, prune, resolve_resume, set_aside_newer

    run = tmp_path / "run"
    _commit_steps(run, [20, 40, 60])
    step40 = run / "checkpoints" / "step-000040"
    moved = set_aside_newer(step40)
    assert [p.name for p in moved] == ["step-000060"] and moved[0].is_dir()  # kept, not deleted
    assert moved[0].parent.name.startswith("abandoned-") and moved[0].parent.name.endswith("from-step-000040")
    assert [p.name for p in list_checkpoints(run)] == ["step-000020", "step-000040"]
    assert resolve_resume(run) == step40  # "--resume RUN_DIR" follows the branch that trains now
    _commit_steps(run, [50], keep=1)  # the resumed branch commits step 50 with keep_checkpoints=1
    assert [p.name for p in list_checkpoints(run)] == ["step-000050"]
    assert moved[0].is_dir()  # pruning never reaches the abandoned branch
    assert set_aside_newer(run / "checkpoints" / "step-000050") == []
    assert prune(run, 1) == []


def test_reference_record_and_check(tmp_path: Path) -> None:
    from async_rlhf.driver.reference import check_reference, read_reference, write_reference

    assert read_reference(tmp_path) is None
    write_reference(tmp_path, "/models/base", "ab" * 32)
    rec = read_reference(tmp_path)
    assert rec == {"path": "/models/base", "sha256": "ab" * 32}
    check_reference(rec, "/models/base", "ab" * 32)
    check_reference(rec, "/models/base", None)  # no reference loaded this time (KL off): nothing to compare
    with pytest.raises(ConfigError, match="not the one this run started from"):
        check_reference(rec, "/models/base", "cd" * 32)
    (tmp_path / "reference.json").write_text(json.dumps({"sha256": "x"}))
    with pytest.raises(ConfigError, match="names no reference model path"):
        read_reference(tmp_path)


def test_weights_digest_ignores_lora_and_wrapping() -> None:
    import torch

    from async_rlhf.learner.weights_digest import weights_sha256

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))

    class Wrapped(torch.nn.Module):  # the shape of a LoRA wrapper: base layers renamed, adapters added
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_model = base
            self.lora_A = torch.nn.Linear(4, 1)

    digest = weights_sha256(plain)
    assert weights_sha256(Wrapped(plain)) == digest
    with torch.no_grad():
        plain[1].bias[0] += 1e-6
    assert weights_sha256(plain) != digest


def test_the_launcher_names_a_live_run_before_any_other_check(tmp_path: Path) -> None:
    """A repeated fresh command on a live directory hears of the live run (its pid), never 'holds a previous run:
    run.overwrite=true deletes it'."""
    from async_rlhf.driver.checkpoints import check_run_dir
    from async_rlhf.driver.run_lock import RunDirInUse, hold_run_dir, refuse_if_live

    run = tmp_path / "run"
    refuse_if_live(run)  # no directory yet: nothing to say, nothing created
    assert not run.exists()
    lock = hold_run_dir(run)
    (run / "config.json").write_text("{}")
    with pytest.raises(RunDirInUse, match=f"pid {os.getpid()}"):
        refuse_if_live(run)
    with pytest.raises(ConfigError, match="holds a previous run"):
        check_run_dir(run, resume=False, overwrite=False)  # what a repeated command was told before
    lock.release()
    refuse_if_live(run)
    hold_run_dir(run).release()  # the check left the lock free


def test_a_checkpoint_of_an_abandoned_branch_is_refused_with_the_way_back(tmp_path: Path) -> None:
    from async_rlhf.driver.checkpoints import resolve_resume, set_aside_newer

    run = tmp_path / "run"
    _commit_steps(run, [2, 4])
    moved = set_aside_newer(run / "checkpoints" / "step-000002")
    with pytest.raises(ConfigError, match="abandoned branch .* move it into"):
        resolve_resume(moved[0])
