"""Claims on this host's cores (async_rlhf/driver/core_claims.py): live while held, stale once released or once its
holder is gone, and a run whose auto plan meets another run's claim runs unpinned (cpu_plan.unpinned)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from async_rlhf.config import Config, load_config
from async_rlhf.driver import core_claims
from async_rlhf.driver.cpu_plan import plan_cpus, unpinned

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def claims_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(core_claims.CLAIM_DIR_ENV, str(tmp_path / "claims"))
    return tmp_path / "claims"


def test_a_claim_is_seen_while_held_and_gone_once_released() -> None:
    mine = core_claims.claim((0, 1), "runs/a")
    other = core_claims.claim((2, 3), "runs/b")
    assert sorted((c["cores"], c["run_dir"], c["pid"]) for c in core_claims.live_claims()) == [
        ((0, 1), "runs/a", os.getpid()), ((2, 3), "runs/b", os.getpid())]
    other.release()
    other.release()  # twice is harmless
    assert [c["cores"] for c in core_claims.live_claims()] == [(0, 1)]
    mine.release()
    assert core_claims.live_claims() == []


def test_a_claim_nobody_holds_is_stale_and_removed(claims_dir: Path) -> None:
    """What a killed run leaves: the file without its lock (the lock went with the process)."""
    claims_dir.mkdir()
    (claims_dir / "999-0.json").write_text('{"pid": 999, "cores": [0], "run_dir": "x"}')
    assert core_claims.live_claims() == []
    assert not (claims_dir / "999-0.json").exists()


def test_a_claim_held_by_another_process_is_live() -> None:
    """flock is per open file: a child that holds the claim's file keeps it live after this process closes its
    own descriptor (as another run's driver would)."""
    held = core_claims.claim((1,), "runs/c")
    pid = os.fork()
    if pid == 0:  # the child keeps the inherited descriptor open, then exits
        import time

        time.sleep(1.0)
        os._exit(0)
    try:
        os.close(held.fd)  # this process lets go; the child still holds the lock
        held.fd = -1
        assert [c["cores"] for c in core_claims.live_claims()] == [(1,)]
    finally:
        os.waitpid(pid, 0)
    assert core_claims.live_claims() == [], "the holder ended: the claim is stale"


def cfg(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def test_an_auto_plan_on_claimed_cores_runs_unpinned_and_claims_nothing() -> None:
    other = core_claims.claim((0, 1), "runs/other")
    plan = plan_cpus((0, 1), 1, 1)
    out, claim = core_claims.claim_or_unpin(cfg(), plan)
    assert claim is None
    assert {name: p.cores for name, p in out.placements.items()} == {name: (0, 1) for name in plan.placements}
    assert all(p.nice == 0 for p in out.placements.values())
    assert out.warnings and "run.pin=always" in out.warnings[0] and "[0, 1]" in out.warnings[0]
    assert f"runs/other (pid {os.getpid()})" in out.warnings[0], "the warning names the run that holds the cores"
    other.release()


def test_free_cores_explicit_cores_or_pin_always_are_pinned_and_claimed() -> None:
    plan = plan_cpus((0, 1), 1, 1)
    out, mine = core_claims.claim_or_unpin(cfg(), plan)
    assert out is plan and mine is not None and mine.cores == (0, 1)
    for overrides in (["run.pin=always"], ["generator.cpus=0", "learner.cpus=1"]):
        out, claim = core_claims.claim_or_unpin(cfg(*overrides), plan)  # the cores are claimed by `mine`
        assert out is plan and claim is not None, overrides
        claim.release()
    mine.release()


def test_unpinned_keeps_the_actors_and_their_threads() -> None:
    plan = plan_cpus((0, 1, 2, 3), 2, 1, generator_threads=2)
    out = unpinned(plan, "why")
    assert set(out.placements) == set(plan.placements) and out.warnings == ["why"]
    assert all(out.placements[n].threads == plan.placements[n].threads for n in plan.placements)
    assert all(p.cores == (0, 1, 2, 3) for p in out.placements.values())


def test_a_claim_directory_that_cannot_be_written_pins_as_planned_and_says_so(claims_dir: Path) -> None:
    claims_dir.write_text("a file where the directory should be")
    plan = plan_cpus((0, 1), 1, 1)
    out, claim = core_claims.claim_or_unpin(cfg(), plan)
    assert claim is None and out.placements == plan.placements
    assert "not claimed" in out.warnings[-1] and core_claims.CLAIM_DIR_ENV in out.warnings[-1]


def test_claim_files_are_readable_by_other_users(claims_dir: Path) -> None:
    mine = core_claims.claim((0,))
    assert mine.path.stat().st_mode & 0o777 == 0o644
    assert claims_dir.stat().st_mode & 0o1777 == 0o1777
    mine.release()
