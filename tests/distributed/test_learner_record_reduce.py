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


def _two_ranks(target) -> dict:
    """Run ``target(rank, port, out)`` in two spawned processes forming one gloo group; ``{rank: what it put}``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            stop_process(p)


def test_records_are_reduced_across_ranks() -> None:
    got = _two_ranks(_rank)
    assert got[0] == got[1], "every rank ends with the same record"
    rec = got[0]
    assert rec["rollout/samples"] == 128 and rec["rollout/tokens"] == 201
    assert rec["rollout/reward_mean"] == pytest.approx(0.5) and rec["staleness/mean"] == pytest.approx(0.5)
    assert rec["staleness/max"] == 3 and rec["optim/loss"] == pytest.approx(2.0)
    assert rec["learner_ranks"] == 2 and rec["step"] == 7


def _agreement_rank(rank: int, port: int, out: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist

    from async_rlhf.learner.agreement import Agreement
    from async_rlhf.learner.ranks import max_tensor_over_ranks, sum_over_ranks

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a = Agreement(2)  # rank 0: 3 same-version tokens off by 0.1 each; rank 1: one off by 2.0, one of version 1
    if rank == 0:
        logp, behav = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.1, -0.9, -1.1]])
        versions, mask = torch.tensor([[2, 2, 2]]), torch.ones(1, 3)
    else:
        logp, behav = torch.tensor([[-1.0, 0.0], [-1.0, 0.0]]), torch.tensor([[-3.0, 0.0], [-1.0, 0.0]])
        versions, mask = torch.tensor([[2, 0], [1, 0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    a.observe(logp, behav, versions, mask)
    a.observe_sampled(behav, mask)
    a.reduce(sum_over_ranks, max_tensor_over_ranks)
    out.put((rank, a.metrics()))
    dist.destroy_process_group()


def test_the_agreement_monitor_is_token_weighted_over_ranks() -> None:
    got = _two_ranks(_agreement_rank)
    assert got[0] == got[1], "every rank ends with the same figures"
    m = got[0]
    assert m["rollout/same_version_tokens"] == 4
    assert m["rollout/logp_mismatch_mean"] == pytest.approx((0.3 + 2.0) / 4)  # not (0.1 + 2.0) / 2
    assert m["rollout/logp_mismatch_max"] == pytest.approx(2.0)
    assert m["rollout/sampled_logp_mean"] == pytest.approx((-3.1 - 3.0 - 1.0) / 5)
