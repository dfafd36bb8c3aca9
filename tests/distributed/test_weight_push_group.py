"""The versioned push over real multi-process gloo groups: round trips, a dead and a hung receiver, a
rebuilt group, a late joiner.

The sender runs in the test process (so its exceptions are asserted directly); every receiver is a
spawned process that reports through a multiprocessing Queue, never through the group under test.
A watchdog turns a hang into a failure with every thread's traceback.
"""

import faulthandler
import hashlib
import os
import queue
import signal
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from conftest import poll_joiners, stop_process

from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import TensorSpec, layout_from_wire, layout_to_wire, plan_buckets
from async_rlhf.sync.receiver import Excluded, ReceiveError, Receiver
from async_rlhf.sync.sender import PushError, Sender
from async_rlhf.sync.tensors import dtype_name

pytestmark = pytest.mark.distributed

HOST = "127.0.0.1"
BUCKET_BYTES = 256
CHUNK_BYTES = 512  # several broadcasts per push: tensors split over chunks, chunks across buckets
SPAWN_S = 90.0  # spawning and importing torch under load: generous, and never part of a measured timeout
PUSH_TIMEOUT_S = 4.0


def make_params(version: int) -> dict[str, torch.Tensor]:
    """Every dtype the push carries, buckets of several tensors, a tensor larger than a bucket (sent from
    its own storage), a non-contiguous one, and a scalar; the values depend on the version."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "embed.weight": torch.randn(40, 8, generator=g),                          # 1280 B: a bucket of its own
        "layer0.q": torch.randn(4, 4, generator=g),
        "layer0.norm": torch.randn(9, generator=g).to(torch.bfloat16),
        "layer0.bias": torch.randn(3, 2, generator=g).to(torch.float16),
        "layer1.q_t": torch.randn(3, 5, generator=g).t(),                          # non-contiguous
        "layer1.norm": torch.randn(40, generator=g).to(torch.bfloat16),
        "lm_head.big": torch.randn(300, generator=g).to(torch.bfloat16),          # 600 B: alone, zero-copy
        "position_ids": torch.arange(7, dtype=torch.int64) * (1_000_000_007 + version),
        "scale": torch.tensor(1.5 + version, dtype=torch.float64),                # 0-dim
        "mask": (torch.rand(5, 3, generator=g) > 0.5).to(torch.uint8),
        "counts": torch.randint(-2**30, 2**30, (6,), generator=g, dtype=torch.int32),
    }


def digest(params: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha1(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in params.items()}


def layout_wire() -> list[dict]:
    specs = [TensorSpec(n, tuple(t.shape), dtype_name(t)) for n, t in make_params(0).items()]
    return layout_to_wire(plan_buckets(specs, BUCKET_BYTES))


def _exit(out, code: int = 0) -> None:
    """Flush the reports, then leave without the slow interpreter and torch teardown."""
    out.close()
    out.join_thread()
    os._exit(code)


class _BreaksMidPush(Receiver):
    """A receiver process that dies (exit code 3) or hangs once the first chunk of a push has arrived."""

    action: str
    out: object

    def _transfer(self, posted, version: int, deadline: float) -> None:
        assert len(posted.works) > 1
        posted.works[0].wait()  # mid-push
        self.out.put((self.me.id, self.action, None))
        if self.action == "die_mid_push":
            _exit(self.out, code=3)
        # a hang of the whole process, its transport's threads too (as a frozen or swapped-out process hangs)
        self.out.close()
        self.out.join_thread()
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)


def _member(port: int, member_id: str, layout: list, actions: list[str], out) -> None:
    """A receiver process. actions: join | recv | recv_any | die_mid_push | hang_mid_push."""
    torch.set_num_threads(1)
    try:
        model = {n: torch.zeros_like(t.contiguous()) for n, t in make_params(0).items()}

        def load(it):
            for name, t in it:
                model[name].copy_(t)

        rx = Receiver(layout_from_wire(layout), member_id, HOST, port, timeout_s=PUSH_TIMEOUT_S, slice_s=0.1)
        for action in actions:
            if action == "join":
                out.put((member_id, "joined", rx.join(timeout_s=SPAWN_S)))
            elif action == "recv":
                got = rx.receive(load, timeout_s=SPAWN_S)
                out.put((member_id, "received", (got.version, got.epoch, digest(model), got.metrics)))
            elif action in ("die_mid_push", "hang_mid_push"):
                rx.__class__ = _BreaksMidPush  # same state; its transfer stops after the first chunk
                rx.action, rx.out = action, out
                rx.receive(load, timeout_s=SPAWN_S)
            elif action == "recv_any":
                try:
                    got = rx.receive(load, timeout_s=SPAWN_S)
                    out.put((member_id, "received", (got.version, got.epoch, digest(model), got.metrics)))
                except (ReceiveError, Excluded) as exc:
                    out.put((member_id, "recv_failed", f"{type(exc).__name__}: {exc}"))
        out.put((member_id, "done", None))
    except Exception:
        out.put((member_id, "crash", traceback.format_exc()))
    _exit(out)


class Members:
    """Spawned receiver processes and their reports; every process is ended in ``close``."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs: dict[str, mp.Process] = {}
        self.events: list[tuple[str, str, object]] = []

    def start(self, port: int, member_id: str, actions: list[str]) -> None:
        p = self.ctx.Process(target=_member, args=(port, member_id, layout_wire(), actions, self.out), daemon=True)
        p.start()
        self.procs[member_id] = p

    def wait_for(self, member_id: str, event: str, timeout_s: float = SPAWN_S):
        deadline = time.monotonic() + timeout_s
        for who, ev, payload in self.events:
            if (who, ev) == (member_id, event):
                self.events.remove((who, ev, payload))
                return payload
        while time.monotonic() < deadline:
            try:
                who, ev, payload = self.out.get(timeout=0.5)
            except queue.Empty:
                continue
            if ev == "crash":
                raise AssertionError(f"{who} crashed:\n{payload}")
            if (who, ev) == (member_id, event):
                return payload
            self.events.append((who, ev, payload))
        raise AssertionError(f"{member_id} never reported {event!r}; events so far: {self.events}")

    def wait_any(self, member_id: str, events: tuple[str, ...]) -> tuple[str, object]:
        deadline = time.monotonic() + SPAWN_S
        while time.monotonic() < deadline:
            for who, ev, payload in self.events:
                if who == member_id and ev in events:
                    self.events.remove((who, ev, payload))
                    return ev, payload
            try:
                self.events.append(self.out.get(timeout=0.5))
            except queue.Empty:
                continue
            if self.events[-1][1] == "crash":
                raise AssertionError(f"{self.events[-1][0]} crashed:\n{self.events[-1][2]}")
        raise AssertionError(f"{member_id} never reported any of {events}; events so far: {self.events}")

    def close(self) -> None:
        for p in self.procs.values():
            stop_process(p)
        self.out.close()


