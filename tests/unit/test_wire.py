"""The wire codec: round trips, array packing and every rejection reason; Group/Sample wire form."""

import msgpack
import numpy as np
import pytest

from async_rlhf.types import Group, Sample
from async_rlhf.wire import (
    ALLOWED_DTYPES,
    KINDS,
    SCHEMA_VERSION,
    WireError,
    decode,
    encode,
    pack_array,
    unpack_array,
)

MAX = 1 << 20


def _raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_encode_decode_round_trip_every_kind(kind):
    fields = {"req_id": 7, "n": 3, "name": "g-1", "values": [1, 2.5, "x"], "nested": {"a": b"\x00\x01"}}
    msg = decode(encode(kind, **fields), MAX)
    assert msg == {"schema": SCHEMA_VERSION, "kind": kind, **fields}


def test_encode_refuses_unknown_kind():
    with pytest.raises(WireError) as info:
        encode("launch_missiles", req_id=1)
    assert info.value.reason == "unknown_kind"


def _sample_array(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dtype == "uint8":
        return (np.arange(n) * 37 % 256).astype(np.uint8).reshape(shape)
    return (np.arange(n) * 1.5 - 4).astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", [(5,), (2, 3), (2, 1, 4), (0,), (0, 3)])
def test_array_round_trip_each_dtype(dtype, shape):
    arr = _sample_array(dtype, shape)
    packed = pack_array(arr)
    assert packed["dtype"] == dtype
    assert packed["shape"] == list(shape)
    # through the full codec, so the bytes survive msgpack too
    out = unpack_array(decode(encode("reply", arr=packed), MAX)["arr"])
    assert out.dtype == np.dtype(dtype)
    assert out.shape == shape
    np.testing.assert_array_equal(out, arr)
    assert out.flags.writeable  # a copy, not a read-only view of the frame


def test_non_contiguous_array_round_trip():
    arr = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    out = unpack_array(pack_array(arr))
    assert out.shape == (4, 3)
    np.testing.assert_array_equal(out, arr)


def test_zero_dim_array_keeps_its_shape():
    arr = np.array(3.25, dtype=np.float32)
    out = unpack_array(pack_array(arr))
    assert out.shape == ()
    assert float(out) == 3.25


def test_decode_rejects_garbage_bytes():
    with pytest.raises(WireError) as info:
        decode(b"\xc1\xff\x00garbage\x93", MAX)
    assert info.value.reason == "malformed"


def test_decode_rejects_truncated_frame():
    frame = encode("admit", req_id=1, want=4)
    with pytest.raises(WireError) as info:
        decode(frame[:-2], MAX)
    assert info.value.reason == "malformed"


def test_decode_rejects_list_at_top_level():
    with pytest.raises(WireError) as info:
        decode(_raw([SCHEMA_VERSION, "admit"]), MAX)
    assert info.value.reason == "malformed"


@pytest.mark.parametrize("schema", [SCHEMA_VERSION + 1, 0, "1", None])
def test_decode_rejects_wrong_schema(schema):
    with pytest.raises(WireError) as info:
        decode(_raw({"schema": schema, "kind": "admit", "want": 1}), MAX)
    assert info.value.reason == "schema"


def test_decode_rejects_missing_schema():
    with pytest.raises(WireError) as info:
        decode(_raw({"kind": "admit", "want": 1}), MAX)
    assert info.value.reason == "schema"


@pytest.mark.parametrize("kind", ["launch", "", None, 3])
def test_decode_rejects_unknown_kind(kind):
    with pytest.raises(WireError) as info:
        decode(_raw({"schema": SCHEMA_VERSION, "kind": kind}), MAX)
    assert info.value.reason == "unknown_kind"


def test_decode_rejects_oversized_frame():
    frame = encode("put", req_id=1, blob=b"x" * 1000)
    assert decode(frame, len(frame))["blob"] == b"x" * 1000  # exactly at the limit is fine
    with pytest.raises(WireError) as info:
        decode(frame, len(frame) - 1)
    assert info.value.reason == "oversized"


def test_unpack_array_rejects_wrong_byte_count():
    good = pack_array(np.arange(6, dtype=np.int32).reshape(2, 3))
    for data in (good["data"][:-1], good["data"] + b"\x00\x00\x00\x00", b""):
        with pytest.raises(WireError) as info:
            unpack_array({**good, "data": data})
        assert info.value.reason == "malformed"
    # the bytes of 6 int32 do not make 6 int64
    with pytest.raises(WireError):
        unpack_array({**good, "dtype": "int64"})
    # nor a shape of 7
    with pytest.raises(WireError):
        unpack_array({**good, "shape": [7]})


@pytest.mark.parametrize("dtype", ["object", "complex64", "float128", "<i4", "str"])
def test_unpack_array_rejects_disallowed_dtype(dtype):
    with pytest.raises(WireError) as info:
        unpack_array({"dtype": dtype, "shape": [1], "data": b"\x00" * 16})
    assert info.value.reason == "malformed"


def test_pack_array_rejects_disallowed_dtype():
    with pytest.raises(WireError) as info:
        pack_array(np.zeros(2, dtype=np.complex64))
    assert info.value.reason == "malformed"


@pytest.mark.parametrize("obj", [
    None,
    [1, 2],
    {"dtype": "int32", "shape": [1]},
    {"dtype": "int32", "shape": [1], "data": b"\x00" * 4, "extra": 1},
    {"dtype": "int32", "shape": 1, "data": b"\x00" * 4},
    {"dtype": "int32", "shape": [-1], "data": b"\x00" * 4},
    {"dtype": "int32", "shape": [1.0], "data": b"\x00" * 4},
    {"dtype": "int32", "shape": [1], "data": "\x00" * 4},
])
def test_unpack_array_rejects_bad_headers(obj):
    with pytest.raises(WireError) as info:
        unpack_array(obj)
    assert info.value.reason == "malformed"


# -- Sample / Group ------------------------------------------------------------------------------
def _sample(tokens, versions, reward=1.0, finish="stop") -> Sample:
    tokens = np.asarray(tokens, np.int32)
    return Sample(tokens, -0.25 * np.arange(1, len(tokens) + 1, dtype=np.float32),
                  np.asarray(versions, np.int32), reward, finish)


def _group() -> Group:
    return Group(
        group_id="gen0-17",
        prompt_ids=np.array([5, 6, 7, 8], np.int32),
        # sample 1 spans an update: tokens from version 3, then from version 4
        samples=[_sample([10, 11, 12], [4, 4, 4], 1.0), _sample([20, 21, 22, 23], [3, 3, 4, 4], 0.0, "length")],
        generator=2,
        meta={"problem": "12+30", "answer": 42},
        t_start=100.5,
        t_end=101.75,
    )


def test_sample_round_trip():
    s = _sample([1, 2, 3], [0, 1, 1], reward=0.5, finish="length")
    back = Sample.from_wire(decode(encode("reply", s=s.to_wire()), MAX)["s"])
    np.testing.assert_array_equal(back.completion_ids, [1, 2, 3])
    np.testing.assert_array_equal(back.logprobs, np.array([-0.25, -0.5, -0.75], np.float32))
    np.testing.assert_array_equal(back.versions, [0, 1, 1])
    assert back.completion_ids.dtype == np.int32 and back.logprobs.dtype == np.float32
    assert back.versions.dtype == np.int32
    assert back.reward == 0.5 and back.finish_reason == "length"


def test_group_round_trip_and_min_version_spanning_an_update():
    g = _group()
    assert g.min_version == 3
    assert g.num_tokens == 7
    back = Group.from_wire(decode(encode("put", group=g.to_wire()), MAX)["group"])
    assert back.group_id == "gen0-17"
    np.testing.assert_array_equal(back.prompt_ids, [5, 6, 7, 8])
    assert back.generator == 2
    assert back.meta == {"problem": "12+30", "answer": 42}
    assert (back.t_start, back.t_end) == (100.5, 101.75)
    assert len(back.samples) == 2
    for got, want in zip(back.samples, g.samples):
        np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
        np.testing.assert_array_equal(got.logprobs, want.logprobs)
        np.testing.assert_array_equal(got.versions, want.versions)
        assert got.reward == want.reward and got.finish_reason == want.finish_reason
    assert back.min_version == 3
    assert back.num_tokens == 7


def test_group_min_version_without_tokens_falls_back_to_start_version():
    g = Group("g", np.array([1], np.int32), [_sample([], [])], meta={"start_version": 6})
    assert g.min_version == 6
    assert Group.from_wire(g.to_wire()).min_version == 6


@pytest.mark.parametrize("field,value", [
    ("logprobs", np.zeros(2, np.float32)),
    ("versions", np.zeros(4, np.int32)),
    ("completion_ids", np.zeros((3, 1), np.int32)),
])
def test_sample_with_mismatched_lengths_is_malformed(field, value):
    wire = _sample([1, 2, 3], [0, 0, 0]).to_wire()
    wire[field] = pack_array(value)
    with pytest.raises(WireError) as info:
        Sample.from_wire(wire)
    assert info.value.reason == "malformed"
    gw = _group().to_wire()
    gw["samples"][1] = wire
    with pytest.raises(WireError) as info:
        Group.from_wire(gw)
    assert info.value.reason == "malformed"


@pytest.mark.parametrize("field,header", [
    # [3, 2] has len 3 like completion_ids [3], but it is not one value per token
    ("logprobs", {"dtype": "float32", "shape": [3, 2], "data": b"\x00" * 24}),
    ("versions", {"dtype": "int32", "shape": [3, 1], "data": b"\x00" * 12}),
])
def test_sample_with_multi_dimensional_per_token_arrays_is_malformed(field, header):
    wire = _sample([1, 2, 3], [0, 0, 0]).to_wire()
    wire[field] = header
    with pytest.raises(WireError) as info:
        Sample.from_wire(wire)
    assert info.value.reason == "malformed"


def test_sample_with_scalar_arrays_is_malformed():
    # shape [] is a valid array header (one element); a sample needs 1-D arrays
    wire = {
        "completion_ids": {"dtype": "int32", "shape": [], "data": b"\x05\x00\x00\x00"},
        "logprobs": {"dtype": "float32", "shape": [], "data": b"\x00" * 4},
        "versions": {"dtype": "int32", "shape": [], "data": b"\x00" * 4},
        "reward": 1.0,
    }
    with pytest.raises(WireError) as info:
        Sample.from_wire(wire)
    assert info.value.reason == "malformed"


@pytest.mark.parametrize("mutate", [
    lambda w: w.pop("samples"),
    lambda w: w.update(samples=[]),
    lambda w: w.update(samples="nope"),
    lambda w: w.pop("group_id"),
    lambda w: w.update(group_id=""),
    lambda w: w.pop("prompt_ids"),
    lambda w: w["samples"][0].pop("reward"),
    lambda w: w["samples"][0].update(reward="high"),
    lambda w: w["samples"][0].update(completion_ids=[1, 2, 3]),
    lambda w: w.update(generator="two"),
])
def test_group_from_wire_rejects_bad_fields(mutate):
    wire = _group().to_wire()
    mutate(wire)
    with pytest.raises(WireError) as info:
        Group.from_wire(wire)
    assert info.value.reason == "malformed"


@pytest.mark.parametrize("obj", [None, [1], "group"])
def test_group_and_sample_from_wire_reject_non_maps(obj):
    with pytest.raises(WireError):
        Group.from_wire(obj)
    with pytest.raises(WireError):
        Sample.from_wire(obj)


# -- multi-turn fields: loss_mask and token_rewards ------------------------------------------------
def test_loss_mask_defaults_to_ones_and_is_absent_on_the_wire():
    s = _sample([1, 2, 3], [0, 0, 0])
    assert s.loss_mask.dtype == np.uint8 and s.loss_mask.tolist() == [1, 1, 1] and s.token_rewards is None
    w = s.to_wire()
    assert "loss_mask" not in w and "token_rewards" not in w  # old readers see the old message
    back = Sample.from_wire(w)
    assert back.loss_mask.tolist() == [1, 1, 1] and back.token_rewards is None


def test_loss_mask_and_token_rewards_round_trip():
    s = _sample([1, 2, 3, 4], [0, 0, 1, 1])
    s.loss_mask = np.array([1, 0, 0, 1], np.uint8)  # tokens 2-3: an environment observation
    s.token_rewards = np.array([0, 0.5, 0, 1.0], np.float32)
    back = Sample.from_wire(decode(encode("reply", s=s.to_wire()), MAX)["s"])
    assert back.loss_mask.dtype == np.uint8 and back.loss_mask.tolist() == [1, 0, 0, 1]
    assert back.token_rewards.dtype == np.float32 and back.token_rewards.tolist() == [0, 0.5, 0, 1.0]


@pytest.mark.parametrize("field,value,match", [
    ("loss_mask", np.ones(2, np.uint8), "one length"),
    ("token_rewards", np.zeros(4, np.float32), "one length"),
    ("loss_mask", np.array([1, 2, 1], np.uint8), "zeros and ones"),
    ("loss_mask", np.ones(3, np.int32), "uint8"),
    ("token_rewards", np.zeros(3, np.float64), "float32"),
])
def test_bad_multi_turn_fields_are_refused_by_the_sample_and_the_buffer_envelope(field, value, match):
    from async_rlhf.buffer.envelope import inspect_group

    g = _group()
    w = g.to_wire()
    w["samples"][0][field] = pack_array(value)
    with pytest.raises(WireError, match=match):
        Sample.from_wire(w["samples"][0])
    with pytest.raises(WireError, match=match):
        inspect_group(w)


def test_envelope_agrees_with_the_group():
    from async_rlhf.buffer.envelope import inspect_group

    g = _group()
    g.samples[0].loss_mask = np.array([1, 0, 1], np.uint8)
    g.samples[1].token_rewards = np.array([0, 0, 0, 1], np.float32)
    env = inspect_group(g.to_wire())
    assert (env.group_id, env.min_version, env.num_samples, env.num_tokens) == ("gen0-17", 3, 2, 7)
    assert Group.from_wire(g.to_wire()).min_version == env.min_version
