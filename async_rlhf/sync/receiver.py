"""Receiver side of the weight push (inside a generator's vLLM worker). Mirrors the sender."""

from __future__ import annotations

import torch

from async_rlhf.sync.group import allreduce_sum, broadcast
from async_rlhf.sync.layout import Bucket
from async_rlhf.sync.sender import TORCH_DTYPES


def receive_buckets(pg, buckets: list[Bucket], timeout_s: float) -> list[tuple[str, torch.Tensor]]:
    """Receive every bucket from rank 0 and return named views into the flat buffers."""
    named: list[tuple[str, torch.Tensor]] = []
    for b in buckets:
        flat = torch.empty(b.numel, dtype=TORCH_DTYPES[b.dtype])
        broadcast(pg, flat, root=0, timeout_s=timeout_s)
        named.extend((e.name, flat[e.offset:e.offset + e.numel].view(e.shape)) for e in b.entries)
    return named


def acknowledge(pg, timeout_s: float) -> None:
    """Tell the sender this receiver has loaded the version (the sender sums the acks)."""
    allreduce_sum(pg, torch.ones(1, dtype=torch.int64), timeout_s)
