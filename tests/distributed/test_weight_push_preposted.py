"""The push's fast path: after the first push of an epoch a member posts its receives at once and learns the
version from the header on the group (no store round trip). What must stay true around it: a layout change
opens a new epoch, a joiner moves pre-posted members to the next epoch, and receives that outlive the group's
own timeout are recovered by joining again. One process, a real TCPStore and real gloo groups."""

import threading
import time

import pytest
import torch
from conftest import joins_noticed, poll_joiners

from async_rlhf.sync.layout import TensorSpec, plan_buckets
from async_rlhf.sync.receiver import Receiver
from async_rlhf.sync.sender import PushError, Sender

pytestmark = pytest.mark.distributed

HOST = "127.0.0.1"
SPECS = [TensorSpec("w", (8, 4), "float32"), TensorSpec("n", (6,), "bfloat16")]


def params(version: int, rows: int = 8) -> dict[str, torch.Tensor]:
    return {"w": torch.full((rows, 4), float(version)), "n": torch.full((6,), version / 2).to(torch.bfloat16)}


class Member:
    """A receiver on a thread that receives ``count`` versions into its own tensors."""

    def __init__(self, sender: Sender, member_id: str, buckets, fetch_timeout_s: float = 20.0) -> None:
        self.rx = Receiver(buckets, member_id, HOST, sender.port, timeout_s=sender.timeout_s)
        self.model: dict[str, torch.Tensor] = {}
        self.got: list = []
        self.fetch_timeout_s = fetch_timeout_s

    def load(self, it) -> None:
        for name, t in it:
            self.model[name] = t.clone()

    def receive(self, count: int) -> threading.Thread:
        def run() -> None:
            try:
                for _ in range(count):
                    self.got.append(self.rx.receive(self.load, timeout_s=self.fetch_timeout_s))
            except Exception as exc:  # reported to the test thread
                self.got.append(exc)
        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th


def start(members: list[Member], sender: Sender) -> None:
    threads = [threading.Thread(target=m.rx.join, daemon=True) for m in members]
    for th in threads:
        th.start()
    sender.form([m.rx.member_id for m in members], timeout_s=10.0)
    for th in threads:
        th.join(10)


def wait_until(cond, what: str, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def three_pushes_to_one_member() -> list:
    """Form a group with gen0, push versions 1-3 and check each arrived byte-exact; gen0's receipts."""
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    gen0 = Member(sender, "gen0", buckets)
    start([gen0], sender)
    th = gen0.receive(3)
    for v in (1, 2, 3):
        sender.push(params(v), v)
        wait_until(lambda v=v: len(gen0.got) == v, f"version {v} at gen0")
    th.join(10)
    assert [g.version for g in gen0.got] == [1, 2, 3], gen0.got
    assert torch.equal(gen0.model["w"], params(3)["w"]) and torch.equal(gen0.model["n"], params(3)["n"])
    assert sender.epoch == 0
    sender.close()
    return gen0.got


def test_pushes_after_the_first_of_an_epoch_are_preposted_and_byte_exact():
    got = three_pushes_to_one_member()
    assert [g.metrics["sync/preposted"] for g in got] == [0.0, 1.0, 1.0]


def test_a_layout_change_opens_a_new_epoch_and_a_joiner_moves_preposted_members():
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    gen0 = Member(sender, "gen0", buckets)
    start([gen0], sender)
    gen0.receive(1).join(0)
    sender.push(params(1), 1)
    wait_until(lambda: len(gen0.got) == 1, "version 1")

    # gen0 is pre-posted for the next push of epoch 0; a joiner makes that push open epoch 1 instead
    th0 = gen0.receive(1)
    gen1 = Member(sender, "gen1", buckets)
    th1 = gen1.receive(1)
    wait_until(lambda: "gen1" in poll_joiners(sender), "gen1 to ask to join")
    sender.push(params(2), 2)
    th0.join(10)
    th1.join(10)
    assert sender.epoch == 1 and sender.members == ["gen0", "gen1"]
    assert [g.version for g in gen0.got] == [1, 2] and [g.version for g in gen1.got] == [2], (gen0.got, gen1.got)
    assert gen0.got[-1].epoch == 1

    # a new layout on both sides (another shape): the sender opens epoch 2 rather than change the wire
    # under members pre-posted for the old one
    wide = [TensorSpec("w", (16, 4), "float32"), SPECS[1]]
    wide_buckets = plan_buckets(wide, 64)
    sender.use_layout(wide_buckets)
    for m in (gen0, gen1):
        m.rx.use_layout(wide_buckets)
    threads = [m.receive(2) for m in (gen0, gen1)]
    for v in (3, 4):
        sender.push(params(v, rows=16), v)
        wait_until(lambda v=v: all(len(m.got) == v - (m is gen1) for m in (gen0, gen1)), f"version {v}")
    for th in threads:
        th.join(10)
    assert sender.epoch == 2
    for m in (gen0, gen1):
        assert [g.version for g in m.got[-2:]] == [3, 4] and m.got[-1].metrics["sync/preposted"] == 1.0
        assert torch.equal(m.model["w"], params(4, rows=16)["w"])
    sender.close()


def test_receives_that_outlive_the_group_timeout_join_again_and_get_the_next_version():
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=1.5)  # also the gloo group's own timeout
    gen0 = Member(sender, "gen0", buckets, fetch_timeout_s=15.0)
    start([gen0], sender)
    gen0.receive(1).join(0)
    sender.push(params(1), 1)
    wait_until(lambda: len(gen0.got) == 1, "version 1")
    th = gen0.receive(1)  # pre-posts for push 1 of epoch 0, which comes only after the group's timeout
    wait_until(lambda: joins_noticed(sender), "gen0 to join again once its receives expired", limit_s=10.0)
    sender.push(params(2), 2)
    th.join(10)
    assert [g.version if not isinstance(g, Exception) else g for g in gen0.got] == [1, 2]
    assert sender.epoch == 1 and sender.members == ["gen0"]
    assert torch.equal(gen0.model["w"], params(2)["w"])
    sender.close()


