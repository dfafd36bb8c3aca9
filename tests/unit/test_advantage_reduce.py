"""Batch-level advantage statistics over the whole step (issue 31, defect 5): REINFORCE++ normalisation and PPO's
whitening take an optional reducer (a sum over the learner ranks); the same function run on two halves of a
batch, joined by an in-process stand-in for that sum (two threads), gives exactly what it gives on the whole."""

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from async_rlhf.learner.advantages import batch_moments, group_advantages
from async_rlhf.learner.batch import collate
from async_rlhf.learner.ppo import whiten
from async_rlhf.types import Group, Sample


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The "ranks" below are threads: one torch thread each (restored after, for the tests that follow)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def on_ranks(calls: list[Callable[[Callable[[torch.Tensor], None]], Any]]) -> list[Any]:
    """Run ``calls[r](reduce)`` for every "rank" r on its own thread, where ``reduce`` sums a tensor over all of
    them in place (each call's n-th reduce meets the others' n-th, as an all-reduce does)."""
    n = len(calls)
    barrier = threading.Barrier(n, timeout=10)
    slots: list[torch.Tensor | None] = [None] * n
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def reducer(rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(t: torch.Tensor) -> None:
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots[1:], slots[0].clone())  # the same order on every rank
            barrier.wait()
            t.copy_(total)

        return reduce

    def run(rank: int) -> None:
        try:
            results[rank] = calls[rank](reducer(rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


REWARDS = torch.tensor([[0.1, 0.0, 0.2], [0.0, 0.3, 0.1], [2.0, -1.0, 0.5], [-2.0, 1.5, 3.0], [1.0, 1.0, 1.0]])


def test_reinforce_pp_on_two_halves_with_a_reducer_equals_the_whole():
    whole = group_advantages(REWARDS, "reinforce_pp")
    halves = on_ranks([lambda reduce: group_advantages(REWARDS[:2], "reinforce_pp", reduce=reduce),
                       lambda reduce: group_advantages(REWARDS[2:], "reinforce_pp", reduce=reduce)])
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-6, atol=1e-7)
    assert whole[4].abs().max() == 0  # a tie stays exactly 0
    alone = torch.cat([group_advantages(REWARDS[:2], "reinforce_pp"), group_advantages(REWARDS[2:], "reinforce_pp")])
    assert (alone - whole).abs().max() > 0.5  # each half's own statistics are far from the step's


def test_group_estimators_never_reduce():
    """Per-group estimators need nothing from the other ranks: no reducer call (no collective) at all."""
    def refuse(t: torch.Tensor) -> None:
        raise AssertionError("reduced")

    for estimator in ("grpo", "dr_grpo", "rloo"):
        torch.testing.assert_close(group_advantages(REWARDS, estimator, reduce=refuse),
                                   group_advantages(REWARDS, estimator))


def test_whiten_on_two_halves_with_a_reducer_equals_the_whole():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=gen) * 3 + 1
    x[:3] *= 0.1  # the halves' spreads differ
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    x[mask == 0] = float("nan")  # never read
    whole = whiten(x, mask)
    halves = on_ranks([lambda reduce: whiten(x[:3], mask[:3], reduce=reduce),
                       lambda reduce: whiten(x[3:], mask[3:], reduce=reduce)])
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(whole).all() and (whole[mask == 0] == 0).all()
    alone = torch.cat([whiten(x[:3], mask[:3]), whiten(x[3:], mask[3:])])
    assert (alone - whole).abs().max() > 0.5


def test_batch_moments_weighted_and_empty():
    mean, var = batch_moments(torch.tensor([[1.0, 2.0, 3.0, float("inf")]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert (mean.item(), var.item()) == pytest.approx((2.0, 2 / 3))
    assert [v.item() for v in batch_moments(torch.ones(2, 2), torch.zeros(2, 2))] == [0.0, 0.0]


def _groups() -> list[Group]:
    rng = np.random.default_rng(1)
    out = []
    for gi, rs in enumerate(REWARDS.tolist()):
        samples = [Sample(rng.integers(4, 50, 3).astype(np.int32), -rng.random(3).astype(np.float32),
                          np.zeros(3, np.int32), r) for r in rs]
        out.append(Group(f"g{gi}", rng.integers(4, 50, 2).astype(np.int32), samples))
    return out


def test_collate_passes_the_reducer_to_reinforce_pp():
    groups = _groups()
    whole = collate(groups, 0, "reinforce_pp").advantages
    halves = on_ranks([lambda reduce: collate(groups[:2], 0, "reinforce_pp", reduce).advantages,
                       lambda reduce: collate(groups[2:], 0, "reinforce_pp", reduce).advantages])
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-6, atol=1e-7)
