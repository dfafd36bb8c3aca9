"""The one place that decides where a learner rank computes, and moves what it computes on there.

    Ray assigns GPUs (resources.learner_gpus)  ->  CUDA_VISIBLE_DEVICES holds exactly those  ->  cuda:0
    none assigned                                                                            ->  cpu

The policy engine is moved by DeepSpeed itself (its accelerator, LOCAL_RANK=0: the same device); everything
else a rank feeds it goes through a :class:`Placer`: every tensor of every batch (``place_batch``), the
reference model, the reward models (the critic is a DeepSpeed engine of its own, placed like the policy).

The driver's own evaluation (held-out figures with transformers) is placed by ``async_rlhf.eval_model``, which
the generator may import too (nothing under ``learner/`` is imported by the generator).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def pick_device(gpu_ids: list[Any], cuda_available: bool) -> torch.device:
    """The device of a rank given the GPUs Ray assigned it (``ray.get_gpu_ids()``; fractional shares list
    their GPU too): the first of them, which is ``cuda:0`` inside the actor, or CPU when none."""
    if not gpu_ids:
        return torch.device("cpu")
    if not cuda_available:
        raise RuntimeError(f"Ray assigned GPU(s) {list(gpu_ids)} to this learner but torch sees no CUDA device: "
                           "install the gpu extra (CUDA torch) or set resources.learner_gpus=0")
    return torch.device("cuda", 0)


def rank_device() -> torch.device:
    """This Ray actor's device (see :func:`pick_device`); CPU outside Ray."""
    import ray

    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    return pick_device(gpu_ids, torch.cuda.is_available())


class Placer:
    """Moves tensors and modules to one device; every input of a learner rank goes through one."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def module(self, m: T) -> T:
        return m.to(self.device)  # type: ignore[attr-defined]

    def batch(self, batch: T) -> T:
        """A copy of a dataclass batch with every tensor field on the device (fields added later included)."""
        moved = {f.name: self.tensor(v) for f in dataclasses.fields(batch)  # type: ignore[arg-type]
                 if isinstance(v := getattr(batch, f.name), torch.Tensor)}
        return dataclasses.replace(batch, **moved)  # type: ignore[type-var]
