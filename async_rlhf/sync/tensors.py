"""Byte-level views shared by sender and receiver: every bucket travels as raw bytes (uint8).

Sending bytes rather than typed tensors lets one reusable buffer serve buckets of every dtype, and the
backend never has to support the dtype (gloo's support for bf16 or fp8 varies; bytes always work).

The buckets (see :mod:`async_rlhf.sync.layout`) say where each tensor lies in one byte buffer, the *arena*
(bucket i at ``arena_offsets(...)[0][i]``). What travels is that arena as a few broadcasts, its *cut*, which
the sender chooses at an epoch's first push and names in that push's header; the receiver receives straight
into its arena, doing nothing per tensor:

- every tensor lies in one flat buffer, in arena order (:func:`flatten_params`, ZeRO-1/2): one broadcast of
  the whole arena, straight from that buffer (what a raw broadcast of the same bytes costs);
- otherwise (:func:`cut_arena`): a large tensor is a broadcast of its own, from its storage, and runs of
  small tensors are cut into chunks that the sender packs into a slot (one fused copy per chunk)::

    arena   | bucket 0: a b c d ...  | pad | bucket 1: e (large) ......................... | pad |
    cut     | chunk 0: a b c d ...   |     | chunk 1: e[:n]        | chunk 2: e[n:]        |
            | (packed)               |     | (e's storage)         | (e's storage)         |

A chunk's *pieces* are the (parts of) tensors in it (:func:`chunk_pieces`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from async_rlhf.sync.layout import DTYPE_BYTES, Bucket, aligned, chunk_ranges, layout_to_wire

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def arena_offsets(buckets: list[Bucket]) -> tuple[list[int], int]:
    """Byte offset of each bucket in one buffer holding all of them, and that buffer's size."""
    offsets, end = [], 0
    for b in buckets:
        offsets.append(end)
        end = aligned(end + b.nbytes)
    return offsets, end


def layout_digest(buckets: list[Bucket]) -> str:
    """Fingerprint of the layout: a push header carries the sender's, and a receiver holding another layout
    refuses the push instead of misreading it. (How the arena is cut into broadcasts is in the header too.)"""
    text = json.dumps(layout_to_wire(buckets), separators=(",", ":"))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def tensor_spans(buckets: list[Bucket]) -> list[tuple[int, int]]:
    """Every tensor's bytes in the arena, ``(first, end)``, in arena order (buckets are laid out in order)."""
    offsets, _ = arena_offsets(buckets)
    return [(off + e.offset * DTYPE_BYTES[b.dtype], off + (e.offset + e.numel) * DTYPE_BYTES[b.dtype])
            for off, b in zip(offsets, buckets) for e in sorted(b.entries, key=lambda e: e.offset)]


