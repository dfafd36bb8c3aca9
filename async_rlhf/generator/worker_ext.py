"""vLLM worker extension: receives pushed versions and loads them into the running engine in place.

vLLM instantiates this class as a mixin of its worker (``LLM(worker_extension_cls=...)``) and
``llm.collective_rpc("name", args=...)`` calls its methods inside the worker, where
``self.model_runner`` is available. The same code runs in the GPU worker process with NCCL.

    generator actor                               worker (this class)
    ---------------                               -------------------
    collective_rpc("init_receiver", ...)    --->  connect to the sender's store (no group yet)
    initial member:
      collective_rpc("join_push_group")     --->  wait until the sender forms the group
    collective_rpc("start_fetching")        --->  a thread receives every push, back to back, for good:
                                                  chunks into a free slot, ack (the sender goes on), staged;
                                                  nobody announces a push: the receives are already posted
    engine loop, every few ms:
      collective_rpc("staged_version")      --->  the newest staged version (None: nothing new)
    ... then, between two engine steps:
      collective_rpc("apply_update")        --->  reload_weights from that slot, redo the tied lm_head's
                                                  packing, mark the version live
    (a late joiner or a restarted generator: start_fetching, then apply_update before serving anything)

With two receive slots (``sync.receive_buffers``) the next version arrives while the engine still serves
the last one; versions that arrive faster than the engine swaps are skipped (only the newest is loaded).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from async_rlhf.sync.group import SyncError, SyncTimeout
from async_rlhf.sync.layout import layout_from_wire
from async_rlhf.sync.protocol import tp_member_id
from async_rlhf.sync.receiver import Receiver, Staged

STOP_FETCH_S = 10.0
"""How long replacing a receiver waits for the old fetch thread to end (it sees the cancel within a slice)."""


class LikeWorker(Protocol):
    """What this extension needs of the vLLM worker it is mixed into."""

    model_runner: Any
    rank: int
    parallel_config: Any


def refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Redo the lm_head's post-load processing (the CPU backend prepacks its GEMM at load time).

    Without this, a tied lm_head keeps computing logits from the old embedding after
    ``reload_weights`` although every parameter checksum matches (docs/architecture.md, "Weight push").
    """
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(lm_head)


def common_staged(per_worker: list[int | None]) -> int | None:
    """What an engine's workers (one per TP rank, each its own member) have staged, as one answer: -1 if any
    fetch failed, None until every worker holds a version, else the oldest of them (a push completes for all
    members at once, so they differ only for the moment between its acknowledgement and the next poll)."""
    if any(v == -1 for v in per_worker):
        return -1
    if not per_worker or any(v is None for v in per_worker):
        return None
    return min(v for v in per_worker if v is not None)


def agreed_version(held: list[int | None]) -> int | None:
    """The version every TP worker of an engine loads after :meth:`WeightSyncWorker.hold_staged` returned
    ``held``: the newest any of them holds (a push completes for all members at once, so the others hold it or
    are finishing its receive), None if one failed or holds nothing (then no exact version is asked for)."""
    if not held or any(v is None or v < 0 for v in held):
        return None
    return max(v for v in held if v is not None)


