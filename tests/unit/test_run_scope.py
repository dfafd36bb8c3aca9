"""Run ids and the Redis durability check (issue 44, defect 4 and item 12): pure parts."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from async_rlhf.buffer.run_scope import durability_warnings, run_id_for, run_prefix, scoped_prefix


def test_a_fresh_run_takes_a_new_id_and_a_resume_its_own(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step-4"
    ckpt.mkdir(parents=True)
    a, b = run_id_for(run_dir, None), run_id_for(run_dir, None)
    assert a and b and a != b  # even in the same directory (run.overwrite): never an earlier run's keys
    (run_dir / "config.json").write_text(json.dumps({"run": {"dir": str(run_dir), "id": a}}))
    assert run_id_for(run_dir, ckpt) == a == run_id_for(tmp_path / "elsewhere", ckpt)
    assert run_prefix(run_dir, "p") == scoped_prefix("p", a) == f"p:{a}"
    (run_dir / "config.json").write_text(json.dumps({"run": {"dir": str(run_dir)}}))  # written before ids
    assert run_id_for(run_dir, ckpt) == "" and scoped_prefix("p", "") == "p"


class _Client:
    def __init__(self, conf: dict[str, str] | None) -> None:
        self.conf = conf

    def config_get(self, name: str) -> dict[str, str]:
        if self.conf is None:
            raise redis.ResponseError("unknown command 'CONFIG'")
        return {name: self.conf[name]}


def test_durability_warnings_name_the_setting_and_the_fix() -> None:
    assert durability_warnings(_Client({"appendonly": "yes", "maxmemory-policy": "noeviction"})) == []
    (aof,) = durability_warnings(_Client({"appendonly": "no", "maxmemory-policy": "noeviction"}))
    assert "appendonly is 'no'" in aof and "appendonly yes" in aof
    (evict,) = durability_warnings(_Client({"appendonly": "yes", "maxmemory-policy": "volatile-lru"}))
    assert "volatile-lru" in evict and "noeviction" in evict
    (unknown,) = durability_warnings(_Client(None))  # CONFIG disabled (a managed Redis): a warning, no failure
    assert "could not read" in unknown and "appendonly yes" in unknown and "noeviction" in unknown
