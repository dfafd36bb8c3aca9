"""vLLM worker extension: receives a pushed version and loads it into the running engine in place.

vLLM instantiates this class as a mixin of its worker (``LLM(worker_extension_cls=...)``) and
``llm.collective_rpc("name", args=...)`` calls its methods inside the worker, where
``self.model_runner`` is available. The same code runs in the GPU worker process with NCCL.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from async_rlhf.sync.group import make_group
from async_rlhf.sync.layout import layout_from_wire
from async_rlhf.sync.receiver import acknowledge, receive_buckets


class LikeWorker(Protocol):
    """What this extension needs of the vLLM worker it is mixed into."""

    model_runner: Any


def refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Redo the lm_head's post-load processing (the CPU backend prepacks its GEMM at load time).

    Without this, a tied lm_head keeps computing logits from the old embedding after
    ``reload_weights`` although every parameter checksum matches (see DESIGN.md).
    """
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


class WeightSyncWorker:
    _pg: Any = None

    def init_weight_sync(self: LikeWorker, host: str, port: int, world_size: int, rank: int,
                         layout: list[dict[str, Any]], backend: str, timeout_s: float) -> None:
        self._buckets = layout_from_wire(layout)
        self._timeout_s = timeout_s
        self._pg = make_group(host, port, world_size, rank, backend, timeout_s)

    def receive_weights(self: LikeWorker) -> dict[str, float]:
        if self._pg is None:
            raise RuntimeError("receive_weights before init_weight_sync: the push group was never built")
        t0 = time.perf_counter()
        named = receive_buckets(self._pg, self._buckets, self._timeout_s)
        t1 = time.perf_counter()
        self.load_named_weights(named)
        t2 = time.perf_counter()
        acknowledge(self._pg, self._timeout_s)
        return {"receive_s": t1 - t0, "load_s": t2 - t1, "total_s": time.perf_counter() - t0}

    def load_named_weights(self: LikeWorker, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model_runner.reload_weights(weights_iterator=iter(named))
        refresh_tied_lm_head(self.model_runner.get_model())
