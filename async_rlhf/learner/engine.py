"""DeepSpeed engine construction shared by the offline trainers (one process, world size 1).

The asynchronous learner builds its engines the same way (AdamW wrapped by ``deepspeed.initialize`` with a ZeRO
stage, gradient clipping and the dtype flags); the offline trainers (SFT, reward model, DPO, KTO) use this helper
so that the same code path trains them. Heavy imports (deepspeed, torch) happen inside the functions.
"""

from __future__ import annotations

import os
from typing import Any

from async_rlhf.endpoints import free_port


def init_single_process(backend: str = "gloo") -> None:
    """Start a one-rank default process group (DeepSpeed needs one) unless one already exists."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def ds_config(micro_batch: int, grad_clip: float, zero_stage: int = 0, dtype: str = "float32",
              grad_accum: int = 1, world_size: int = 1) -> dict[str, Any]:
    """The DeepSpeed config dict: batch sizes, clipping, ZeRO stage and dtype flags; no log spam."""
    return {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 10**9,
    }


def build_engine(model: Any, lr: float, micro_batch: int, grad_clip: float = 1.0, weight_decay: float = 0.0,
                 zero_stage: int = 0, dtype: str = "float32", backend: str = "gloo") -> Any:
    """A DeepSpeed engine around ``model`` with AdamW; initializes a one-rank group first if needed.

    The batch sizes only matter to DeepSpeed's bookkeeping: every ``engine.backward(loss)`` +
    ``engine.step()`` is one optimizer step (gradient accumulation 1).
    """
    import deepspeed
    import torch

    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    init_single_process(backend)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=ds_config(micro_batch, grad_clip, zero_stage, dtype))
    return engine
