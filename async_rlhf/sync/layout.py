"""How named tensors are packed into flat broadcast buckets (pure; both sides compute nothing else).

The sender and every receiver share one plain-data layout, sent once when the push group is built::

    bucket 0 (float32, numel 1_050_000)             bucket 1 (float32, ...)
    | embed_tokens.weight | layers.0.q_proj.weight | ... |    | layers.1.mlp.up_proj.weight | ...

Tensors are grouped by dtype in the order given and packed until a bucket would exceed ``bucket_bytes``;
a tensor larger than one bucket gets a bucket of its own. Nothing here is pickled: the wire form is
lists of strings and integers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ALIGN = 64
"""Byte alignment of every bucket inside a shared buffer (a typed view needs its offset aligned)."""


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Bucket:
    dtype: str
    numel: int
    entries: tuple[Entry, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def auto_bucket_bytes(total_bytes: int, target_buckets: int = 8, lo: int = 4 << 20, hi: int = 64 << 20) -> int:
    """A bucket size that gives the push about ``target_buckets`` buckets to pipeline (packing and loading
    of one overlap the transfer of the next), within [lo, hi] (per-op overhead below, memory above)."""
    return int(min(max(total_bytes // target_buckets, lo), hi))


def auto_chunk_bytes(total_bytes: int, target_chunks: int = 4, lo: int = 2 << 20, hi: int = 64 << 20) -> int:
    """The size of one broadcast on the wire (see :func:`async_rlhf.sync.tensors.chunk_ranges`).

    Each gloo broadcast costs about 0.2-0.5 ms of CPU on top of its bytes (measured: 80 broadcasts of
    0.5 MiB took 1.8-2x one broadcast of 40 MiB), so a push is a few large broadcasts whatever the
    tensors: ``target_chunks`` of them (packing chunk c + 1 overlaps the transfer of chunk c), at least
    ``lo`` bytes each (per-op overhead below), at most ``hi`` (the sender's packing slots above)."""
    return int(min(max(-(-total_bytes // target_chunks), lo), hi))


def chunk_ranges(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The arena's bytes ``[0, total)`` cut into ceil(total / chunk_bytes) near-equal ranges whose
    boundaries are multiples of ALIGN (so they fall between elements of every dtype)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    if total <= 0:
        return []
    n = -(-total // chunk_bytes)
    size = aligned(-(-total // n))
    return [(s, min(s + size, total)) for s in range(0, total, size)]


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    by_dtype: dict[str, list[TensorSpec]] = {}
    for spec in specs:
        if spec.dtype not in DTYPE_BYTES:
            raise ValueError(f"tensor {spec.name} has dtype {spec.dtype}, which the weight push cannot carry")
        by_dtype.setdefault(spec.dtype, []).append(spec)
    buckets: list[Bucket] = []
    for dtype, group in by_dtype.items():
        cap = max(1, bucket_bytes // DTYPE_BYTES[dtype])
        entries: list[Entry] = []
        offset = 0
        for spec in group:
            if entries and offset + spec.numel > cap:
                buckets.append(Bucket(dtype, offset, tuple(entries)))
                entries, offset = [], 0
            entries.append(Entry(spec.name, tuple(spec.shape), offset, spec.numel))
            offset += spec.numel
        if entries:
            buckets.append(Bucket(dtype, offset, tuple(entries)))
    return buckets


def layout_to_wire(buckets: list[Bucket]) -> list[dict[str, Any]]:
    return [
        {"dtype": b.dtype, "numel": b.numel,
         "entries": [[e.name, list(e.shape), e.offset, e.numel] for e in b.entries]}
        for b in buckets
    ]


def layout_from_wire(data: list[dict[str, Any]]) -> list[Bucket]:
    buckets = []
    for b in data:
        entries = tuple(Entry(str(n), tuple(int(d) for d in shape), int(off), int(numel))
                        for n, shape, off, numel in b["entries"])
        if str(b["dtype"]) not in DTYPE_BYTES:
            raise ValueError(f"layout bucket has dtype {b['dtype']!r}, which the weight push cannot carry")
        end = 0
        for e in sorted(entries, key=lambda e: e.offset):
            if math.prod(e.shape) != e.numel or e.offset < end or e.offset + e.numel > int(b["numel"]):
                raise ValueError(f"layout entry {e.name} overlaps another or does not fit its bucket")
            end = e.offset + e.numel
        buckets.append(Bucket(str(b["dtype"]), int(b["numel"]), entries))
    return buckets
