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
