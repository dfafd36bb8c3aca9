"""A bounded rendezvous for a push group whose backend would wait forever for a member that never comes.

``ncclCommInitRank`` (inside vLLM's PyNcclCommunicator) has no timeout: one member that never calls it
keeps every other rank in it for good. So the NCCL transport opens a group in two bounded steps::

    every rank r:  set arrived/<r> on the epoch's store
                   wait until arrived/0 .. arrived/<world-1> all exist  (deadline: sync.timeout_s)
                     missing at the deadline -> RendezvousTimeout naming them (the sender drops them: PushError)
                   build the communicator on a helper thread, joined with the same deadline
                     (a member that died between the two steps) -> RendezvousTimeout; the helper thread stays
                     blocked in NCCL, and under NCCL the run stops with that error (see transport.py)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from async_rlhf.sync.group import SyncTimeout, left, store_wait

T = TypeVar("T")


class RendezvousTimeout(SyncTimeout):
    """Ranks of a push group did not all arrive in time; ``ranks`` are the missing ones (when known)."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


def arrived_key(rank: int) -> str:
    return f"arrived/{rank}"


def rank_name(rank: int, names: Sequence[str] | None) -> str:
    if names is not None and rank < len(names):
        return f"{names[rank]} (rank {rank})"
    return f"rank {rank}"


def arrival_barrier(store: Any, rank: int, world: int, deadline: float, names: Sequence[str] | None = None) -> None:
    """Announce ``rank`` on the store and wait until every rank of ``world`` did; at ``deadline`` raise
    :class:`RendezvousTimeout` naming the ranks (and ``names[rank]``) that never arrived."""
    store.set(arrived_key(rank), "1")
    keys = [arrived_key(r) for r in range(world)]
    try:
        store_wait(store, keys, deadline, "every member of the push group")
    except SyncTimeout:
        missing = [r for r in range(world) if not store.check([arrived_key(r)])]
        if not missing:  # they all came at the last moment
            return
        who = ", ".join(rank_name(r, names) for r in missing)
        raise RendezvousTimeout(f"the push group did not form: {who} never joined its rendezvous (rank {rank} "
                                f"waited until its deadline: sync.timeout_s)", missing) from None


def call_by(fn: Callable[[], T], deadline: float, what: str) -> T:
    """``fn()`` on a helper thread, its result or its exception; :class:`RendezvousTimeout` if it is still
    running at ``deadline`` (the thread is left behind: a call blocked in a native library cannot be cancelled)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    th = threading.Thread(target=run, name="push-rendezvous", daemon=True)
    th.start()
    th.join(max(left(deadline), 0.0))
    if th.is_alive():
        raise RendezvousTimeout(f"{what} did not finish by its deadline (sync.timeout_s): a member that passed "
                                "the arrival check stopped before joining; the push group cannot form")
    if "error" in box:
        raise box["error"]
    return box["value"]
