"""The weight-push process group: {learner rank 0, every generator worker}, on its own TCPStore.

    rank 0            rank 1          rank 2                rank N
    learner rank 0    generator 0     generator 1    ...    generator N-1
    (sender, hosts    (receiver, inside its vLLM worker)
     the TCPStore)

It is apart from the learners' default group, so a generator that dies never touches the data-parallel
collectives of the learners. Every wait on it is bounded by ``timeout_s``.
"""

from __future__ import annotations

import datetime as dt
import socket

import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_group(host: str, port: int, world_size: int, rank: int, backend: str = "gloo",
               timeout_s: float = 120.0) -> dist.ProcessGroup:
    timeout = dt.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=True)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValueError(f"sync.backend={backend!r}: use gloo (CPU) or nccl (GPU)")


def broadcast(pg: dist.ProcessGroup, tensor, root: int, timeout_s: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait(dt.timedelta(seconds=timeout_s))


def allreduce_sum(pg: dist.ProcessGroup, tensor, timeout_s: float) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce([tensor], opts).wait(dt.timedelta(seconds=timeout_s))
