"""Process-group plumbing of the weight push: the store, one group per membership epoch, bounded waits.

    rank 0            rank 1          rank 2                rank N
    learner rank 0    member 0        member 1       ...    member N-1      (members = generator workers)
    (sender, hosts    (receivers, inside their vLLM workers)
     the TCPStore)

The group is apart from the learners' default group, so a generator that dies never touches the
data-parallel collectives of the learners. A gloo op whose peer is dead or hung does not fail until its
own timeout, and ``abort()`` does not cancel it, so every wait here is sliced: between slices we check a
deadline and an abort condition (a store key), so the caller decides when to give up. A group whose op
was abandoned is never reused: membership code opens a new epoch, and the old group is released only
once that op has timed out (its destructor would block until then).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime as dt
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from async_rlhf.endpoints import free_port  # noqa: F401  (callers import it from here too)

log = logging.getLogger(__name__)


class SyncError(RuntimeError):
    """A weight-push operation failed or did not finish in time."""


class SyncTimeout(SyncError):
    """A bounded wait reached its deadline."""


class Aborted(SyncError):
    """The other side gave up on this push (an abort or failure key appeared)."""


def caused_by(exc: BaseException | None, kind: type[BaseException]) -> bool:
    """Whether ``exc`` or an exception in its chain (cause or context) is a ``kind`` (a caller such as vLLM's
    weight loader may wrap what the push raised)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def seconds(s: float) -> dt.timedelta:
    return dt.timedelta(seconds=max(s, 0.001))


def left(deadline: float) -> float:
    return deadline - time.monotonic()


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The sender's store: it never waits for workers, members come and go through epochs."""
    return dist.TCPStore(host, port, None, True, timeout=seconds(timeout_s), wait_for_workers=False)


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A member's client of the sender's store; connecting retries until ``timeout_s`` (then raises)."""
    try:
        return dist.TCPStore(host, port, None, False, timeout=seconds(timeout_s), wait_for_workers=False)
    except Exception as exc:
        raise SyncTimeout(f"could not reach the weight-push store at {host}:{port} within {timeout_s:.1f}s: "
                          f"{exc}") from exc


def store_wait(store: dist.Store, keys: list[str], deadline: float, what: str) -> None:
    """Wait until every key exists, or raise :class:`SyncTimeout` naming ``what``."""
    if not keys:
        return
    remaining = left(deadline)
    if remaining <= 0 and not store.check(keys):
        raise SyncTimeout(f"timed out waiting for {what}")
    try:
        store.wait(keys, seconds(remaining))
    except Exception as exc:
        raise SyncTimeout(f"timed out waiting for {what}") from exc


def push_timeout_s(base_s: float, nbytes: float, receivers: int, min_gbps: float) -> float:
    """How long one push may take: ``base_s`` (handshakes, a slow peer) plus sending ``nbytes`` to each of
    ``receivers`` at ``min_gbps`` GB/s, as a root that sends every receiver its own copy would (gloo's broadcast;
    NCCL's pipelined ring is faster, so this bounds it too). ``min_gbps`` 0: ``base_s`` alone."""
    if min_gbps < 0 or base_s < 0 or nbytes < 0:
        raise ValueError("push_timeout_s takes no negative time, size or rate")
    if min_gbps == 0:
        return base_s
    return base_s + nbytes * max(receivers, 1) / (min_gbps * 1e9)


_RETIRED: list[tuple[dist.ProcessGroup, list[dist.Work]]] = []


def retire(pg: dist.ProcessGroup | None, pending: list[dist.Work]) -> None:
    """Forget a group. One with an abandoned op is kept alive until that op ends by its own timeout:
    its destructor would block until then. Retired groups whose ops have all ended are released here."""
    if pg is not None:
        _RETIRED.append((pg, [w for w in pending if not w.is_completed()]))
    _RETIRED[:] = [(g, ws) for g, ws in _RETIRED if not all(w.is_completed() for w in ws)]


_OWNERS: weakref.WeakSet[Any] = weakref.WeakSet()


def track(owner: Any) -> None:
    """Register a sender or receiver (``_pg`` and ``_works`` attributes) for :func:`_keep_pending_at_exit`."""
    _OWNERS.add(owner)


@atexit.register
def _keep_pending_at_exit() -> None:
    """A group with an op still pending (a member's receives posted for a push that never came, an abandoned
    push) would hold the process's exit until that op times out: gloo joins its worker threads when the group
    is destroyed. Such groups are kept alive for good instead; the exiting process reclaims them."""
    groups = list(_RETIRED) + [(o._pg, o._works) for o in list(_OWNERS) if getattr(o, "_pg", None) is not None]
    for pg, works in groups:
        if not all(w.is_completed() for w in works):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))


def post_broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor, root: int = 0) -> dist.Work:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def int64s(values: list[int]) -> torch.Tensor:
    """A fresh int64 tensor (through numpy: a tenth of ``torch.tensor``'s cost, which shows on a 2 ms push)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def last_first(n: int) -> list[int]:
    """The order to wait for n ops posted together: the last one first, then the others (done by then, as a
    rule). One thread wake-up instead of n: on a busy machine each costs about 0.1 ms."""
    return [n - 1, *range(n - 1)] if n else []


def wait_work(work: dist.Work, deadline: float, what: str, abort: Callable[[], str | None] | None = None,
              slice_s: float = 0.2) -> None:
    """Wait for an async op until ``deadline``; between slices ask ``abort()`` whether to give up.

    A wait that completes in time costs nothing extra (the slice only bounds how long one wait blocks).
    Raises :class:`SyncTimeout`, :class:`Aborted`, or :class:`SyncError` with the backend's own error.
    """
    while True:
        remaining = left(deadline)
        if remaining <= 0:
            raise SyncTimeout(f"timed out waiting for {what}")
        try:
            work.wait(seconds(min(slice_s, remaining)))
            return
        except Exception as exc:  # "Operation timed out!" for a slice, or the op's own failure
            if work.is_completed():
                try:
                    work.wait()
                    return
                except Exception as final:
                    raise SyncError(f"{what} failed: {final}") from final
            if not _is_slice_timeout(exc):
                raise SyncError(f"{what} failed: {exc}") from exc
        if abort is not None:
            reason = abort()
            if reason:
                raise Aborted(f"{what} abandoned: {reason}")


def _is_slice_timeout(exc: Exception) -> bool:
    return "timed out" in str(exc).lower()
