"""LeaseKeeper's bookkeeping around a renewal (the buffer's side is tested on the real service in
tests/integration/test_buffer_lease.py); the client is a stand-in: its subject here is the keeper's thread."""

from __future__ import annotations

import threading
import time

from async_rlhf.learner.lease import LeaseKeeper


class AckDuringRenewal:
    """A renewal that takes a moment, during which the learner acknowledges ``acked``: the buffer then answers
    that this consumer no longer holds them (they are acknowledged), as well as ``taken`` (another learner's)."""

    def __init__(self, keeper_box: dict, acked: list[str], taken: list[str]) -> None:
        self.box, self.acked, self.taken = keeper_box, acked, taken
        self.calls = 0
        self.answered = threading.Event()

    def renew(self, ids: list[str]) -> list[str]:
        self.calls += 1
        self.box["keeper"].done(self.acked)  # the main thread acknowledges while the renewal is on its way
        self.answered.set()
        return [gid for gid in ids if gid in self.acked or gid in self.taken]

    def close(self) -> None:
        pass


def test_groups_acknowledged_while_a_renewal_runs_are_not_reported_lost() -> None:
    box: dict = {}
    client = AckDuringRenewal(box, acked=["a"], taken=["b"])
    keeper = box["keeper"] = LeaseKeeper(lambda: client, period_s=0.05)
    keeper.hold(["a", "b", "c"])
    try:
        assert client.answered.wait(5.0)
        deadline = time.monotonic() + 5.0
        while keeper.renewals < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        keeper.close()
    assert keeper.lost == {"b"}, "an acknowledged group is not lost; one another learner took is"
    assert "a" not in keeper.held()


def test_take_share_leaves_out_lost_groups_and_fetches_others() -> None:
    """Issue 44, item 12: a group the buffer reported lost (another learner took it) while the rank waited for the
    rest of its share is not trained here; one lost and then delivered to this rank again is held anew, once."""
    from types import SimpleNamespace

    from async_rlhf.learner.lease import take_share

    keeper = LeaseKeeper(lambda: None, period_s=60.0)  # no renewal runs: the test says what was lost
    deliveries = iter([["a", "b"], ["c"], ["b", "d"]])

    def get(n: int) -> list:
        ids = next(deliveries)
        if ids == ["c"]:
            keeper.lost.update({"a", "b"})  # the late renewal's answer, while the rank waited for more
        return [SimpleNamespace(group_id=gid) for gid in ids]

    try:
        groups, left_out = take_share(get, keeper, 3)
    finally:
        keeper.close()
    assert [g.group_id for g in groups] == ["c", "b", "d"] and left_out == 2
    assert keeper.dropped == 2 and keeper.lost == set() and sorted(keeper.held()) == ["b", "c", "d"]