class WeightSyncWorker:
    _receiver: Receiver | None = None
    _fetcher: threading.Thread | None = None
    _fetch_rx: Receiver | None = None  # the receiver _fetcher runs on
    _fetched: threading.Condition | None = None
    _latest: Staged | None = None  # the newest version received whole and not yet applied
    _fetch_error: BaseException | None = None  # the fetch loop's last failure, handed to apply_update
    _held = False  # a TP engine is agreeing on the version to load (hold_staged .. apply_update)
    _holds = 0  # holds so far
    _kept: dict[int, Staged] = {}  # the versions staged since the hold, by version (loadable until released)

    # -- the push group with membership epochs (async_rlhf.sync.receiver.Receiver) ----------------
    def init_receiver(self: LikeWorker, host: str, port: int, member_id: str, layout: list[dict[str, Any]],
                      backend: str = "gloo", timeout_s: float = 120.0, buffers: int = 1,
                      min_gbps: float = 0.0) -> None:
        """Connect to the sender's store as ``member_id`` (a stable id such as ``gen0``; TP worker r of a
        tensor-parallel engine joins as ``gen0.tp<r>``: every worker receives, see :func:`tp_member_id`)."""
        tp = self.parallel_config.tensor_parallel_size
        member_id = tp_member_id(member_id, self.rank % tp, tp)
        receiver = Receiver(layout_from_wire(layout), member_id, host, port, backend, timeout_s,
                            buffers=buffers, min_gbps=min_gbps)
        self._stop_fetching()  # a live worker re-joining (a heal): its old fetch thread must not run on
        if self._fetched is None:  # one condition for the worker's life (an old fetch thread may still hold it)
            self._fetched = threading.Condition()
        with self._fetched:
            self._receiver = receiver

    def _stop_fetching(self: LikeWorker) -> None:
        """Cancel the current receiver and end its fetch thread (bounded), forgetting whatever it staged: a
        version staged in the old receiver's slots is never loaded through another receiver."""
        old, thread = self._receiver, self._fetcher
        if old is None:
            return
        old.cancel()
        if self._fetched is not None:
            with self._fetched:
                self._fetched.notify_all()  # a fetch thread waiting out a hold sees the cancel now
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_FETCH_S)
        if self._fetched is not None:
            with self._fetched:
                self._latest, self._fetch_error, self._held, self._kept = None, None, False, {}
        if thread is None or not thread.is_alive():
            old.close()  # else the thread closes nothing: it ends on its own at its next slice

    def join_push_group(self: LikeWorker, timeout_s: float | None = None) -> int:
        """Initial member: block until the sender forms the group; returns the epoch."""
        return self._get_receiver().join(timeout_s)

    def start_fetching(self: LikeWorker, timeout_s: float | None = None) -> None:
        """Start the thread that receives every push for good (idempotent). A fetch that times out (no push
        for ``timeout_s``) simply waits again; a failed one is kept for :meth:`apply_update` to raise, and
        the next push is received as usual (the receiver joins again if it was dropped)."""
        if self._fetched is None:
            self._fetched = threading.Condition()
        cond = self._fetched
        with cond:  # the engine loop and a Ray call (a heal) may both get here: one thread per receiver
            rx = self._get_receiver()
            if rx.cancelled or (self._fetcher is not None and self._fetcher.is_alive() and self._fetch_rx is rx):
                return
            self._start_fetch_thread(rx, cond, timeout_s)

    def _start_fetch_thread(self: LikeWorker, rx: Receiver, cond: threading.Condition,
                            timeout_s: float | None) -> None:

        def loop() -> None:
            while not rx.cancelled:
                try:
                    staged = rx.fetch(timeout_s, keep_staged=True)
                except SyncTimeout:
                    continue
                except BaseException as exc:  # handed to apply_update, in the engine's thread
                    with cond:
                        if rx.cancelled or self._receiver is not rx:
                            return  # replaced (a heal): its failures are not the new receiver's
                        self._fetch_error = exc
                        cond.notify_all()
                    time.sleep(0.05)
                    continue
                with cond:
                    if rx.cancelled or self._receiver is not rx:
                        return  # replaced meanwhile: what it staged is never loaded
                    self._latest, self._fetch_error = staged, None
                    if self._held:  # keep it loadable, and start no fetch (no slot is reused) until released
                        self._kept[staged.version] = staged
                    cond.notify_all()
                    hold = self._holds  # a new hold before this thread woke up is not this one's to wait out
                    cond.wait_for(lambda: not self._held or self._holds != hold or rx.cancelled,
                                  timeout=rx.timeout_s)

        self._fetcher, self._fetch_rx = threading.Thread(target=loop, name="weight-fetch", daemon=True), rx
        self._fetcher.start()

    def staged_version(self: LikeWorker) -> int | None:
        """The newest version received and not yet applied (-1: the last fetch failed), None if neither;
        starts the fetch loop if needed. Cheap: the engine loop polls it."""
        self.start_fetching()
        with self._fetched:
            if self._latest is not None:
                return self._latest.version
            return -1 if self._fetch_error is not None else None

    def hold_staged(self: LikeWorker) -> int | None:
        """A tensor-parallel engine's first step of a swap: keep every version staged from now on loadable (the
        fetch loop starts no new fetch until :meth:`apply_update` releases it) and return the newest staged one
        (-1: a failed fetch; None: none). The engine then asks every worker for one version (:func:`agreed_version`),
        so no TP worker can load another one than its peers."""
        self.start_fetching()
        with self._fetched:
            self._held, self._holds = True, self._holds + 1
            self._kept = {self._latest.version: self._latest} if self._latest is not None else {}
            if self._latest is not None:
                return self._latest.version
            return -1 if self._fetch_error is not None else None

    def release_hold(self: LikeWorker) -> str | None:
        """End a hold without loading anything (the TP workers did not all hold a version): the fetch loop goes
        on; returns the fetch failure that stopped this worker, if any (cleared, as a load would clear it)."""
        with self._fetched:
            self._held, self._kept = False, {}
            error, self._fetch_error = self._fetch_error, None
            self._fetched.notify_all()
        return None if error is None else f"{type(error).__name__}: {error}"

    def stage_update(self: LikeWorker, timeout_s: float | None = None) -> bool:
        """Start receiving pushes (the fetch loop) if not started; True once a version has arrived whole (or
        a fetch failed): then call :meth:`apply_update` between two engine steps."""
        self.start_fetching(timeout_s)
        return self.staged_version() is not None

    def apply_update(self: LikeWorker, refresh_lm_head: bool = True, timeout_s: float | None = None,
                     version: int | None = None) -> dict[str, Any]:
        """Load the newest staged version into the engine (waits up to ``timeout_s`` for one if none has
        arrived yet); returns its version, epoch and timings. ``sync/pause_s`` is the time spent here: the
        engine's pause; ``sync/coalesced`` counts versions skipped so far because a newer one came first.
        ``version`` (after :meth:`hold_staged`): load exactly that one, waiting for it if it is still arriving;
        the hold is released either way.

        ``refresh_lm_head=False`` skips the tied lm_head's re-processing: only tests use it, to show
        that it is needed. Raises what the fetch raised (timeout, excluded, aborted push)."""
        t0 = time.perf_counter()
        rx = self._get_receiver()
        self.start_fetching()
        with self._fetched:
            try:
                if version is None:
                    self._fetched.wait_for(lambda: self._latest is not None or self._fetch_error is not None,
                                           timeout=timeout_s or rx.timeout_s)
                    staged, self._latest = self._latest, None
                else:
                    self._fetched.wait_for(lambda: version in self._kept or self._fetch_error is not None or (
                        self._latest is not None and self._latest.version >= version),
                        timeout=timeout_s or rx.timeout_s)
                    staged = self._kept.get(version) or (self._latest if self._latest is not None
                                                          and self._latest.version == version else None)
                    if staged is not None and self._latest is staged:
                        self._latest = None  # a newer one stays staged for the next swap
                error, self._fetch_error = self._fetch_error, None
                if staged is not None:  # reserve its slot before the fetch thread can post a receive into it
                    try:
                        rx.claim(staged)
                    except SyncError as exc:
                        staged, error = None, exc
            finally:
                self._held, self._kept = False, {}
                self._fetched.notify_all()
        if staged is None:
            if version is not None and error is None:
                error = SyncError(f"version {version} is no longer staged here (the engine's TP workers disagree)")
            raise error or SyncTimeout(f"no version arrived within {timeout_s or rx.timeout_s:g} s")
        runner = self.model_runner

        def load(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
            runner.reload_weights(weights_iterator=weights)
            if refresh_lm_head:
                refresh_tied_lm_head(runner.get_model())

        got = rx.apply(staged, load)  # releases the claim
        return {"version": got.version, "epoch": got.epoch, **got.metrics, "sync/coalesced": float(rx.coalesced),
                "sync/pause_s": time.perf_counter() - t0}

    def raw_receive(self: LikeWorker, tag: str, members: list[str], nbytes: int, reps: int) -> None:
        """This worker's part of a raw broadcast of the push's bytes (async_rlhf/sync/raw.py), on its receiver's
        store and transport, as rank 1 + its member id's index in ``members``."""
        from async_rlhf.sync.raw import raw_receive

        rx = self._get_receiver()
        raw_receive(rx.store, rx.transport, members.index(rx.member_id) + 1, len(members) + 1, nbytes, tag, reps,
                    rx.timeout_s)

    def _get_receiver(self: LikeWorker) -> Receiver:
        if self._receiver is None:
            raise RuntimeError("init_receiver was never called: this worker has no push group")
        return self._receiver
