"""Sender side of the weight push (learner rank 0). Mirrors :mod:`async_rlhf.sync.receiver`.

Update protocol, per version v::

    learner rank 0                          each generator (between two engine steps)
    ---------------                          -----------------------------------------
    tell generators "v is coming"  ------>   finish the current step, stop stepping
    for each bucket: broadcast  ========>    receive bucket into a flat buffer
                                             rebuild named tensors, reload into vLLM in place
    allreduce(ack) <====================>    allreduce(1): "v loaded"
    v is live (record time)                  tokens from now on carry version v
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from async_rlhf.sync.group import allreduce_sum, broadcast
from async_rlhf.sync.layout import Bucket

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class WeightSender:
    def __init__(self, pg, buckets: list[Bucket], num_receivers: int, timeout_s: float) -> None:
        self.pg = pg
        self.buckets = buckets
        self.num_receivers = num_receivers
        self.timeout_s = timeout_s

    def push(self, params: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Broadcast every bucket, then wait for every receiver's acknowledgement."""
        t0 = time.perf_counter()
        nbytes = 0
        for b in self.buckets:
            flat = torch.empty(b.numel, dtype=TORCH_DTYPES[b.dtype])
            for e in b.entries:
                flat[e.offset:e.offset + e.numel].copy_(params[e.name].detach().reshape(-1))
            broadcast(self.pg, flat, root=0, timeout_s=self.timeout_s)
            nbytes += b.nbytes
        t_sent = time.perf_counter()
        ack = torch.zeros(1, dtype=torch.int64)
        allreduce_sum(self.pg, ack, self.timeout_s)
        if int(ack.item()) != self.num_receivers:
            raise RuntimeError(f"weight push acknowledged by {int(ack.item())} of {self.num_receivers} receivers")
        t_done = time.perf_counter()
        return {"sync/bytes": float(nbytes), "sync/broadcast_s": t_sent - t0, "sync/push_s": t_done - t0}
