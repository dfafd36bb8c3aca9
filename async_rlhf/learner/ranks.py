"""Small collectives over the learner ranks (the default process group: gloo on CPU, NCCL with
``learner.backend=nccl``): a step's record made to describe the whole step, counts summed, a maximum taken. Each
is collective: every rank calls it, in order. The tensors go where the group's backend takes them (NCCL refuses
CPU tensors) and come back to the CPU."""

from __future__ import annotations

from typing import Any


def group_device() -> Any:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

SUMMED = ("rollout/samples", "rollout/tokens", "rollout/observation_tokens", "buffer/lease_lost")
AVERAGED = ("rollout/reward_mean", "staleness/mean", "optim/loss", "rollout/task_reward_mean", "rollout/rm_score_mean")
MAXED = ("staleness/max",)


def reduce_across_ranks(record: dict[str, Any], agreement: Any = None) -> None:
    """Make a step's record describe the whole step, not one rank's share: counts summed, means averaged
    (every rank trains the same number of groups), maxima taken over ranks; in place, collective on every
    rank of the learners' default group. ``agreement`` (the step's training/inference agreement monitor,
    learner/agreement.py): its sums and maxima are combined in the same collective.

    One collective for all of it (an all-gather of every rank's values, summed and maximised here): at 16 + 16 on
    2 cores each small collective of the learners' group took 30-80 ms, and a step made four of them."""
    import torch.distributed as dist

    world = dist.get_world_size()
    keys = [k for k in SUMMED + AVERAGED if k in record]
    part_sums, part_max = agreement.partials() if agreement is not None else ([], [])
    sums, maxima = sum_and_max_over_ranks([float(record[k]) for k in keys] + part_sums,
                                          [float(record.get(k, 0)) for k in MAXED] + part_max)
    for k, v in zip(keys, sums):
        record[k] = int(v) if k in SUMMED else v / world
    record.update({k: int(v) for k, v in zip(MAXED, maxima)})
    if agreement is not None:
        agreement.take_reduced(sums[len(keys):], maxima[len(MAXED):])
    record["learner_ranks"] = world


def sum_and_max_over_ranks(sums: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
    """``sums`` summed and ``maxima`` maximised element-wise over the learner ranks, in one all-gather."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(sums + maxima, dtype=torch.float64, device=group_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu()
    n = len(sums)
    return table[:, :n].sum(dim=0).tolist(), table[:, n:].max(dim=0).values.tolist() if maxima else []


def sum_over_ranks(counts: Any) -> None:
    """Sum a small CPU tensor over the learner ranks, in place."""
    _all_reduce_in_place(counts, "SUM")


def max_tensor_over_ranks(values: Any) -> None:
    """Element-wise maximum of a small CPU tensor over the learner ranks, in place."""
    _all_reduce_in_place(values, "MAX")


def _all_reduce_in_place(t: Any, op: str) -> None:
    import torch.distributed as dist

    on_group = t.to(group_device())
    dist.all_reduce(on_group, op=getattr(dist.ReduceOp, op))
    if on_group is not t:
        t.copy_(on_group)


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of any learner rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=group_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
