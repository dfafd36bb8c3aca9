"""Bucket planning of the weight push: sizes, dtype separation, contiguous offsets, wire form."""

import math

import pytest

from async_rlhf.sync.layout import (
    DTYPE_BYTES,
    Bucket,
    Entry,
    TensorSpec,
    layout_from_wire,
    layout_to_wire,
    plan_buckets,
)

SPECS = [
    TensorSpec("embed.weight", (10, 8), "float32"),       # 80 el = 320 B
    TensorSpec("layer0.q", (8, 8), "float32"),            # 64 el = 256 B
    TensorSpec("layer0.norm", (8,), "bfloat16"),          # 8 el = 16 B
    TensorSpec("layer0.k", (4, 8), "float32"),            # 32 el = 128 B
    TensorSpec("big", (300,), "float32"),                 # 300 el = 1200 B > one bucket
    TensorSpec("layer1.q", (8, 8), "float32"),            # 64 el
    TensorSpec("steps", (1,), "int64"),                   # 8 B
    TensorSpec("layer1.norm", (8,), "bfloat16"),
    TensorSpec("scale", (), "float16"),                   # a scalar: 1 el
]
BUCKET_BYTES = 512


def check_invariants(buckets: list[Bucket], specs: list[TensorSpec], bucket_bytes: int) -> None:
    by_name = {s.name: s for s in specs}
    placed = [e.name for b in buckets for e in b.entries]
    assert sorted(placed) == sorted(by_name)  # every tensor exactly once
    for b in buckets:
        assert b.entries, "no empty bucket"
        offset = 0
        for e in b.entries:
            spec = by_name[e.name]
            assert spec.dtype == b.dtype
            assert e.shape == spec.shape
            assert e.numel == math.prod(spec.shape)
            assert e.offset == offset  # contiguous, in order, no gaps
            offset += e.numel
        assert b.numel == offset
        assert b.nbytes == b.numel * DTYPE_BYTES[b.dtype]
        if len(b.entries) > 1:
            assert b.nbytes <= bucket_bytes
        else:
            # a lone tensor may exceed the bucket size only if it alone does not fit
            assert b.nbytes <= bucket_bytes or b.entries[0].numel * DTYPE_BYTES[b.dtype] > bucket_bytes


def test_plan_by_hand():
    buckets = plan_buckets(SPECS, BUCKET_BYTES)
    check_invariants(buckets, SPECS, BUCKET_BYTES)
    got = [(b.dtype, [e.name for e in b.entries], b.numel) for b in buckets]
    # float32 cap = 128 elements: embed(80) | q(64)? 144 > 128 -> new bucket: q(64)+k(32)=96 | big(300) alone |
    # layer1.q(64)
    assert got == [
        ("float32", ["embed.weight"], 80),
        ("float32", ["layer0.q", "layer0.k"], 96),
        ("float32", ["big"], 300),
        ("float32", ["layer1.q"], 64),
        ("bfloat16", ["layer0.norm", "layer1.norm"], 16),
        ("int64", ["steps"], 1),
        ("float16", ["scale"], 1),
    ]
    assert [e.offset for e in buckets[1].entries] == [0, 64]
    assert buckets[4].entries[1] == Entry("layer1.norm", (8,), 8, 8)
    assert buckets[6].entries[0].shape == ()


def test_bucket_size_respected_and_fills_exactly():
    specs = [TensorSpec(f"t{i}", (16,), "float32") for i in range(10)]  # 64 B each
    buckets = plan_buckets(specs, 256)
    assert [len(b.entries) for b in buckets] == [4, 4, 2]
    assert [b.nbytes for b in buckets] == [256, 256, 128]
    check_invariants(buckets, specs, 256)


def test_large_tensor_gets_its_own_bucket():
    specs = [TensorSpec("a", (10,), "float32"), TensorSpec("huge", (1000,), "float32"),
             TensorSpec("b", (10,), "float32")]
    buckets = plan_buckets(specs, 100)
    assert [[e.name for e in b.entries] for b in buckets] == [["a"], ["huge"], ["b"]]
    assert buckets[1].nbytes == 4000
    # first in line too
    buckets = plan_buckets(specs[1:], 100)
    assert [[e.name for e in b.entries] for b in buckets] == [["huge"], ["b"]]


def test_dtypes_never_share_a_bucket():
    specs = [TensorSpec(f"t{i}", (2,), dt) for i, dt in enumerate(["float32", "float16", "float32", "int64",
                                                                    "float16", "bfloat16", "uint8", "int32"])]
    buckets = plan_buckets(specs, 1 << 20)
    assert [b.dtype for b in buckets] == ["float32", "float16", "int64", "bfloat16", "uint8", "int32"]
    assert [[e.name for e in b.entries] for b in buckets][:2] == [["t0", "t2"], ["t1", "t4"]]
    check_invariants(buckets, specs, 1 << 20)


def test_many_random_layouts_keep_invariants():
    import random

    rng = random.Random(0)
    dtypes = sorted(DTYPE_BYTES)
    for trial in range(30):
        specs = [TensorSpec(f"p{trial}.{i}", tuple(rng.randrange(1, 9) for _ in range(rng.randrange(0, 3))),
                            rng.choice(dtypes)) for i in range(rng.randrange(1, 25))]
        bucket_bytes = rng.choice([8, 16, 64, 100, 1000])
        buckets = plan_buckets(specs, bucket_bytes)
        check_invariants(buckets, specs, bucket_bytes)
        assert layout_from_wire(layout_to_wire(buckets)) == buckets


def test_plan_refuses_bad_input():
    with pytest.raises(ValueError):
        plan_buckets(SPECS, 0)
    with pytest.raises(ValueError, match="complex64"):
        plan_buckets([TensorSpec("c", (2,), "complex64")], 64)
    assert plan_buckets([], 64) == []


def test_layout_wire_round_trip_is_plain_data():
    buckets = plan_buckets(SPECS, BUCKET_BYTES)
    data = layout_to_wire(buckets)

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return isinstance(x, (str, int))

    assert plain(data)
    assert data[1] == {"dtype": "float32", "numel": 96,
                       "entries": [["layer0.q", [8, 8], 0, 64], ["layer0.k", [4, 8], 64, 32]]}
    assert layout_from_wire(data) == buckets


@pytest.mark.parametrize("entry", [
    ["w", [4, 8], 70, 32],    # offset + numel = 102 > 96
    ["w", [100], 0, 100],     # larger than the bucket
    ["w", [4, 8], 0, 30],     # numel disagrees with the shape
])
def test_layout_from_wire_rejects_an_entry_that_does_not_fit(entry):
    data = layout_to_wire(plan_buckets(SPECS, BUCKET_BYTES))
    data[1]["entries"][1] = entry
    with pytest.raises(ValueError, match="w"):
        layout_from_wire(data)
