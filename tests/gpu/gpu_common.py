"""Shared by the GPU tests (``make test-gpu``): the skip rule, the GPU timeouts and a reference forward (the
vLLM engine process is tests/vllm_engine.py's). Nothing here has run yet: no GPU exists where this was written."""

from __future__ import annotations

import pytest
import torch
import vllm_engine
from vllm_engine import HOST, max_diff  # noqa: F401  (the GPU tests import them from here)

ENGINE_START_S = 600.0
TIMEOUT_S = 120.0
ENGINE = {"timeout_s": TIMEOUT_S, "start_s": ENGINE_START_S, "receiver_args": (1,)}
"""The GPU tests' engine_process settings: longer waits, one receive slot (no second copy on the GPU)."""


def engine_process(model_dir: str, port: int, layout: list, engine: dict, cmds, out) -> None:
    """tests/vllm_engine.py's engine process with the GPU tests' settings (a spawn target)."""
    vllm_engine.engine_process(model_dir, port, layout, engine, cmds, out, **ENGINE)


def expect(out, kind: str, timeout_s: float = TIMEOUT_S):
    return vllm_engine.expect(out, kind, timeout_s)


def need_gpus(n: int) -> None:
    """Skip, with the reason, unless CUDA shows at least ``n`` devices."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"needs {n} CUDA device(s), this machine has {have}: run `make test-gpu` on a GPU machine")


@torch.no_grad()
def logprobs(model, seqs: list[list[int]]) -> list[list[float]]:
    """The model's log-prob of every token after the first (on the model's device)."""
    ids = torch.tensor(seqs, device=next(model.parameters()).device)
    logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).tolist()
