"""Where a run's checkpoints live on disk: shared by the learners that write a checkpoint into its staging
directory and the driver that commits it (manifest, rename, prune: :mod:`async_rlhf.driver.checkpoints`)."""

from __future__ import annotations

from pathlib import Path

MANIFEST = "checkpoint.json"
FORMAT = 1
PREFIX = "step-"
STAGING = ".staging-"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:06d}"


def staging_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{STAGING}{checkpoint_name(step)}"


def run_dir_of(ckpt: Path) -> Path:
    """The run directory a checkpoint belongs to (``run/checkpoints/step-N`` -> ``run``)."""
    return ckpt.resolve().parent.parent
