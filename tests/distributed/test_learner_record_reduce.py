"""A step's record describes the whole step when several learner ranks train it: counts summed, means averaged,
maxima over ranks (a real two-process gloo group). Both scenarios run in one pair of rank processes, one after
the other in the same group (a module-scoped fixture): each builds its own inputs and reduces them with its own
collectives, so neither reads what the other left behind."""

import os

import pytest
import torch.multiprocessing as mp
from conftest import stop_process

from async_rlhf.sync.group import free_port

pytestmark = pytest.mark.distributed


def _record(rank: int) -> dict:
    from async_rlhf.learner.ranks import reduce_across_ranks

    record = {"rollout/samples": 64, "rollout/tokens": 100 + rank, "rollout/reward_mean": 0.25 + 0.5 * rank,
              "staleness/mean": 1.0 * rank, "staleness/max": 3 * rank, "optim/loss": 2.0, "step": 7}
    reduce_across_ranks(record)
    return record


def test_records_are_reduced_across_ranks(reduced) -> None:
    got = reduced("record")
    assert got[0] == got[1], "every rank ends with the same record"
    rec = got[0]
    assert rec["rollout/samples"] == 128 and rec["rollout/tokens"] == 201
    assert rec["rollout/reward_mean"] == pytest.approx(0.5) and rec["staleness/mean"] == pytest.approx(0.5)
    assert rec["staleness/max"] == 3 and rec["optim/loss"] == pytest.approx(2.0)
    assert rec["learner_ranks"] == 2 and rec["step"] == 7


def _observed(rank: int):
    import torch

    from async_rlhf.learner.agreement import Agreement

    a = Agreement(2)  # rank 0: 3 same-version tokens off by 0.1 each; rank 1: one off by 2.0, one of version 1
    if rank == 0:
        logp, behav = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.1, -0.9, -1.1]])
        versions, mask = torch.tensor([[2, 2, 2]]), torch.ones(1, 3)
    else:
        logp, behav = torch.tensor([[-1.0, 0.0], [-1.0, 0.0]]), torch.tensor([[-3.0, 0.0], [-1.0, 0.0]])
        versions, mask = torch.tensor([[2, 0], [1, 0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    a.observe(logp, behav, versions, mask)
    a.observe_sampled(behav, mask)
    return a


def _agreement(rank: int) -> dict:
    from async_rlhf.learner.ranks import max_tensor_over_ranks, sum_over_ranks

    a = _observed(rank)
    a.reduce(sum_over_ranks, max_tensor_over_ranks)
    return a.metrics()


def _together(rank: int) -> dict:
    """The learner's step: the record and the agreement monitor reduced in one collective."""
    from async_rlhf.learner.ranks import reduce_across_ranks

    record = {"rollout/samples": 64, "rollout/tokens": 100 + rank, "rollout/reward_mean": 0.25 + 0.5 * rank,
              "staleness/mean": 1.0 * rank, "staleness/max": 3 * rank, "optim/loss": 2.0, "step": 7}
    a = _observed(rank)
    reduce_across_ranks(record, a)
    return {**record, **a.metrics()}


SCENARIOS = {"record": _record, "agreement": _agreement, "together": _together}


def _rank(rank: int, port: int, out: "mp.Queue") -> None:
    """One rank of the pair: every scenario in turn on the same group; each one's result or error, by name."""
    import traceback

    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for name, scenario in SCENARIOS.items():
        try:
            out.put((name, rank, scenario(rank)))
        except Exception:
            out.put((name, rank, traceback.format_exc()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reduced():
    """``reduced(name)``: ``{rank: result}`` of scenario ``name``, run by one pair of processes for the module."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, object]] = {name: {} for name in SCENARIOS}

    def result(name: str) -> dict:
        while len(got[name]) < len(procs):
            scenario, rank, res = out.get(timeout=120)
            got[scenario][rank] = res
        for rank, res in got[name].items():
            assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
        return got[name]

    try:
        yield result
    finally:
        for p in procs:
            stop_process(p)


def test_the_agreement_monitor_is_token_weighted_over_ranks(reduced) -> None:
    got = reduced("agreement")
    assert got[0] == got[1], "every rank ends with the same figures"
    m = got[0]
    assert m["rollout/same_version_tokens"] == 4
    assert m["rollout/logp_mismatch_mean"] == pytest.approx((0.3 + 2.0) / 4)  # not (0.1 + 2.0) / 2
    assert m["rollout/logp_mismatch_max"] == pytest.approx(2.0)
    assert m["rollout/sampled_logp_mean"] == pytest.approx((-3.1 - 3.0 - 1.0) / 5)


def test_record_and_agreement_reduced_in_one_collective_read_as_each_alone(reduced) -> None:
    together = reduced("together")
    assert together[0] == together[1]
    alone = {**reduced("record")[0], **reduced("agreement")[0]}
    assert together[0].keys() == alone.keys()
    for k, v in alone.items():
        assert together[0][k] == pytest.approx(v), k