@pytest.fixture
def members():
    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the run with tracebacks
    m = Members()
    try:
        yield m
    finally:
        m.close()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def test_versions_round_trip_every_dtype_to_two_receivers(members):
    buckets = layout_from_wire(layout_wire())
    assert {b.dtype for b in buckets} == {"float32", "bfloat16", "float16", "int64", "float64", "uint8", "int32"}
    assert any(len(b.entries) > 1 for b in buckets) and any(b.nbytes > BUCKET_BYTES for b in buckets)
    sender = Sender(buckets, HOST, free_port(), timeout_s=PUSH_TIMEOUT_S, slice_s=0.1, chunk_bytes=CHUNK_BYTES)
    assert len(sender.chunks) > 2
    for mid in ("gen0", "gen1"):
        members.start(sender.port, mid, ["join", "recv", "recv"])
    sender.form(["gen0", "gen1"], timeout_s=SPAWN_S)
    assert sender.members == ["gen0", "gen1"] and sender.epoch == 0
    for mid in ("gen0", "gen1"):
        assert members.wait_for(mid, "joined") == 0
    for version in (1, 2):
        params = make_params(version)
        metrics = sender.push(params, version)
        assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in params.values())
        assert metrics["sync/members"] == 2 and metrics["sync/push_s"] < PUSH_TIMEOUT_S
        for mid in ("gen0", "gen1"):
            got_version, epoch, got, rx_metrics = members.wait_for(mid, "received")
            assert (got_version, epoch) == (version, 0)
            assert got == digest(params), f"{mid} got different bytes for version {version}"
            assert rx_metrics["sync/pause_s"] >= rx_metrics["sync/transfer_s"] >= 0
        live = sender.wait_live(SPAWN_S)  # both applied it (they reported "received" after apply)
        assert set(live) == {"gen0", "gen1"} and all(isinstance(t, float) for t in live.values()), live
    assert sender.version == 2
    for mid in ("gen0", "gen1"):
        members.wait_for(mid, "done")


