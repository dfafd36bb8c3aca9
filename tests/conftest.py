"""Shared fixtures: a tiny causal LM built locally (no hub), cached for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 policy with random weights (tests that need competence build their own)."""
    import torch

    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def stop_process(proc, grace_s: float = 5.0) -> None:
    """Join a child process; terminate, then kill it if it outlives ``grace_s`` at each stage."""
    proc.join(timeout=grace_s)
    for end in (proc.terminate, proc.kill):
        if not proc.is_alive():
            return
        end()
        proc.join(timeout=grace_s)
