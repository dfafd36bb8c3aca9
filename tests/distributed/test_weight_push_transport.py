"""The push through the transport interface: whole pushes (sender and two members, real TCPStore and
protocol) over a stand-in backend on another device than the learner's parameters ("meta" here, as CUDA
would be under NCCL). Every tensor the backend is handed must be on the transport's device: the parameters
(CPU) are staged through the sender's slots, the members receive into arenas on that device and the
acknowledgements are tensors there too. The stand-in completes a collective once every rank posted it and
sums the acknowledgement values, so the protocol runs as on a real group (the NCCL path: a store header
per push, no pre-posted receives)."""

import threading
import time
from collections import defaultdict

import pytest
import torch
from test_weight_push_preposted import HOST, SPECS, Member, params, start

from async_rlhf.sync.layout import plan_buckets
from async_rlhf.sync.sender import Sender
from async_rlhf.sync.transport import Transport, wait_polled

pytestmark = pytest.mark.distributed


class Wire:
    """What the ranks of one group post, per collective (matched by order, as NCCL matches them)."""

    def __init__(self, world: int) -> None:
        self.world, self.lock = world, threading.Lock()
        self.ops: defaultdict[int, dict[int, int]] = defaultdict(dict)
        self.devices: list[tuple[int, str, torch.device]] = []


class Group:
    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank, self.n = wire, rank, 0


class Work:
    def __init__(self, wire: Wire, n: int) -> None:
        self.wire, self.n = wire, n

    def is_completed(self) -> bool:
        with self.wire.lock:
            return len(self.wire.ops[self.n]) == self.wire.world


class StandIn(Transport):
    name = "stand-in"
    survives_member_loss = False

    def __init__(self, wire: Wire) -> None:
        super().__init__("meta")
        self.wire = wire
        self.values: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, value): meta holds no values
        self.results: dict[int, int] = {}

    def int64s(self, values: list[int]) -> torch.Tensor:
        t = super().int64s(values)
        self.values[id(t)] = (t, values[0])
        return t

    def open(self, store, rank, world, timeout_s, names=None):
        return Group(self.wire, rank)

    def _post(self, group: Group, kind: str, tensor: torch.Tensor, value: int) -> Work:
        n, group.n = group.n, group.n + 1
        with self.wire.lock:
            self.wire.ops[n][group.rank] = value
            self.wire.devices.append((group.rank, kind, tensor.device))
        return Work(self.wire, n)

    def _broadcast(self, group, tensor, root):
        return self._post(group, "broadcast", tensor, 0)

    def _allreduce(self, group, tensor):
        work = self._post(group, "allreduce", tensor, self.values[id(tensor)][1])
        self.results[id(tensor)] = work.n
        return work

    def read_int(self, t: torch.Tensor) -> int:
        with self.wire.lock:
            return sum(self.wire.ops[self.results[id(t)]].values())

    def wait(self, work, deadline, what, abort=None, slice_s=0.2):
        wait_polled(work.is_completed, deadline, what, abort, slice_s, 0.001)

    def retire(self, group, pending):
        pass


def test_every_tensor_the_backend_gets_is_on_the_transports_device() -> None:
    wire = Wire(world=3)
    buckets = plan_buckets(SPECS, 64)
    # own_bytes: "w" (128 bytes) would go out straight from its storage if that storage were on the device
    sender = Sender(buckets, HOST, 0, backend=StandIn(wire), timeout_s=10.0, own_bytes=64)
    members = []
    for mid in ("gen0", "gen1"):
        m = Member(sender, mid, buckets)
        m.rx.transport = StandIn(wire)  # before anything is allocated or opened
        m.rx.backend = m.rx.transport.name
        members.append(m)
    try:
        start(members, sender)
        seen: list[torch.device] = []
        for m in members:
            m.load = lambda it, seen=seen: seen.extend(t.device for _, t in it)
        threads = [m.receive(2) for m in members]
        for v in (1, 2):
            metrics = sender.push(params(v), v)  # CPU parameters
            assert metrics["sync/pack_s"] > 0  # staged through the slots: not sent from CPU memory
        for th in threads:
            th.join(10)
        for m in members:
            assert [getattr(g, "version", g) for g in m.got] == [1, 2]
        kinds = {(rank, kind) for rank, kind, _ in wire.devices}
        assert {(r, k) for r in range(3) for k in ("broadcast", "allreduce")} <= kinds
        assert {d for _, _, d in wire.devices} == {torch.device("meta")}
        assert sender._staging.slots and all(s.device.type == "meta" for s in sender._staging.slots)
        assert seen and set(seen) == {torch.device("meta")}  # the engine is handed views of the device arena
    finally:
        sender.close()
        time.sleep(0.05)


def test_each_tp_worker_of_an_engine_joins_and_receives_as_its_own_member() -> None:
    """The generator's worker extension in two TP workers of one engine (what ``collective_rpc`` reaches): each
    joins the push group under its own id and receives the whole version (gloo, as on CPU)."""
    from types import SimpleNamespace

    from async_rlhf.generator.worker_ext import WeightSyncWorker, common_staged
    from async_rlhf.sync.layout import layout_to_wire
    from async_rlhf.sync.protocol import tp_member_ids

    class Worker(WeightSyncWorker):
        def __init__(self, rank: int) -> None:
            self.rank, self.parallel_config = rank, SimpleNamespace(tensor_parallel_size=2)

    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    workers = [Worker(0), Worker(1)]
    try:
        for w in workers:  # the same call on every worker, as collective_rpc makes it
            w.init_receiver(HOST, sender.port, "gen0", layout_to_wire(buckets), "gloo", 10.0, 1)
        assert [w._receiver.member_id for w in workers] == ["gen0.tp0", "gen0.tp1"]
        joins = [threading.Thread(target=w.join_push_group, args=(10.0,), daemon=True) for w in workers]
        for th in joins:
            th.start()
        sender.form(tp_member_ids("gen0", 2), timeout_s=10.0)
        for th in joins:
            th.join(10)
        assert sender.members == ["gen0.tp0", "gen0.tp1"]
        staged: dict[int, object] = {}
        fetches = [threading.Thread(target=lambda i=i, w=w: staged.update({i: w._receiver.fetch(10.0)}), daemon=True)
                   for i, w in enumerate(workers)]  # what each worker's fetch thread does for one push
        for th in fetches:
            th.start()
        sender.push(params(1), 1)
        for th in fetches:
            th.join(10)
        assert common_staged([getattr(staged.get(i), "version", None) for i in range(2)]) == 1
        for i, w in enumerate(workers):
            got: dict[str, torch.Tensor] = {}
            w._receiver.apply(staged[i], lambda it, got=got: got.update((n, t.clone()) for n, t in it))
            assert torch.equal(got["w"], params(1)["w"]) and torch.equal(got["n"], params(1)["n"])
    finally:
        sender.close()
