"""A digest of a model's weights, independent of how it is wrapped: the same for a Hugging Face model and for
that model under a LoRA wrapper with its adapters left out (``summary.json``'s ``reference_sha256``)."""

from __future__ import annotations

import hashlib
from typing import Any


def weights_sha256(module: Any) -> str:
    """sha256 over every parameter that is not a LoRA adapter, in module order (tied ones once): dtype, shape,
    bytes. One tensor at a time on the host, never a second copy of the model."""
    import torch

    h = hashlib.sha256()
    for name, t in module.named_parameters():
        if "lora_" in name:
            continue  # the adapters are trained; the reference is the base under them
        data = t.detach().to("cpu").contiguous()
        h.update(f"{data.dtype}:{tuple(data.shape)};".encode())
        if data.numel():
            h.update(data.view(torch.uint8).numpy())
    return h.hexdigest()
