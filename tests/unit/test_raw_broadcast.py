"""The raw broadcast a push is measured against (async_rlhf/sync/raw.py): every member's receive is posted before
the sender starts each repetition, the warm-up is not returned, both ends leave the group; bad arguments refused.
A stand-in transport (the real gloo path runs in tests/cluster's 8 + 8 scenario)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from async_rlhf.sync.raw import raw_receive, raw_send
from async_rlhf.sync.transport import Transport


class Logged(Transport):
    """Rank ``rank``'s end: every op goes to the shared ``log``; the sender checks, as it broadcasts, that each
    member's receive of that repetition is already posted."""

    name = "logged"
    survives_member_loss = True

    def __init__(self, rank: int, log: list[tuple[int, str, int]], members: int = 0) -> None:
        super().__init__("cpu")
        self.rank, self.log, self.members = rank, log, members
        self.sent = 0
        self.posted_before: list[int] = []

    def open(self, store, rank, world, timeout_s, names=None):
        assert rank == self.rank
        self.log.append((rank, "open", world))
        return "group"

    def _broadcast(self, group, tensor, root):
        if self.rank == 0:
            self.posted_before.append(sum(1 for r, op, _ in self.log if r > 0 and op == "broadcast"))
        self.log.append((self.rank, "broadcast", tensor.numel()))
        return "work"

    def _allreduce(self, group, tensor):
        self.log.append((self.rank, "allreduce", tensor.numel()))
        return "work"

    def wait(self, work, deadline, what, abort=None, slice_s=0.2):
        pass

    def retire(self, group, pending):
        self.log.append((self.rank, "retire", 0))


def test_members_are_posted_before_each_timed_broadcast_and_the_warm_up_is_dropped() -> None:
    store, log, members, reps, nbytes = dist.HashStore(), [], 3, 4, 1000
    threads = [threading.Thread(target=raw_receive, args=(store, Logged(r, log), r, members + 1, nbytes, "t1", reps,
                                                          30.0)) for r in range(1, members + 1)]
    for t in threads:
        t.start()
    sender = Logged(0, log, members)
    seconds = raw_send(store, sender, nbytes, members + 1, "t1", reps, 30.0)
    for t in threads:
        t.join(30)
    assert len(seconds) == reps and all(s >= 0 for s in seconds)
    # (the stand-in's waits return at once, so members may run ahead: at least this repetition's receives)
    assert all(n >= members * (r + 1) for r, n in enumerate(sender.posted_before)), "a member was not posted yet"
    assert len(sender.posted_before) == reps + 1
    for rank in range(members + 1):
        ops = [(op, n) for r, op, n in log if r == rank]
        assert ops == [("open", members + 1), *[("broadcast", nbytes), ("allreduce", 1)] * (reps + 1), ("retire", 0)]


def test_bad_arguments_are_refused() -> None:
    store = dist.HashStore()
    with pytest.raises(ValueError, match="world=1"):
        raw_send(store, Logged(0, []), 10, 1, "t", 1, 1.0)
    with pytest.raises(ValueError, match="rank"):
        raw_receive(store, Logged(3, []), 3, 3, 10, "t", 1, 1.0)
    with pytest.raises(ValueError, match="tag"):
        raw_send(store, Logged(0, []), 10, 2, "a/b", 1, 1.0)


def test_each_broadcast_waits_idle_s_after_the_members_posted_and_the_wait_is_not_timed() -> None:
    store, log, members, reps, idle_s = dist.HashStore(), [], 2, 2, 0.2  # long beside a scheduling hiccup
    threads = [threading.Thread(target=raw_receive, args=(store, Logged(r, log), r, members + 1, 100, "t2", reps,
                                                          30.0)) for r in range(1, members + 1)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    seconds = raw_send(store, Logged(0, log, members), 100, members + 1, "t2", reps, 30.0, idle_s=idle_s)
    elapsed = time.perf_counter() - t0
    for t in threads:
        t.join(30)
    assert elapsed >= (reps + 1) * idle_s  # the warm-up waits too
    assert all(s < idle_s for s in seconds), seconds  # the stand-in's ops take no time; the wait is left out
    with pytest.raises(ValueError, match="idle_s"):
        raw_send(store, Logged(0, []), 10, 2, "t3", 1, 1.0, idle_s=-1.0)