def cut_arena(buckets: list[Bucket], chunk_bytes: int, own_bytes: int) -> list[tuple[int, int]]:
    """The broadcasts of a push whose tensors do not all lie in one flat buffer (pure: from the layout only).

    A tensor of at least ``own_bytes`` is a broadcast of its own (split in ``chunk_bytes`` parts if larger),
    sent straight from its storage: no copy. Runs of smaller tensors between them are cut into chunks of at
    most ``chunk_bytes`` that the sender packs (packing one overlaps the transfer of the one before); their
    inner boundaries fall on multiples of ALIGN, hence between elements of every dtype. Bucket padding
    outside the runs is not sent::

        arena   | s s s s | BIG ............. | s s | pad | BIG2 ........................ |
        cut     | packed  | own               |packed|     | own (part 1)  | own (part 2)  |
    """
    if chunk_bytes <= 0 or own_bytes <= 0:
        raise ValueError("chunk_bytes and own_bytes must be positive")
    out: list[tuple[int, int]] = []
    run: list[int] = []  # first and end of the current run of small tensors

    def close_run() -> None:
        if run:
            lo, hi = run
            n = -(-(hi - lo) // chunk_bytes)
            size = -(-(hi - lo) // n)
            inner = sorted({b for b in (aligned(lo + i * size) for i in range(1, n)) if lo < b < hi})
            bounds = [lo, *inner, hi]
            out.extend(zip(bounds, bounds[1:]))
            run.clear()

    for lo, hi in tensor_spans(buckets):
        if hi - lo >= own_bytes:
            close_run()
            out.extend((lo + a, lo + b) for a, b in chunk_ranges(hi - lo, chunk_bytes))
        elif run:
            run[1] = hi
        else:
            run.extend((lo, hi))
    close_run()
    return out


def check_cut(cut: list[tuple[int, int]], buckets: list[Bucket]) -> None:
    """Raise ValueError unless ``cut`` is sorted, disjoint, inside the arena and carries every tensor byte."""
    _, total = arena_offsets(buckets)
    end = 0
    for a, b in cut:
        if a < end or b <= a or b > total:
            raise ValueError(f"the push's cut {a}-{b} overlaps, is empty or ends past the arena ({total} bytes)")
        end = b
    i = 0
    for lo, hi in tensor_spans(buckets):
        while lo < hi:
            while i < len(cut) and cut[i][1] <= lo:
                i += 1
            if i == len(cut) or cut[i][0] > lo:
                raise ValueError(f"the push's cut leaves bytes {lo}-{hi} of a tensor out")
            lo = min(hi, cut[i][1])


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of tensor number ``index`` (in layout order), at byte ``at`` of a chunk."""

    index: int
    dtype: str
    start: int
    stop: int
    at: int
    whole: bool


def chunk_pieces(buckets: list[Bucket], chunks: list[tuple[int, int]]) -> list[list[Piece]]:
    """For each chunk, the pieces of tensors it carries, in arena order (pure; computed once per layout)."""
    offsets, _ = arena_offsets(buckets)
    spans = []  # (first byte in the arena, tensor index, dtype, numel)
    index = 0
    for off, b in zip(offsets, buckets):
        size = DTYPE_BYTES[b.dtype]
        for e in b.entries:
            spans.append((off + e.offset * size, index, b.dtype, e.numel))
            index += 1
    spans.sort()
    out: list[list[Piece]] = [[] for _ in chunks]
    c = 0
    for lo, i, dtype, numel in spans:
        size = DTYPE_BYTES[dtype]
        hi = lo + numel * size
        while c < len(chunks) and chunks[c][1] <= lo:
            c += 1
        j = c
        while j < len(chunks) and chunks[j][0] < hi:
            a, b = max(lo, chunks[j][0]), min(hi, chunks[j][1])
            start, stop = (a - lo) // size, (b - lo) // size
            out[j].append(Piece(i, dtype, start, stop, a - chunks[j][0], stop - start == numel))
            j += 1
    return out


def in_place_chunk(pieces: list[Piece], srcs: list[torch.Tensor], nbytes: int) -> torch.Tensor | None:
    """A chunk's bytes straight from its tensors' storage, if every piece lies there where the chunk puts
    it (a part of one contiguous tensor, or parameters kept flat); else None (then: pack). ``srcs``: the
    pieces' tensors. Bytes between pieces (bucket padding) are whatever that storage holds there."""
    if not pieces:
        return None
    first, p0 = srcs[0], pieces[0]
    if not first.is_contiguous():
        return None
    size = first.element_size()
    zero = first.data_ptr() + p0.start * size - p0.at  # where the chunk's byte 0 would be
    for p, t in zip(pieces, srcs):
        if t.data_ptr() + p.start * t.element_size() != zero + p.at or not t.is_contiguous():
            return None
    # every piece sits where the chunk puts it; sending the range is exact if the first tensor's storage
    # covers it (then it is that storage's memory, whatever objects alias it)
    storage = first.untyped_storage()
    start = (first.storage_offset() + p0.start) * size - p0.at
    if start < 0 or start + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (nbytes,))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def named_views(raw: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's named tensors as typed, shaped views into its raw bytes (no copy)."""
    flat = raw[:bucket.nbytes].view(TORCH_DTYPES[bucket.dtype])
    return [(e.name, flat[e.offset:e.offset + e.numel].view(e.shape)) for e in bucket.entries]


@torch.no_grad()
def flatten_params(params: Mapping[str, torch.Tensor], buckets: list[Bucket]) -> torch.Tensor:
    """Move every tensor of ``params`` into one buffer laid out like ``buckets`` (``p.data`` re-pointed,
    values and Parameter objects kept), so that every later push sends straight from it: no packing.

    For a learner whose parameters are separate tensors (plain modules, DeepSpeed ZeRO-0), once; an optimizer
    built before may stay if it holds the Parameter objects and writes through them (torch's do, and so does
    DeepSpeed's unfused fp16/bf16 one, with ``p.data.copy_``), not if it keeps their storage.
    ZeRO-1/2 keep parameters as slices of their own flat buffers (the sender uses them as they are wherever
    a bucket's tensors happen to be back to back there); ZeRO-3 gathers fresh tensors for each push, so there
    is nothing to keep flat. Returns the buffer (bytes).
    """
    offsets, total = arena_offsets(buckets)
    first = next(iter(params.values()))
    arena = torch.empty(total, dtype=torch.uint8, device=first.device)
    for off, b in zip(offsets, buckets):
        flat = arena[off:off + b.nbytes].view(TORCH_DTYPES[b.dtype])
        for e in b.entries:
            p = params[e.name]
            view = flat[e.offset:e.offset + e.numel].view(e.shape)
            view.copy_(p)
            p.data = view
    return arena
