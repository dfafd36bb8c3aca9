"""The batched frame protocol: puts with group frames, gets answered with the stored bytes as frames."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest
import zmq

from async_rlhf.buffer.client import BufferClient, BufferRequestError, encode_group
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import make_group
from async_rlhf.wire import encode


@pytest.fixture
def svc():
    service = BufferService(BufferLogic(MemoryStore(), groups_per_version=100, max_staleness=0, capacity=6)).start()
    try:
        yield service
    finally:
        service.stop()


def test_large_groups_travel_unchanged_in_both_directions(svc: BufferService):
    c = BufferClient(svc.address, timeout_s=5.0)
    try:
        big = make_group("big", payload_bytes=300_000)  # above the zero-copy size: kept as a view of the frame
        small = make_group("small", payload_bytes=500)
        sent = {g.group_id: encode_group(g) for g in (big, small)}
        assert c.put_many([big, small]) == [True, True]
        ids, parts = c.get_encoded(5, 0, wait_s=1.0, at_least=1)
        assert ids == ["big", "small"]
        assert [bytes(p) for p in parts] == [sent["big"], sent["small"]]  # the very bytes the producer sent
        assert c.ack(ids) == 2
        assert c.put(big) is False  # trained: a duplicate
    finally:
        c.close()


def test_pipelined_puts_answer_in_order_and_report_full(svc: BufferService):
    c = BufferClient(svc.address, timeout_s=5.0)
    try:
        batches = [[encode_group(make_group(f"g{b}-{i}")) for i in range(2)] for b in range(4)]
        results = list(c.put_pipelined(iter(batches), window=3))
        assert [sent for sent, _ in results] == batches
        assert [st for _, st in results] == [["ok", "ok"]] * 3 + [["full", "full"]]  # capacity 6
        assert c.stats()["buffer/put_full"] == 2
    finally:
        c.close()


def test_get_at_least_answers_with_what_is_held(svc: BufferService):
    c = BufferClient(svc.address, timeout_s=5.0)
    try:
        c.put_many([make_group("a"), make_group("b")])
        assert c.get_encoded(10, 0, wait_s=0.05)[0] == []  # a learner's exact share: not yet
        assert c.get_encoded(10, 0, wait_s=0.05, at_least=2)[0] == ["a", "b"]
        back = c.get(1, 0, wait_s=0.05)
        assert back == []
    finally:
        c.close()


def test_small_groups_travel_packed_and_unchanged(svc: BufferService):
    """A batch of small groups is one frame each way; the learner gets the very bytes the producer sent."""
    c = BufferClient(svc.address, timeout_s=5.0)
    wire: list[tuple[str, bool, int]] = []  # (kind, packed, frames after the header) of each request and reply
    send, wait = c.send_request, c.wait_reply

    def send_spy(kind, timeout_s=None, parts=None, **fields):
        wire.append((kind, "sizes" in fields, len(parts or [])))
        return send(kind, timeout_s, parts, **fields)

    def wait_spy(kind, req_id, timeout_s=None):
        reply = wait(kind, req_id, timeout_s)
        wire.append((f"{kind} reply", "sizes" in reply, len(reply["parts"])))
        return reply

    c.send_request, c.wait_reply = send_spy, wait_spy
    try:
        groups = [make_group(f"s{i}", payload_bytes=100 * (i + 1)) for i in range(4)]
        sent = [encode_group(g) for g in groups]
        assert c.put_encoded(sent + sent[:1]) == [True] * 4 + [False]  # de-duplicated inside one packed put
        assert wire[0] == ("put", True, 1), wire
        assert svc.logic.counters["duplicates"] == 1
        # each stored group owns its bytes: one held for long must not pin the frame of its whole batch
        assert all(type(svc.logic.store.get_held(f"s{i}").data) is bytes for i in range(4))
        ids, parts = c.get_encoded(4, 0, wait_s=1.0)
        assert wire[-1] == ("get reply", True, 1), wire
        assert ids == ["s0", "s1", "s2", "s3"]
        assert [bytes(p) for p in parts] == sent
        assert c.ack(ids) == 4
    finally:
        c.close()


def _good() -> bytes:
    return encode_group(make_group("ok", payload_bytes=100))


@pytest.mark.parametrize("sizes,body", [
    ([10], None),                      # sizes do not add up to the frame
    ([0, 0], b""),                     # empty groups
    ([], b""),                         # no groups
    ("12", None),                      # not a list
    ([1.5], None),                     # not integers
    ([-5, 10], None),                  # a negative size
])
def test_bad_packed_sizes_are_refused_and_nothing_is_stored(svc: BufferService, sizes, body):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.address)
    try:
        frame = _good() + _good() if body is None else body
        sock.send_multipart([encode("put", req_id=1, parts=1, sizes=sizes), frame])
        assert sock.poll(5000)
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        assert reply["kind"] == "error" and reply["reason"] == "malformed"
        assert svc.logic.counters["put"] == 0 and svc.logic.rejects["malformed"] == 1
    finally:
        sock.close(0)


def test_a_malformed_group_in_a_packed_put_refuses_the_whole_put(svc: BufferService):
    c = BufferClient(svc.address, timeout_s=5.0)
    try:
        bad = msgpack.packb({"group_id": "bad"})
        with pytest.raises(BufferRequestError, match="malformed"):
            c.put_encoded([_good(), bad])
        assert svc.logic.counters["put"] == 0 and svc.logic.rejects["malformed"] == 1
        assert svc.logic.store.state("ok") is None
    finally:
        c.close()


@pytest.mark.parametrize("header,parts,reason", [
    ({"kind": "put", "parts": 2}, [b"x"], "malformed"),                   # count does not match
    ({"kind": "admit", "want": 1}, [b"x"], "malformed"),                  # frames after a non-put
    ({"kind": "put", "parts": 1}, [b"\xc1"], "malformed"),                # a group frame that is not msgpack
    ({"kind": "put", "parts": 1}, [msgpack.packb({"group_id": "x"})], "malformed"),  # not a valid group
])
def test_bad_group_frames_are_refused_and_nothing_is_stored(svc: BufferService, header, parts, reason):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.address)
    try:
        fields = {k: v for k, v in header.items() if k != "kind"}
        sock.send_multipart([encode(header["kind"], req_id=1, **fields), *parts])
        assert sock.poll(5000)
        reply = msgpack.unpackb(sock.recv_multipart()[0])
        assert reply["kind"] == "error" and reply["reason"] == reason
        assert svc.logic.counters["put"] == 0 and svc.logic.rejects[reason] == 1
    finally:
        sock.close(0)


def test_encode_group_does_not_alias_the_arrays():
    g = make_group("g", payload_bytes=1200)
    data = encode_group(g)
    g.samples[0].completion_ids[:] = 0  # a later change of the arrays does not reach encoded bytes
    w = msgpack.unpackb(data)
    assert np.frombuffer(w["samples"][0]["completion_ids"]["data"], np.int32)[1] == 1


def _mutations(rng: random.Random, wire: dict) -> dict:
    """One random corruption of a valid wire group (a copy)."""
    w = msgpack.unpackb(msgpack.packb(wire))
    sample = rng.choice(w["samples"])
    target = rng.choice(["group", "sample", "array"])
    if target == "group":
        key = rng.choice(["group_id", "samples", "prompt_ids", "generator", "meta", "t_start"])
        w[key] = rng.choice([None, "", 3, -1.5, [], {}, b"x", [1, 2], float("nan")])
    elif target == "sample":
        key = rng.choice(["completion_ids", "logprobs", "versions", "reward", "loss_mask", "token_rewards"])
        sample[key] = rng.choice([None, 1, "x", {}, [], b"\x00"]) if rng.random() < 0.5 else sample.get(
            "versions" if key != "versions" else "logprobs")
    else:
        arr = sample[rng.choice(["completion_ids", "logprobs", "versions"])]
        key = rng.choice(["dtype", "shape", "data"])
        arr[key] = {"dtype": rng.choice(["int8", "object", "float64", "bool", 5]),
                    "shape": rng.choice([[], [0], [-1], [2, 2], [10**6], ["3"]]),
                    "data": rng.choice([b"", b"\x00" * 5, "text", 7])}[key]
    return w


def test_envelope_never_accepts_what_the_learner_would_refuse():
    from async_rlhf.buffer.envelope import inspect_group
    from async_rlhf.types import Group
    from async_rlhf.wire import WireError

    rng = random.Random(0)
    wire = make_group("g", payload_bytes=120, samples=2).to_wire()
    accepted = refused = 0
    for _ in range(3000):
        w = _mutations(rng, wire)
        try:
            inspect_group(w)
        except WireError:
            refused += 1
            continue
        accepted += 1
        Group.from_wire(w)  # raises (and fails the test) if the envelope let a bad group through
    assert refused > 1000 and accepted > 50


@pytest.mark.parametrize("dtype", [[1], {"a": 1}])
@pytest.mark.parametrize("where", ["prompt_ids", "completion_ids", "versions"])
def test_an_unhashable_dtype_is_malformed_not_a_type_error(where, dtype):
    """A list or map where a dtype name belongs is a malformed group (WireError), never a TypeError."""
    from async_rlhf.buffer.envelope import inspect_group
    from async_rlhf.wire import WireError

    w = make_group("g", payload_bytes=120, samples=2).to_wire()
    (w if where == "prompt_ids" else w["samples"][1])[where]["dtype"] = dtype
    with pytest.raises(WireError, match="bad array header"):
        inspect_group(w)


def test_get_can_carry_the_previous_batch_ack(svc: BufferService):
    c = BufferClient(svc.address, timeout_s=5.0)
    try:
        c.put_many([make_group("a"), make_group("b"), make_group("c")])
        first, _ = c.get_encoded(2, 0, wait_s=0.5)
        second, _ = c.get_encoded(2, 0, wait_s=0.05, at_least=1, ack=first)
        assert (first, second) == (["a", "b"], ["c"])
        s = c.stats(ledger=True)
        assert s["ledger"]["trained"] == ["a", "b"] and s["ledger"]["delivered"] == ["c"]
    finally:
        c.close()
