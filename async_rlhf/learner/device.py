"""The one place that decides where a learner rank computes, and moves what it computes on there.

    Ray assigns GPUs (resources.learner_gpus)  ->  CUDA_VISIBLE_DEVICES holds exactly those  ->  cuda:0
    none assigned                                                                            ->  cpu

The policy engine is moved by DeepSpeed itself (its accelerator, LOCAL_RANK=0: the same device); everything
else a rank feeds it goes through a :class:`Placer`: every tensor of every batch (``place_batch``), the
reference model, the reward models (the critic is a DeepSpeed engine of its own, placed like the policy).

The driver's own evaluation (held-out figures with transformers) is placed here too (:func:`eval_placement`):
the GPU in the model's dtype when there is one with room, the CPU in float32 otherwise.
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


EVAL_HEADROOM = 1.5
"""The driver evaluates on the GPU only if it has this many times the checkpoint's bytes free (activations)."""


def eval_placement(model_dtype: str, model_bytes: int, cuda_available: bool,
                   free_bytes: Any = None) -> tuple[torch.device, torch.dtype]:
    """Where the driver evaluates a policy with transformers (its held-out figures), and in which dtype:
    the first visible GPU in ``model.dtype`` when CUDA is there with room for the model (while the cluster is
    up vLLM may hold most of that GPU), else the CPU in float32 (as always on CPU). ``free_bytes()``: the GPU's
    free memory (default: ``torch.cuda.mem_get_info``)."""
    if cuda_available:
        free = free_bytes() if free_bytes is not None else torch.cuda.mem_get_info(0)[0]
        if free >= EVAL_HEADROOM * model_bytes:
            return torch.device("cuda", 0), getattr(torch, model_dtype)
    return torch.device("cpu"), torch.float32


def load_eval_model(model_dir: str, model_dtype: str, cuda_available: bool | None = None,
                    free_bytes: Any = None, from_pretrained: Any = None) -> Any:
    """A Hugging Face causal LM from ``model_dir``, in eval mode where :func:`eval_placement` puts it."""
    from pathlib import Path

    if from_pretrained is None:
        from transformers import AutoModelForCausalLM

        from_pretrained = AutoModelForCausalLM.from_pretrained
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) or sum(
        f.stat().st_size for f in Path(model_dir).glob("*.bin"))
    device, dtype = eval_placement(model_dtype, size, cuda_available, free_bytes)
    return from_pretrained(model_dir, dtype=dtype).to(device).eval()
