"""Where a policy is evaluated with transformers (the driver's held-out figures, a generator's evaluation
requests), and loading it there: the GPU in the model's dtype when there is one with room, the CPU in float32
otherwise.

It lives outside ``learner/`` and ``generator/`` because both fleets' code uses it, and the generator imports
nothing of the learner's package (the two fleets touch only through the buffer and the weight push).
"""

from __future__ import annotations

from typing import Any

import torch

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
