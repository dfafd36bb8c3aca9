"""The real ZeroMQ buffer service on loopback, with BufferClient and raw DEALER sockets."""

import random
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from async_rlhf.buffer.client import BufferClient, BufferRequestError, BufferUnavailable
from async_rlhf.buffer.service import BufferLogic, BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.endpoints import free_port
from async_rlhf.types import Group, Sample
from async_rlhf.wire import SCHEMA_VERSION, decode, encode

MAX_BYTES = 16 << 10


def make_group(gid: str, version: int = 0, n: int = 2) -> Group:
    samples = [Sample(np.array([7, 8, 9], np.int32) + i, np.array([-0.1, -0.2, -0.3], np.float32),
                      np.full(3, version, np.int32), float(i)) for i in range(n)]
    return Group(gid, np.array([1, 2], np.int32), samples, generator=1, meta={"answer": 17})


@pytest.fixture
def service():
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=1)
    svc = BufferService(logic, host="127.0.0.1", port=0, max_message_bytes=MAX_BYTES).start()
    clients: list[BufferClient] = []

    def client(timeout_s: float = 5.0) -> BufferClient:
        c = BufferClient(svc.address, timeout_s=timeout_s)
        clients.append(c)
        return c

    svc.client = client
    try:
        yield svc
    finally:
        for c in clients:
            c.close()
        svc.stop()
        assert not svc._thread.is_alive()


@pytest.fixture
def raw(service):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(service.address)
    try:
        yield sock
    finally:
        sock.close(0)


def recv_reply(sock, timeout_s: float = 3.0) -> dict:
    assert sock.poll(int(timeout_s * 1000)), "the service did not answer"
    return decode(sock.recv(), 1 << 24)


def test_round_trip(service):
    c = service.client()
    assert c.admit(10) == (8, 0)  # (max_staleness 1 + 0 + 1) * 4
    assert c.put(make_group("g0")) is True
    assert c.put(make_group("g1")) is True
    assert c.put(make_group("g1")) is False  # duplicate
    c.release(3)
    got = c.get(2, version=0, wait_s=0.5)
    assert [g.group_id for g in got] == ["g0", "g1"]
    np.testing.assert_array_equal(got[1].samples[1].completion_ids, [8, 9, 10])
    np.testing.assert_allclose(got[0].samples[0].logprobs, [-0.1, -0.2, -0.3])
    assert got[0].meta == {"answer": 17}
    assert got[0].generator == 1
    assert c.ack(["g0", "g1", "g1"]) == 2
    c.set_version(1)
    s = c.stats(ledger=True)
    assert s["buffer/version"] == 1
    assert s["buffer/put"] == 2
    assert s["buffer/duplicates"] == 1
    assert s["buffer/duplicate_ack"] == 1
    assert s["buffer/trained"] == 2
    assert s["buffer/admitted"] == 8
    assert s["buffer/running"] == 8 - 2 - 3
    assert s["buffer/depth"] == 0
    assert s["ledger"] == {"held": [], "awaiting_reward": [], "delivered": [], "trained": ["g0", "g1"], "dropped": {}}
    assert "kind" not in s and "req_id" not in s


def test_refused_requests_raise_request_error(service):
    c = service.client()
    c.set_version(2)
    with pytest.raises(BufferRequestError, match="backwards"):
        c.set_version(1)
    with pytest.raises(BufferRequestError):
        c.request("admit")  # no "want"
    # the client is still usable afterwards
    assert c.admit(1) == (1, 2)
    assert c.stats()["buffer/reject_malformed"] == 2


def test_long_poll_get_waits_for_another_client(service):
    learner, generator = service.client(), service.client()
    generator.put(make_group("early"))

    def produce():
        time.sleep(0.4)
        generator.put(make_group("late1"))
        generator.put(make_group("late2"))

    t = threading.Thread(target=produce)
    t0 = time.monotonic()
    t.start()
    try:
        got = learner.get(3, version=0, wait_s=5.0)
    finally:
        t.join(timeout=5)
    elapsed = time.monotonic() - t0
    assert [g.group_id for g in got] == ["early", "late1", "late2"]
    assert 0.3 < elapsed < 4.0


def test_long_poll_get_times_out_with_nothing(service):
    c = service.client()
    c.put(make_group("only"))
    t0 = time.monotonic()
    assert c.get(2, version=0, wait_s=0.4) == []
    elapsed = time.monotonic() - t0
    assert 0.35 < elapsed < 3.0
    # the held group was not taken by the timed-out get
    assert c.stats()["buffer/depth"] == 1


