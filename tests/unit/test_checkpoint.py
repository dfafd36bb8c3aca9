"""Checkpoints on disk: atomic commit, keep the last N, resolve --resume, refuse what is not one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_rlhf.config import ConfigError
from async_rlhf.driver.checkpoints import (
    commit,
    list_checkpoints,
    prune,
    read_manifest,
    resolve_resume,
    staging_dir,
    truncate_jsonl,
)


def stage(run_dir: Path, step: int) -> Path:
    d = staging_dir(run_dir, step)
    (d / "deepspeed").mkdir(parents=True)
    (d / "policy").mkdir()
    (d / "policy" / "weights").write_text(str(step))
    return d


def test_commit_is_invisible_until_renamed_and_keeps_last_n(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        stage(tmp_path, step)
        assert [p.name for p in list_checkpoints(tmp_path)][-1:] != [f"step-{step:06d}"], "staged counts as done"
        final = commit(tmp_path, step, {"version": step, "data": {}}, keep=2)
        assert not staging_dir(tmp_path, step).exists()
        assert read_manifest(final)["step"] == step
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000006", "step-000009"]


def test_crashed_staging_is_never_resumed_and_is_pruned(tmp_path: Path) -> None:
    stage(tmp_path, 4)
    commit(tmp_path, 4, {"version": 4, "data": {}}, keep=3)
    stage(tmp_path, 2)  # left behind by a crash, older than what is committed
    stage(tmp_path, 8)  # a crash while writing step 8: no manifest
    assert resolve_resume(tmp_path).name == "step-000004"
    gone = prune(tmp_path, keep=3)
    assert [p.name for p in gone] == [".staging-step-000002"]
    assert staging_dir(tmp_path, 8).exists()


def test_resume_accepts_run_dir_or_checkpoint(tmp_path: Path) -> None:
    stage(tmp_path, 5)
    final = commit(tmp_path, 5, {"version": 5, "data": {}}, keep=2)
    assert resolve_resume(tmp_path) == final
    assert resolve_resume(final) == final


@pytest.mark.parametrize(("make", "expected"), [
    (lambda d: d / "missing", "no such directory"),
    (lambda d: (d / "f.txt").write_text("x") and d / "f.txt", "is a file, not a checkpoint"),
    (lambda d: d, "is not a checkpoint"),
])
def test_resume_refuses_what_is_not_a_checkpoint(tmp_path: Path, make, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        resolve_resume(make(tmp_path))


def test_resume_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "checkpoints" / "step-000003"
    d.mkdir(parents=True)
    (d / "checkpoint.json").write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(ConfigError, match="no deepspeed/ directory"):
        resolve_resume(d)


def test_truncate_jsonl_keeps_the_first_lines(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text("".join(f'{{"step": {i}}}\n' for i in range(10)))
    truncate_jsonl(f, 4)
    assert [json.loads(line)["step"] for line in f.read_text().splitlines()] == [0, 1, 2, 3]


def test_run_dir_check_and_overwrite(tmp_path: Path) -> None:
    from async_rlhf.driver.checkpoints import check_run_dir, clear_run_dir

    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    for d in (fresh, empty):
        check_run_dir(d, resume=False, overwrite=False)
    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="holds a previous run; continue it with --resume"):
        check_run_dir(run, resume=False, overwrite=False)
    check_run_dir(run, resume=True, overwrite=False)
    check_run_dir(run, resume=False, overwrite=True)
    clear_run_dir(run)
    assert run.is_dir() and not any(run.iterdir())
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("x")
    with pytest.raises(ConfigError, match="holds no previous run"):
        check_run_dir(mine, resume=False, overwrite=True)
    clear_run_dir(mine)  # never deletes a directory that is not a run's
    assert (mine / "thesis.tex").is_file()
    with pytest.raises(ConfigError, match="is a file"):
        check_run_dir(mine / "thesis.tex", resume=False, overwrite=False)
