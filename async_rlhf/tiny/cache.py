"""Where the tiny policy's cache keeps a build, and what names it: importable without torch or transformers.

Every launch without ``--model`` (the demo, a job under ``ray job submit``) asks :func:`cached_policy` first; only
a miss imports ``async_rlhf.tiny.sft`` to build. Looking the policy up through the builder's module cost 8 CPU-s
of imports on 2 cores, before the driver had started Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from async_rlhf.config import TaskConfig

HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 512
MAX_POSITIONS = 64
"""The tiny Qwen2's architecture (``async_rlhf.tiny.model.tiny_config``)."""

FORMAT_VERSION = 1
"""Bump when the model, tokenizer, task format or SFT recipe changes: it invalidates cached warm starts."""
SFT_BATCH_SIZE = 64
SFT_LR = 2e-3
INFO_FILE = "tiny_info.json"
"""Written last into a finished build: a directory holding it is complete."""


def tiny_settings(task_cfg: TaskConfig, seed: int = 0) -> dict[str, Any]:
    """Everything the cached warm start depends on; its hash names the cache directory."""
    return {
        "format_version": FORMAT_VERSION,
        "task": task_cfg.name,
        "digits": task_cfg.digits,
        "heldout_size": task_cfg.heldout_size,
        "sft_steps": task_cfg.sft_steps,
        "sft_batch_size": SFT_BATCH_SIZE,
        "sft_lr": SFT_LR,
        "sft_forget_carry": float(task_cfg.sft_forget_carry),
        "sft_clean_share": float(task_cfg.sft_clean_share),
        "seed": seed,
        "arch": [HIDDEN_SIZE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE_SIZE, MAX_POSITIONS],
    }


def policy_dir(cache_root: Path, task_cfg: TaskConfig, seed: int = 0) -> Path:
    """``cache_root/tiny-<hash of tiny_settings>``: where the policy of these settings is (or will be) built."""
    settings = tiny_settings(task_cfg, seed)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_root) / f"tiny-{digest}"


def cached_policy(cache_root: Path, task_cfg: TaskConfig, seed: int = 0) -> Path | None:
    """The finished build of these settings, or None (``async_rlhf.tiny.sft.prepare_tiny_policy`` builds it)."""
    final = policy_dir(cache_root, task_cfg, seed)
    return final if (final / INFO_FILE).exists() else None


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock, so concurrent callers (e.g. several actors on one host) build once."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic rename alone keeps the cache consistent
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
