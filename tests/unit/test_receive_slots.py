"""Receive slots carry the version they were filled with (issue 31): a slot is loaded only while it holds the
version asked for, so an apply that races a receive into the same slot, or a version staged by a replaced
receiver, never reaches the engine."""

import threading

import pytest

from async_rlhf.sync.group import SyncError
from async_rlhf.sync.layout import TensorSpec, plan_buckets
from async_rlhf.sync.receive_slots import ReceiveSlots


def slots(n: int) -> ReceiveSlots:
    s = ReceiveSlots(n)
    s.use_layout(plan_buckets([TensorSpec("w", (4,), "float32")], 1024))
    return s


def test_a_slot_never_filled_is_not_loaded() -> None:
    s = slots(2)
    with pytest.raises(SyncError, match="no longer holds version 3"):
        with s.applying(0, 3):
            pass


def test_a_staged_slot_reused_for_the_next_receive_is_not_loaded() -> None:
    s = slots(1)
    s.staged_into(0, 1)
    assert s.holds(0) == 1
    assert s.free(keep_staged=False, posted=None) == 0  # a standing receive supersedes the staged version
    assert s.holds(0) is None
    with pytest.raises(SyncError):
        s.claim(0, 1)
    s.staged_into(0, 2)
    with s.applying(0, 2):
        assert s.free(keep_staged=False, posted=None) is None  # no receive into a slot being loaded


def test_a_claimed_slot_is_never_posted_into_while_a_newer_version_arrives() -> None:
    """The apply/prepost race: the engine took v1 (slot 0), v2 arrived in slot 1 before the load started; the
    fetch thread's next receive must not go into slot 0."""
    s = slots(2)
    s.staged_into(0, 1)
    s.claim(0, 1)  # apply_update takes v1 and claims its slot at once
    s.staged_into(1, 2)
    assert s.free(keep_staged=True, posted=None) is None  # slot 0 is being applied, slot 1 holds the newest
    with s.applying(0, 1):  # the load proper
        pass
    assert s.free(keep_staged=True, posted=None) == 0  # free again after the load


def test_wait_for_free_returns_when_stopped() -> None:
    s = slots(1)
    s.staged_into(0, 1)
    stop = threading.Event()
    done = threading.Event()
    t = threading.Thread(target=lambda: (s.wait_for_free(float("inf"), stop.is_set), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.2)
    stop.set()
    assert done.wait(2.0)


def test_one_apply_at_a_time() -> None:
    s = slots(2)
    s.staged_into(0, 1)
    s.staged_into(1, 2)
    s.claim(0, 1)
    with pytest.raises(SyncError, match="slot 0 is being applied"):
        s.claim(1, 2)  # before, it took the claim over and slot 0 could be received into mid-load
    s.release(0)
    s.claim(1, 2)
