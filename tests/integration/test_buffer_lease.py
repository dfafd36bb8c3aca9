"""A learner step longer than ``buffer.visibility_timeout_s`` (issue 31, defect 8): the real buffer service hands
a delivered group to another learner once its visibility timeout passes. A slow learner that renews its lease
(``async_rlhf.learner.lease.LeaseKeeper``, what the learner runs while its step trains) keeps its groups: nobody
else gets them and each is trained exactly once. Without renewal the same slow hold loses them (the defect)."""

from __future__ import annotations

import time

import pytest
from test_buffer_service import make_group

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.service import BufferLogic, BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.learner.lease import LeaseKeeper
from async_rlhf.types import Group

pytestmark = pytest.mark.integration

VISIBILITY_S = 0.4
HOLD_S = 2.0  # the slow learner's step: five visibility timeouts


@pytest.fixture
def svc():
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=1, visibility_timeout_s=VISIBILITY_S)
    service = BufferService(logic, host="127.0.0.1", port=0).start()
    try:
        yield service
    finally:
        service.stop()


def _slow_step(svc: BufferService, lease: LeaseKeeper | None) -> tuple[list[str], list[str]]:
    """Learner A takes 2 groups and trains for HOLD_S (renewing with ``lease``); learner B keeps asking meanwhile.
    Returns (ids A trained, ids B got)."""
    gen = BufferClient(svc.address, timeout_s=5.0)
    a = BufferClient(svc.address, timeout_s=5.0, consumer="learner-0")
    b = BufferClient(svc.address, timeout_s=5.0, consumer="learner-1")
    try:
        assert gen.admit(2)[0] == 2
        assert gen.put_many([make_group("g0"), make_group("g1")])
        got: list[Group] = a.get(2, version=0, wait_s=2.0)
        ids = [g.group_id for g in got]
        assert sorted(ids) == ["g0", "g1"]
        if lease is not None:
            lease.hold(ids)
        stolen: list[str] = []
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:  # A's long step; B is hungry
            stolen += [g.group_id for g in b.get(1, version=0, wait_s=0.2)]
        if lease is not None:
            lease.done(ids)
        a.ack(ids)
        if stolen:
            b.ack(stolen)
        return ids, stolen
    finally:
        for c in (gen, a, b):
            c.close()


def test_a_slow_learner_without_a_lease_loses_its_groups_to_another(svc: BufferService) -> None:
    trained, stolen = _slow_step(svc, None)
    assert set(stolen) == {"g0", "g1"}  # the defect: both trained twice (by A, and by B, again and again)
    assert svc.call(lambda: svc.logic.counters["returned_visibility_timeout"]) >= 2


def test_a_slow_learner_renewing_its_lease_keeps_its_groups(svc: BufferService) -> None:
    lease = LeaseKeeper(lambda: BufferClient(svc.address, timeout_s=5.0, consumer="learner-0"), VISIBILITY_S / 4)
    try:
        trained, stolen = _slow_step(svc, lease)
    finally:
        lease.close()
    assert stolen == [], f"groups held by a learner that renews its lease went to another: {stolen}"
    assert lease.lost == set() and lease.renewals >= HOLD_S / VISIBILITY_S
    stats = svc.call(lambda: svc.logic.stats(ledger=True))
    assert stats["ledger"]["trained"] == ["g0", "g1"] and stats.get("buffer/redelivered", 0) == 0
    assert stats.get("buffer/returned_visibility_timeout", 0) == 0 and stats.get("buffer/duplicate_ack", 0) == 0


def test_a_lapsed_lease_comes_back_to_its_learner_unless_another_took_the_group(svc: BufferService) -> None:
    """A renewal that comes late (the learner's process starved for a while): a group not yet taken by another
    learner is delivered back to it; one another learner took is reported lost (do not train it)."""
    gen = BufferClient(svc.address, timeout_s=5.0)
    a = BufferClient(svc.address, timeout_s=5.0, consumer="learner-0")
    b = BufferClient(svc.address, timeout_s=5.0, consumer="learner-1")
    try:
        assert gen.admit(2)[0] == 2 and gen.put_many([make_group("g0"), make_group("g1")])
        assert len(a.get(2, version=0, wait_s=2.0)) == 2
        time.sleep(VISIBILITY_S + 0.5)  # both go back to the held groups
        assert [g.group_id for g in b.get(1, version=0, wait_s=1.0)] == ["g0"]
        b.ack(["g0"])
        assert a.renew(["g0", "g1"]) == ["g0"]  # g1 is A's again; g0 was B's
        assert a.renew(["g1"]) == []
        assert b.get(1, version=0, wait_s=VISIBILITY_S / 4) == []  # g1 stays with A
        a.ack(["g1"])
        assert svc.call(lambda: svc.logic.stats(ledger=True))["ledger"]["trained"] == ["g0", "g1"]
    finally:
        for c in (gen, a, b):
            c.close()


def test_a_group_whose_lease_was_lost_is_left_out_of_the_step_and_replaced(svc: BufferService) -> None:
    """Issue 44, item 12: learner A's renewals come late (its keeper renews every two visibility timeouts, a
    starved process) while it waits for the rest of its share; learner B takes g0 meanwhile. A's step leaves g0
    out and trains a replacement (``take_share``, the learner's wait for data), so every group is trained once:
    g0 by B, the others by A. Without it A trained g0 too, and its ack made B's a duplicate (the defect)."""
    from async_rlhf.learner.lease import take_share

    gen = BufferClient(svc.address, timeout_s=5.0)
    a = BufferClient(svc.address, timeout_s=5.0, consumer="learner-0")
    b = BufferClient(svc.address, timeout_s=5.0, consumer="learner-1")
    lease = LeaseKeeper(lambda: BufferClient(svc.address, timeout_s=5.0, consumer="learner-0"), VISIBILITY_S * 2)
    stolen: list[str] = []
    calls = 0

    def get(n: int) -> list[Group]:
        """A's gets: g0 and g1 first; then (after B took g0 and A's late renewal learnt it) one new group each."""
        nonlocal calls
        calls += 1
        if calls == 1:
            assert gen.admit(2)[0] == 2 and gen.put_many([make_group("g0"), make_group("g1")])
            return a.get(2, version=0, wait_s=2.0)
        if calls == 2:
            deadline = time.monotonic() + 10.0
            while not stolen and time.monotonic() < deadline:  # B is hungry while A waits for the rest
                stolen.extend(g.group_id for g in b.get(1, version=0, wait_s=0.2))
            b.ack(stolen)  # B trains it at once
            while lease.renewals < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        gid = f"g{calls}"
        assert gen.admit(1)[0] == 1 and gen.put_many([make_group(gid)])
        return a.get(1, version=0, wait_s=2.0)

    try:
        groups, left_out = take_share(get, lease, 3)
        trained = [g.group_id for g in groups]
        lease.done()
        a.ack(trained)
    finally:
        lease.close()
        for c in (gen, a, b):
            c.close()
    assert stolen == ["g0"] and lease.lost == set()
    assert sorted(trained) == ["g1", "g2", "g3"] and left_out == 1 and lease.dropped == 1
    stats = svc.call(lambda: svc.logic.stats(ledger=True))
    assert stats["ledger"]["trained"] == ["g0", "g1", "g2", "g3"]
    assert stats.get("buffer/duplicate_ack", 0) == 0 and stats.get("buffer/lease_reclaimed", 0) == 1
