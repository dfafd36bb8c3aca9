"""Two receive slots: the sender never waits for a member to swap a version in. A fetch loop (as in the
generator's worker) receives every push back to back while the engine thread applies only the newest; with one
slot the same push waits until the member has applied the last one. One process, a real TCPStore and gloo."""

import threading
import time

import pytest
import torch
from test_weight_push_preposted import HOST, SPECS, params, wait_until

from async_rlhf.sync.group import SyncTimeout
from async_rlhf.sync.layout import plan_buckets
from async_rlhf.sync.receiver import Receiver
from async_rlhf.sync.sender import Sender

pytestmark = pytest.mark.distributed


class FetchLoop:
    """A receiver whose fetch thread never stops (``keep_staged``), as the generator's worker runs it."""

    def __init__(self, sender: Sender, buckets, buffers: int) -> None:
        self.rx = Receiver(buckets, "gen0", HOST, sender.port, timeout_s=sender.timeout_s, buffers=buffers)
        self.latest = None
        self.cond = threading.Condition()
        self.stop = threading.Event()
        joined = threading.Thread(target=self.rx.join, daemon=True)
        joined.start()
        sender.form(["gen0"], timeout_s=10.0)
        joined.join(10)
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                staged = self.rx.fetch(1.0, keep_staged=True)
            except SyncTimeout:
                continue
            except Exception:
                if self.stop.is_set():  # the sender closed the store under a fetch at the end of the test
                    return
                raise
            with self.cond:
                self.latest = staged
                self.cond.notify_all()

    def apply_newest(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.cond:
            self.cond.wait_for(lambda: self.latest is not None, timeout=10)
            staged, self.latest = self.latest, None
        model: dict[str, torch.Tensor] = {}
        self.rx.apply(staged, lambda it: model.update((n, t.clone()) for n, t in it))
        return staged.version, model


def push_in_background(sender: Sender, version: int) -> threading.Thread:
    th = threading.Thread(target=sender.push, args=(params(version), version), daemon=True)
    th.start()
    return th


def test_with_two_slots_pushes_never_wait_for_a_swap_and_only_the_newest_is_applied() -> None:
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    member = FetchLoop(sender, buckets, buffers=2)
    try:
        for v in (1, 2, 3, 4):  # the engine applies nothing meanwhile: every push completes anyway
            th = push_in_background(sender, v)
            th.join(5)
            assert not th.is_alive(), f"push {v} waited for the member to apply an earlier version"
        wait_until(lambda: member.latest is not None and member.latest.version == 4, "version 4 staged")
        version, model = member.apply_newest()
        assert version == 4 and member.rx.coalesced == 3  # 1, 2 and 3 were never loaded
        assert torch.equal(model["w"], params(4)["w"]) and torch.equal(model["n"], params(4)["n"])
        sender.push(params(5), 5)  # and the loop goes on with the next one
        version, model = member.apply_newest()
        assert version == 5 and torch.equal(model["w"], params(5)["w"])
    finally:
        member.stop.set()
        sender.close()


def test_with_one_slot_a_push_waits_until_the_last_version_is_applied() -> None:
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    member = FetchLoop(sender, buckets, buffers=1)
    try:
        push_in_background(sender, 1).join(5)
        wait_until(lambda: member.latest is not None, "version 1 staged")
        blocked = push_in_background(sender, 2)
        time.sleep(1.0)
        assert blocked.is_alive(), "with one slot, version 2 overwrote version 1 before it was applied"
        version, model = member.apply_newest()
        assert version == 1 and torch.equal(model["w"], params(1)["w"])
        blocked.join(5)
        assert not blocked.is_alive()
        version, _ = member.apply_newest()
        assert version == 2 and member.rx.coalesced == 0
    finally:
        member.stop.set()
        sender.close()


def test_the_learner_push_returns_at_once_and_publishes_the_version_once_every_member_holds_it() -> None:
    from async_rlhf.buffer.client import BufferClient
    from async_rlhf.buffer.logic import BufferLogic
    from async_rlhf.buffer.service import BufferService
    from async_rlhf.buffer.store import MemoryStore
    from async_rlhf.config import load_config
    from async_rlhf.learner.push import WeightPusher

    service = BufferService(BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=0)).start()
    buckets = plan_buckets(SPECS, 64)
    pusher = WeightPusher(load_config(None, ["sync.timeout_s=10"]), buckets, HOST, 0, service.address)
    member = FetchLoop(pusher.sender, buckets, buffers=1)
    watcher = BufferClient(service.address, timeout_s=5.0)
    try:
        pusher.start(params(1), 1)
        assert pusher.wait()["sync/version"] == 1.0
        assert watcher.stats()["buffer/version"] == 1  # published once the member acknowledged it
        # version 1 is staged and not applied: the member's only slot is taken, so version 2 cannot arrive;
        # start() returns all the same (the learner goes on training) and wait() is what blocks
        t0 = time.monotonic()
        pusher.start(params(2), 2)
        assert time.monotonic() - t0 < 0.5 and pusher.in_flight
        time.sleep(0.5)
        assert watcher.stats()["buffer/version"] == 1, "version 2 was published before the member held it"
        assert member.apply_newest()[0] == 1  # frees the slot: version 2 goes through
        assert pusher.wait()["sync/version"] == 2.0 and watcher.stats()["buffer/version"] == 2
        version, model = member.apply_newest()
        assert version == 2 and torch.equal(model["w"], params(2)["w"])
        pusher.start(params(3), 3)
        with pytest.raises(RuntimeError, match="in flight"):
            pusher.start(params(4), 4)
        member.apply_newest()
        pusher.wait()
    finally:
        member.stop.set()
        watcher.close()
        pusher.close()
        pusher.sender.close()
        service.stop()
