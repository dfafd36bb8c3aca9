"""A raw broadcast of a push's bytes to the push's members: the wire alone, what a push is measured against.

    learner rank 0 (rank 0, hosts the store)          every member: a generator's worker (rank 1..N)
    one group on the push's own store and transport, under the prefix raw/<tag>/ (apart from the push's epochs:
    members keep their receives for the next push posted on the push group, where a raw broadcast would land)
    per repetition r (the first is a warm-up, not returned):
                                                      post the receive of the broadcast, then set ready/<r>/<rank>
    wait until every member is ready (then ``idle_s`` more, as a push waits after the last one)
    t0 -> broadcast(nbytes) -> wait -> allreduce(int64[1]) -> wait -> seconds        wait for both
                                                      (the allreduce: "every member has it", as the push's ack)

This is bench/weight_sync.py's ``raw_s`` (receivers posted before the sender starts, as a generator's receives
are for the next push) on the run's own processes, nodes and interfaces: bench/scale.py compares it with the
run's pushes (``sync/push_s``). The transport is the push's (gloo here); the tensors come from it.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from async_rlhf.sync.group import store_wait
from async_rlhf.sync.transport import Transport


def _prefix(tag: str) -> str:
    if not tag or "/" in tag:
        raise ValueError(f"a raw broadcast's tag is one non-empty path segment, got {tag!r}")
    return f"raw/{tag}/"


def _ready(r: int, rank: int) -> str:
    return f"ready/{r}/{rank}"


def raw_send(store: Any, transport: Transport, nbytes: int, world: int, tag: str, reps: int,
             timeout_s: float, idle_s: float = 0.0) -> list[float]:
    """Rank 0: ``reps`` timed broadcasts of ``nbytes`` (after one warm-up) to the ``world - 1`` members that call
    :func:`raw_receive` with the same ``tag``; returns the seconds of each (broadcast plus the 1-element allreduce).

    ``idle_s``: each broadcast starts that long after the last member posted its receive, not at once, as a push
    measured on an idle fleet starts a while after the members posted (bench/scale.py's quiet pushes: 0.2 s)."""
    if idle_s < 0:
        raise ValueError(f"idle_s must be >= 0, got {idle_s}")
    if world < 2 or reps < 1 or nbytes < 1:
        raise ValueError(f"a raw broadcast needs a member, a repetition and a byte: world={world}, reps={reps}, "
                         f"nbytes={nbytes}")
    deadline = time.monotonic() + timeout_s
    prefixed = dist.PrefixStore(_prefix(tag), store)
    names = ["the sender", *(f"member rank {r}" for r in range(1, world))]
    group = transport.open(prefixed, 0, world, timeout_s, names)
    data = transport.empty(nbytes)
    data.fill_(1)  # its pages touched before any measurement
    seconds = []
    for r in range(reps + 1):
        store_wait(prefixed, [_ready(r, rank) for rank in range(1, world)], deadline, f"raw broadcast {r}'s members")
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        transport.wait(transport.broadcast(group, data), deadline, f"raw broadcast {r}")
        transport.wait(transport.allreduce(group, transport.int64s([0])), deadline, f"raw broadcast {r}'s allreduce")
        seconds.append(time.perf_counter() - t0)
    transport.retire(group, [])
    return seconds[1:]


def raw_receive(store: Any, transport: Transport, rank: int, world: int, nbytes: int, tag: str, reps: int,
                timeout_s: float) -> None:
    """Member ``rank`` (1..world-1) of :func:`raw_send`'s group: each repetition's receive is posted before this
    member says it is ready, so the sender times the transfer, not how soon a member posts."""
    if not 1 <= rank < world:
        raise ValueError(f"a member's rank is 1..{world - 1}, got {rank}")
    deadline = time.monotonic() + timeout_s
    prefixed = dist.PrefixStore(_prefix(tag), store)
    group = transport.open(prefixed, rank, world, timeout_s)
    data = transport.empty(nbytes)
    data.fill_(0)
    for r in range(reps + 1):
        work = transport.broadcast(group, data)
        prefixed.set(_ready(r, rank), "1")
        transport.wait(work, deadline, f"raw broadcast {r}")
        transport.wait(transport.allreduce(group, transport.int64s([0])), deadline, f"raw broadcast {r}'s allreduce")
    transport.retire(group, [])
