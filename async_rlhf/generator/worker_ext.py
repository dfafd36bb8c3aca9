"""vLLM worker extension: receives a pushed version and loads it into the running engine in place.

vLLM instantiates this class as a mixin of its worker (``LLM(worker_extension_cls=...)``) and
``llm.collective_rpc("name", args=...)`` calls its methods inside the worker, where
``self.model_runner`` is available. The same code runs in the GPU worker process with NCCL.

    generator actor                               worker (this class)
    ---------------                               -------------------
    collective_rpc("init_receiver", ...)    --->  connect to the sender's store (no group yet)
    initial member:
      collective_rpc("join_push_group")     --->  wait until the sender forms the group
    late joiner / restarted generator, before serving anything:
      collective_rpc("receive_update")      --->  join at the sender's next push and load that version
    at each update, while the engine keeps generating:
      collective_rpc("stage_update")        --->  a thread receives every chunk into the buffer, acks
      ... until it returns True, then between two engine steps:
      collective_rpc("apply_update")        --->  reload_weights from the buffer, redo the tied
                                                  lm_head's packing, mark the version live
    (receive_update does both, standing still: tests and a late joiner before it serves)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from async_rlhf.sync.layout import layout_from_wire
from async_rlhf.sync.receiver import Receiver


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
    _receiver: Receiver | None = None
    _stage_thread: threading.Thread | None = None
    _stage_box: dict[str, Any] | None = None  # what the fetch thread left: "staged" or "error"

    # -- the push group with membership epochs (async_rlhf.sync.receiver.Receiver) ----------------
    def init_receiver(self: LikeWorker, host: str, port: int, member_id: str, layout: list[dict[str, Any]],
                      backend: str = "gloo", timeout_s: float = 120.0) -> None:
        """Connect to the sender's store as ``member_id`` (a stable id such as ``gen0``)."""
        self._receiver = Receiver(layout_from_wire(layout), member_id, host, port, backend, timeout_s)

    def set_weight_layout(self: LikeWorker, layout: list[dict[str, Any]]) -> None:
        """Change the bucket layout (the sender must change it at the same version boundary)."""
        self._get_receiver().use_layout(layout_from_wire(layout))

    def join_push_group(self: LikeWorker, timeout_s: float | None = None) -> int:
        """Initial member: block until the sender forms the group; returns the epoch."""
        return self._get_receiver().join(timeout_s)

    def stage_update(self: LikeWorker, timeout_s: float | None = None) -> bool:
        """Start receiving the next pushed version on a background thread (once per update), into the
        receiver's buffer: the engine keeps generating meanwhile. True once it has arrived (or failed);
        then call :meth:`apply_update` between two engine steps."""
        if self._stage_thread is None:
            rx = self._get_receiver()
            box: dict[str, Any] = {}
            self._stage_box = box

            def fetch() -> None:
                try:
                    box["staged"] = rx.fetch(timeout_s)
                except BaseException as exc:  # handed to apply_update, in the engine's thread
                    box["error"] = exc

            self._stage_thread = threading.Thread(target=fetch, name="weight-fetch", daemon=True)
            self._stage_thread.start()
        return not self._stage_thread.is_alive()

    def apply_update(self: LikeWorker, refresh_lm_head: bool = True) -> dict[str, Any]:
        """Load the staged version into the engine (waits for the fetch if it is still running); returns
        its version, epoch and timings. ``sync/pause_s`` is the time spent here: the engine's pause.

        ``refresh_lm_head=False`` skips the tied lm_head's re-processing: only tests use it, to show
        that it is needed. Raises what the fetch raised (timeout, excluded, aborted push)."""
        t0 = time.perf_counter()
        thread, box = self._stage_thread, self._stage_box
        if thread is None or box is None:
            raise RuntimeError("no update is being received: call stage_update first")
        thread.join()
        self._stage_thread = None
        if "error" in box:
            raise box["error"]
        runner = self.model_runner

        def load(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            runner.reload_weights(weights_iterator=weights)
            if refresh_lm_head:
                refresh_tied_lm_head(runner.get_model())

        got = self._get_receiver().apply(box["staged"], load)
        return {"version": got.version, "epoch": got.epoch, **got.metrics, "sync/pause_s": time.perf_counter() - t0}

    def receive_update(self: LikeWorker, timeout_s: float | None = None,
                       refresh_lm_head: bool = True) -> dict[str, Any]:
        """Receive and load the next pushed version, standing still (``sync/pause_s``: all of it)."""
        t0 = time.perf_counter()
        self.stage_update(timeout_s)
        got = self.apply_update(refresh_lm_head)
        return {**got, "sync/pause_s": time.perf_counter() - t0}

    def _get_receiver(self: LikeWorker) -> Receiver:
        if self._receiver is None:
            raise RuntimeError("init_receiver was never called: this worker has no push group")
        return self._receiver