def test_a_member_that_changes_layout_alone_refuses_the_push_and_the_next_one_names_it():
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=5.0, slice_s=0.05)
    gen0 = Member(sender, "gen0", buckets)
    start([gen0], sender)
    gen0.receive(1).join(0)
    sender.push(params(1), 1)
    wait_until(lambda: len(gen0.got) == 1, "version 1")

    gen0.rx.use_layout(plan_buckets([TensorSpec("w", (16, 4), "float32"), SPECS[1]], 64))  # the sender keeps its own
    th = gen0.receive(1)  # pre-posted with the epoch's wire: the bytes arrive, the acknowledgement says whose layout
    sender.push(params(2), 2)
    th.join(10)
    assert isinstance(gen0.got[-1], Exception) and "layout mismatch" in str(gen0.got[-1]), gen0.got[-1]
    assert "w" in gen0.model and torch.equal(gen0.model["w"], params(1)["w"]), "a refused version was loaded"

    # it asked to join again, so the next push rebuilds the group, and there it refuses before any byte
    wait_until(lambda: joins_noticed(sender), "gen0 to ask to join again")
    th = gen0.receive(1)
    with pytest.raises(PushError) as info:
        sender.push(params(3), 3)
    th.join(10)
    assert info.value.errors.keys() == {"gen0"} and "layout mismatch" in info.value.errors["gen0"], str(info.value)
    sender.close()


def test_without_preposting_every_push_goes_through_the_store_header(monkeypatch):
    # what an NCCL group does (a posted NCCL collective would hold the GPU between pushes): same results
    from async_rlhf.sync import protocol

    monkeypatch.setattr(protocol, "PREPOSTS", ())
    got = three_pushes_to_one_member()
    assert [g.metrics["sync/preposted"] for g in got] == [0.0, 0.0, 0.0]


def test_the_cut_follows_where_the_senders_tensors_lie_and_a_change_opens_a_new_epoch():
    # parameters kept flat go out as one broadcast (as a raw one); separate ones as the packed cut: a large
    # tensor from its own storage, small ones packed. Members pre-posted for one cut must never see the other
    from async_rlhf.sync.layout import auto_chunk_bytes
    from async_rlhf.sync.tensors import arena_offsets, cut_arena, flatten_params

    specs = [TensorSpec(f"small{i}", (64, 64), "float32") for i in range(8)]
    specs.append(TensorSpec("big", (768, 1024), "float32"))
    buckets = plan_buckets(specs, 8 << 20)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    packed = cut_arena(buckets, auto_chunk_bytes(arena_offsets(buckets)[1]), sender.own_bytes)
    assert len(packed) >= 3  # the run of small tensors, then the big one in parts
    gen0 = Member(sender, "gen0", buckets)
    start([gen0], sender)

    def weights(v: int) -> dict[str, torch.Tensor]:
        return {s.name: torch.full(s.shape, float(v) + i) for i, s in enumerate(specs)}

    flat_params = weights(0)
    flatten_params(flat_params, buckets)
    th = gen0.receive(5)
    seen = []
    for v, flat in [(1, False), (2, True), (3, True), (4, False), (5, False)]:
        if flat:
            for name, t in weights(v).items():
                flat_params[name].copy_(t)
        metrics = sender.push(flat_params if flat else weights(v), v)
        wait_until(lambda v=v: len(gen0.got) == v, f"version {v}")
        assert all(torch.equal(gen0.model[n], t) for n, t in weights(v).items()), f"version {v} arrived wrong"
        assert gen0.rx.chunks == sender.chunks
        seen.append((sender.epoch, len(sender.chunks), gen0.got[-1].metrics["sync/preposted"],
                     metrics["sync/pack_s"] > 0))
    th.join(10)
    n = len(packed)
    assert seen == [(0, n, 0.0, True), (1, 1, 0.0, False), (1, 1, 1.0, False), (2, n, 0.0, True),
                    (2, n, 1.0, True)], seen
    sender.close()