def test_get_drops_stale_groups(service):
    c = service.client()
    c.put(make_group("v0", version=0))
    c.put(make_group("v2", version=2))
    c.set_version(2)
    got = c.get(1, version=2, wait_s=0.2)
    assert [g.group_id for g in got] == ["v2"]
    s = c.stats(ledger=True)
    assert s["buffer/dropped_stale"] == 1
    assert s["ledger"]["dropped"] == {"v0": "stale"}


def _garbage_cases():
    rng = random.Random(1234)
    random_bytes = bytes([0xC1]) + bytes(rng.randrange(256) for _ in range(200))  # 0xc1 is never valid
    truncated = encode("admit", req_id=5, want=3)[:-3]
    return [
        ("random_bytes", [random_bytes], "malformed"),
        ("empty_frame", [b""], "malformed"),
        ("truncated", [truncated], "malformed"),
        ("multi_frame", [encode("admit", req_id=1, want=1), encode("stats", req_id=2)], "malformed"),
        ("top_level_list", [msgpack.packb([SCHEMA_VERSION, "admit"])], "malformed"),
        ("wrong_schema", [msgpack.packb({"schema": 99, "kind": "admit", "want": 1})], "schema"),
        ("no_schema", [msgpack.packb({"kind": "stats"})], "schema"),
        ("unknown_kind", [msgpack.packb({"schema": SCHEMA_VERSION, "kind": "explode"})], "unknown_kind"),
        ("reply_kind_as_request", [encode("reply", req_id=3)], "unknown_kind"),
        ("missing_field", [encode("admit", req_id=4)], "malformed"),
        ("bad_field_type", [encode("release", req_id=4, n="many")], "malformed"),
        ("get_missing_version", [encode("get", req_id=4, n=1, wait_s=0)], "malformed"),
        ("put_without_group", [encode("put", req_id=4)], "malformed"),
        ("put_bad_group", [encode("put", req_id=4, group={"group_id": "x", "samples": [{}]})], "malformed"),
        ("oversized", [encode("put", req_id=4, blob=b"z" * (MAX_BYTES + 1000))], "oversized"),
    ]


@pytest.mark.parametrize("name,frames,reason", _garbage_cases(), ids=[c[0] for c in _garbage_cases()])
def test_service_survives_garbage(service, raw, name, frames, reason):
    raw.send_multipart(frames)
    reply = recv_reply(raw)
    assert reply["kind"] == "error"
    assert reply["reason"] == reason
    assert reply["detail"]
    good = service.client()
    stats = good.stats()
    assert stats[f"buffer/reject_{reason}"] == 1
    assert sum(v for k, v in stats.items() if k.startswith("buffer/reject_")) == 1
    # the service still works, for the good client and for the raw socket
    assert good.put(make_group("after")) is True
    assert [g.group_id for g in good.get(1, version=0, wait_s=0.5)] == ["after"]
    raw.send(encode("admit", req_id=77, want=2))
    ok = recv_reply(raw)
    assert ok["kind"] == "reply" and ok["req_id"] == 77 and ok["granted"] == 2


def test_service_survives_a_burst_of_garbage(service, raw):
    rng = random.Random(7)
    for _ in range(50):
        raw.send(bytes([0xC1]) + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
    replies = [recv_reply(raw) for _ in range(50)]
    assert all(r["kind"] == "error" and r["reason"] == "malformed" for r in replies)
    c = service.client()
    assert c.stats()["buffer/reject_malformed"] == 50
    assert c.admit(1) == (1, 0)


def test_get_with_nan_wait_is_still_answered(service, raw):
    # every wait is meant to be bounded: a NaN wait_s must not park the request forever
    raw.send(encode("get", req_id=9, n=1, version=0, wait_s=float("nan")))
    reply = recv_reply(raw, timeout_s=2.0)
    assert reply["req_id"] == 9


def test_client_raises_unavailable_when_nothing_listens():
    port = free_port()
    c = BufferClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    try:
        t0 = time.monotonic()
        with pytest.raises(BufferUnavailable, match=str(port)):
            c.admit(1)
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(BufferUnavailable):
            c.get(1, version=0, wait_s=0.2)
        assert time.monotonic() - t0 < 2.5
    finally:
        c.close()


def test_service_refuses_a_public_bind():
    logic = BufferLogic(MemoryStore(), groups_per_version=1, max_staleness=0)
    with pytest.raises(ValueError, match="127.0.0.1"):
        BufferService(logic, host="0.0.0.0")