@pytest.mark.isolated  # kills and hangs receivers: every process it starts is its own, none is shared
def test_dead_and_hung_receivers_are_named_then_group_rebuilt_and_late_joiner_served(members):
    sender = Sender(layout_from_wire(layout_wire()), HOST, free_port(), timeout_s=PUSH_TIMEOUT_S, slice_s=0.1,
                    chunk_bytes=CHUNK_BYTES)
    members.start(sender.port, "gen0", ["join", "recv", "recv_any", "recv", "recv_any", "recv"])
    members.start(sender.port, "gen1", ["join", "recv", "die_mid_push"])
    members.start(sender.port, "gen2", ["join", "recv", "recv_any", "recv", "hang_mid_push"])
    sender.form(["gen0", "gen1", "gen2"], timeout_s=SPAWN_S)
    sender.push(make_params(1), 1)
    for mid in ("gen0", "gen1", "gen2"):
        assert members.wait_for(mid, "received")[0] == 1

    # v2: gen1 dies after its first chunk. The push fails within the timeout, naming gen1 alone.
    t0 = time.monotonic()
    with pytest.raises(PushError) as info:
        sender.push(make_params(2), 2)
    elapsed = time.monotonic() - t0
    members.wait_for("gen1", "die_mid_push")
    assert elapsed < PUSH_TIMEOUT_S + 2.0, f"failure took {elapsed:.1f}s to surface"
    err = info.value
    assert err.failed_members == ["gen1"], str(err)
    assert "gen1" in str(err) and "version 2" in str(err)
    members.procs["gen1"].join(timeout=10)
    assert members.procs["gen1"].exitcode == 3

    # the survivors either loaded v2 before the abort or gave up on it: "aborted", not to blame
    for mid in ("gen0", "gen2"):
        event, payload = members.wait_any(mid, ("received", "recv_failed"))
        assert event == "received" or "aborted" in payload, payload
        assert mid in err.aborted or event == "received"

    # the group is rebuilt without gen1 and the same version goes out again
    sender.drop(err.failed_members)
    metrics = sender.push(make_params(2), 2)
    assert sender.members == ["gen0", "gen2"] and metrics["sync/epoch"] == 1 and metrics["sync/rebuild_s"] > 0
    for mid in ("gen0", "gen2"):
        version, epoch, got, _ = members.wait_for(mid, "received")
        assert (version, epoch, got) == (2, 1, digest(make_params(2)))

    # v3: gen2 hangs mid-push (alive, silent). Named as missing; gen0 is not blamed.
    t0 = time.monotonic()
    with pytest.raises(PushError) as info:
        sender.push(make_params(3), 3)
    assert time.monotonic() - t0 < PUSH_TIMEOUT_S + 2.0
    assert info.value.missing == ["gen2"] and info.value.failed_members == ["gen2"], str(info.value)
    members.wait_for("gen2", "hang_mid_push")
    members.procs["gen2"].kill()  # stopped (SIGSTOP): only SIGKILL ends it
    members.wait_any("gen0", ("received", "recv_failed"))
    sender.drop(["gen2"])

    # a restarted gen1 (same id, new process) asks to join; the next push admits it and it gets that
    # version before doing anything else
    members.start(sender.port, "gen1", ["recv"])
    deadline = time.monotonic() + SPAWN_S
    while not poll_joiners(sender):
        assert time.monotonic() < deadline, "the restarted gen1 never asked to join"
        time.sleep(0.05)
    metrics = sender.push(make_params(4), 4)
    assert sender.members == ["gen0", "gen1"] and metrics["sync/members"] == 2
    for mid in ("gen0", "gen1"):
        version, epoch, got, _ = members.wait_for(mid, "received")
        assert (version, epoch, got) == (4, 2, digest(make_params(4)))
        members.wait_for(mid, "done")
    members.procs["gen2"].terminate()
