"""Byte-level views shared by sender and receiver: every bucket travels as raw bytes (uint8).

Sending bytes rather than typed tensors lets one reusable buffer serve buckets of every dtype, and the
backend never has to support the dtype (gloo's support for bf16 or fp8 varies; bytes always work).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from async_rlhf.sync.layout import Bucket

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}

ALIGN = 64
"""Byte alignment of every bucket inside a shared buffer (a typed view needs its offset aligned)."""


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def arena_offsets(buckets: list[Bucket]) -> tuple[list[int], int]:
    """Byte offset of each bucket in one buffer holding all of them, and that buffer's size."""
    offsets, end = [], 0
    for b in buckets:
        offsets.append(end)
        end = aligned(end + b.nbytes)
    return offsets, end


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def named_views(raw: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's named tensors as typed, shaped views into its raw bytes (no copy)."""
    flat = raw[:bucket.nbytes].view(TORCH_DTYPES[bucket.dtype])
    return [(e.name, flat[e.offset:e.offset + e.numel].view(e.shape)) for e in bucket.entries]


def adjacent_bytes(srcs: list[torch.Tensor], bucket: Bucket) -> torch.Tensor | None:
    """The bucket's bytes straight from its tensors' storage, if they lie there back to back in the
    bucket's order (a lone contiguous tensor, or parameters kept flat); else None (then: pack)."""
    first = srcs[0]
    if not first.is_contiguous():
        return None
    size = first.element_size()
    base = first.data_ptr()
    for t, e in zip(srcs, bucket.entries):
        if t.data_ptr() != base + e.offset * size or not t.is_contiguous():
            return None
    # every tensor's bytes sit where the bucket puts them; sending the range is exact if the first
    # tensor's storage covers it (then it is that storage's memory, whatever objects alias it)
    storage = first.untyped_storage()
    start = first.storage_offset() * size
    nbytes = bucket.numel * size
    if start + nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (nbytes,))


@torch.no_grad()
def flatten_params(params: Mapping[str, torch.Tensor], buckets: list[Bucket]) -> torch.Tensor:
    """Move every tensor of ``params`` into one buffer laid out like ``buckets`` (``p.data`` re-pointed,
    values and Parameter objects kept), so that every later push sends straight from it: no packing.

    For a learner whose parameters are separate tensors (plain modules, DeepSpeed ZeRO-0); call it once,
    before the optimizer is built. ZeRO-1/2 keep parameters as slices of their own flat buffers (the
    sender uses them as they are wherever a bucket's tensors happen to be back to back there); ZeRO-3
    gathers fresh tensors for each push, so there is nothing to keep flat. Returns the buffer (bytes).
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
