"""A step's record describes the whole step when several learner ranks train it: counts summed, means averaged,
maxima over ranks (a real two-process gloo group)."""

import os

import pytest
import torch.multiprocessing as mp
from conftest import stop_process

from async_rlhf.sync.group import free_port

pytestmark = pytest.mark.distributed


def _rank(rank: int, port: int, out: "mp.Queue") -> None:
    import torch.distributed as dist

    from async_rlhf.learner.ranks import reduce_across_ranks

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    record = {"rollout/samples": 64, "rollout/tokens": 100 + rank, "rollout/reward_mean": 0.25 + 0.5 * rank,
              "staleness/mean": 1.0 * rank, "staleness/max": 3 * rank, "optim/loss": 2.0, "step": 7}
    reduce_across_ranks(record)
    out.put((rank, record))
    dist.destroy_process_group()


def test_records_are_reduced_across_ranks() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            stop_process(p)
    assert got[0] == got[1], "every rank ends with the same record"
    rec = got[0]
    assert rec["rollout/samples"] == 128 and rec["rollout/tokens"] == 201
    assert rec["rollout/reward_mean"] == pytest.approx(0.5) and rec["staleness/mean"] == pytest.approx(0.5)
    assert rec["staleness/max"] == 3 and rec["optim/loss"] == pytest.approx(2.0)
    assert rec["learner_ranks"] == 2 and rec["step"] == 7
