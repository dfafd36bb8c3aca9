"""Fuzz the buffer port for a bounded time while a good client checks every answer it gets."""

import random
import threading
import time

import msgpack
import zmq

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import make_group
from async_rlhf.wire import SCHEMA_VERSION, encode

MAX_BYTES = 256 << 10
FUZZ_S = 3.0


def garbage(rng: random.Random) -> bytes:
    """One hostile frame: random bytes, truncated msgpack, wrong schema, unknown kind, bad fields, huge."""
    good = [encode("admit", req_id=1, want=3), encode("put", req_id=2, group=make_group("fz").to_wire()),
            encode("get", req_id=3, n=2, version=0, wait_s=0.01), encode("ack", req_id=4, group_ids=["x"])]
    choice = rng.randrange(8)
    if choice == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
    if choice == 1:
        frame = rng.choice(good)
        return frame[: rng.randrange(0, len(frame))]
    if choice == 2:
        return msgpack.packb({"schema": rng.choice([0, 2, 99, -1, "1", None]), "kind": "admit", "want": 1})
    if choice == 3:
        return msgpack.packb({"schema": SCHEMA_VERSION, "kind": rng.choice(["explode", "", "reply", "error", 7])})
    if choice == 4:  # right envelope, wrong fields
        kind = rng.choice(["admit", "put", "get", "ack", "release", "set_version"])
        field = rng.choice(["want", "group", "n", "version", "group_ids", "wait_s", "consumer"])
        value = rng.choice([None, -1, 2**64 - 1, "x" * 50, [1, 2], {"a": b"b"}, float("nan"), b"\x00" * 10])
        return msgpack.packb({"schema": SCHEMA_VERSION, "kind": kind, "req_id": 5, field: value})
    if choice == 5:  # a put whose group is subtly broken
        g = make_group("bad").to_wire()
        g["samples"][0]["versions"]["shape"] = [rng.randrange(0, 10**6)]
        return encode("put", req_id=6, group=g)
    if choice == 6:  # just over the service's limit (decoded and refused as oversized)
        return encode("put", req_id=7, blob=b"z" * (MAX_BYTES + 100))
    return b"\x00" * rng.choice([2 * MAX_BYTES, 4 << 20])  # huge: ZeroMQ cuts the connection at MAXMSGSIZE


def attacker(address: str, stop: threading.Event, seed: int, sent: list[int]) -> None:
    rng = random.Random(seed)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100)
    sock.connect(address)
    n = 0
    try:
        while not stop.is_set():
            frames = [garbage(rng)] if rng.random() < 0.9 else [garbage(rng), garbage(rng)]
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                time.sleep(0.001)
            while sock.poll(0):
                sock.recv_multipart()  # drain replies, ignored
            if n % 50 == 0:  # a huge frame gets this connection dropped: start a fresh one now and then
                sock.close(0)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
    finally:
        sock.close(0)
        sent.append(n)


def test_fuzz_while_a_good_client_is_served():
    logic = BufferLogic(MemoryStore(), groups_per_version=10**6, max_staleness=0)
    svc = BufferService(logic, max_message_bytes=MAX_BYTES).start()
    stop, sent = threading.Event(), []
    threads = [threading.Thread(target=attacker, args=(svc.address, stop, seed, sent)) for seed in range(2)]
    good = BufferClient(svc.address, timeout_s=2.0, max_message_bytes=MAX_BYTES)
    latencies, rounds = [], 0
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + FUZZ_S
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            gid = f"good-{rounds}"
            assert good.admit(1)[0] == 1
            assert good.put(make_group(gid, payload_bytes=4096)) is True
            got = good.get(1, version=0, wait_s=1.0)
            assert [g.group_id for g in got] == [gid]
            assert len(got[0].samples[0].completion_ids) == 4096 // 12
            assert good.ack([gid]) == 1
            latencies.append(time.monotonic() - t0)
            rounds += 1
        stop.set()
        for t in threads:
            t.join(timeout=10)
        stats = good.stats(ledger=True)
    finally:
        stop.set()
        good.close()
        svc.stop()
    assert rounds >= 20, f"only {rounds} good rounds in {FUZZ_S} s"
    assert max(latencies) < 1.0
    assert sum(sent) > 200
    assert stats["ledger"]["trained"] == sorted(f"good-{i}" for i in range(rounds))  # fuzz puts never landed
    assert stats["ledger"]["held"] == [] and stats["ledger"]["delivered"] == []
    for reason in ("malformed", "schema", "unknown_kind", "oversized"):
        assert stats.get(f"buffer/reject_{reason}", 0) > 0, reason
    assert stats.get("buffer/reject_internal", 0) == 0
