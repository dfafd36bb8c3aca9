"""Checkpoints on disk: atomic (staged elsewhere, then renamed), the last N kept, resumable by path.

    run_dir/checkpoints/
      .staging-step-000040/     the learners write here (DeepSpeed state, HF policy) ...
      step-000040/              ... and the driver renames it once checkpoint.json is written
        checkpoint.json         step, version, data position per generator, metrics index
        deepspeed/state/...     model + optimizer of every rank (DeepSpeed save_checkpoint)
        policy/                 the policy as a Hugging Face model directory

A directory without ``checkpoint.json`` is never a checkpoint, so a crash while staging leaves nothing a
resume could pick up by mistake. No torch or ray import here.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from async_rlhf.checkpoint_layout import (
    FORMAT,
    MANIFEST,
    PREFIX,
    STAGING,
    checkpoint_name,
    checkpoints_dir,
    run_dir_of,
    staging_dir,
)
from async_rlhf.config import ConfigError
from async_rlhf.driver.run_lock import LOCK_NAME


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Committed checkpoints of a run, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def commit(run_dir: str | Path, step: int, manifest: dict[str, Any], keep: int) -> Path:
    """Write the manifest into the staged directory, rename it into place, delete all but the last ``keep``."""
    staged = staging_dir(run_dir, step)
    if not staged.is_dir():
        raise FileNotFoundError(f"no staged checkpoint at {staged}; the learners write it first")
    body = {"format": FORMAT, "step": step, "time": time.time(), **manifest}
    tmp = staged / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True))
    with tmp.open("rb") as fh:
        os.fsync(fh.fileno())
    tmp.rename(staged / MANIFEST)
    final = checkpoints_dir(run_dir) / checkpoint_name(step)
    if final.exists():  # the same step written again (a resumed run re-reaching it): replace it
        shutil.rmtree(final)
    staged.rename(final)
    prune(run_dir, keep)
    return final


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints, and stale staging directories."""
    done = list_checkpoints(run_dir)
    gone = done[:-keep] if keep > 0 else []
    newest = int(done[-1].name[len(PREFIX):]) if done else -1
    for p in checkpoints_dir(run_dir).glob(f"{STAGING}{PREFIX}*"):
        if int(p.name[len(STAGING) + len(PREFIX):]) <= newest:
            gone.append(p)  # a staging left by a crash, older than what is committed
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def check_run_dir(run_dir: str | Path, resume: bool, overwrite: bool) -> None:
    """Refuse a ``run.dir`` that already holds something, unless ``--resume`` continues the run there or
    ``run.overwrite`` starts afresh in a previous run's directory (one with its ``config.json``): a new run
    must not append to another run's metrics or mix its checkpoints with them."""
    p = Path(run_dir)
    if resume or not p.exists():
        return
    if not p.is_dir():
        raise ConfigError(f"run.dir {p} is a file; give a new or empty directory (--run-dir)")
    if not any(child.name != LOCK_NAME for child in p.iterdir()):  # (a driver's lock: run_lock.py)
        return
    if not (p / "config.json").is_file():
        raise ConfigError(f"run.dir {p} is not empty and holds no previous run (no config.json); give a new or "
                          "empty directory (--run-dir)")
    if not overwrite:
        raise ConfigError(f"run.dir {p} holds a previous run; continue it with --resume {p}, start afresh there "
                          "with run.overwrite=true (deletes it), or give a new --run-dir")


def clear_run_dir(run_dir: str | Path) -> None:
    """``run.overwrite``: delete what a previous run left in ``run_dir`` (checked by :func:`check_run_dir`)."""
    p = Path(run_dir)
    if not (p / "config.json").is_file():
        return
    for child in p.iterdir():
        if child.name == LOCK_NAME:  # held by this driver (run_lock.py): deleting it would free the directory
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def set_aside_newer(ckpt: str | Path) -> list[Path]:
    """A resume from a checkpoint older than the run's newest (a rollback): move the newer committed checkpoints,
    an abandoned branch, into ``checkpoints/abandoned-<time>/`` (nothing is deleted). Afterwards the newest
    checkpoint is the one resumed from, so ``--resume RUN_DIR``, the failure hint and pruning follow the branch
    that trains now. Returns the moved directories (at their new place)."""
    ckpt = Path(ckpt).resolve()
    run_dir = run_dir_of(ckpt)
    step = int(ckpt.name[len(PREFIX):])
    newer = [p for p in list_checkpoints(run_dir) if int(p.name[len(PREFIX):]) > step]
    if not newer:
        return []
    aside = checkpoints_dir(run_dir) / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}-from-{checkpoint_name(step)}"
    aside.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in newer:
        p.rename(aside / p.name)
        moved.append(aside / p.name)
    return moved


def read_manifest(ckpt: str | Path) -> dict[str, Any]:
    data = json.loads((Path(ckpt) / MANIFEST).read_text())
    if data.get("format") != FORMAT:
        raise ConfigError(f"--resume {ckpt}: checkpoint format {data.get('format')!r}, this version reads {FORMAT}")
    return data


def resolve_resume(path: str | Path) -> Path:
    """``--resume RUN_DIR|CHECKPOINT_DIR`` -> the checkpoint to load; refuses anything else, saying why."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--resume {path}: no such directory; pass a run directory or one of its "
                          "checkpoints/step-N directories")
    if not p.is_dir():
        raise ConfigError(f"--resume {path} is a file, not a checkpoint; pass a run directory or a "
                          "checkpoints/step-N directory")
    if (p / MANIFEST).is_file():
        if p.resolve().parent.name.startswith("abandoned-"):
            raise ConfigError(f"--resume {path} is a checkpoint of an abandoned branch (set aside by a rollback); "
                              f"to go back to it, move it into {p.resolve().parent.parent} first (mv {p} "
                              f"{p.resolve().parent.parent}/) and resume that")
        for part in ("deepspeed", "policy"):
            if not (p / part).is_dir():
                raise ConfigError(f"--resume {path}: the checkpoint has no {part}/ directory (incomplete or "
                                  "damaged); pass an older checkpoints/step-N directory")
        try:
            read_manifest(p)
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--resume {path}: {MANIFEST} is unreadable ({exc})") from None
        return p
    found = list_checkpoints(p)
    if found:
        return resolve_resume(found[-1])
    raise ConfigError(f"--resume {path} is not a checkpoint: it has no {MANIFEST} and no checkpoints/step-N "
                      "inside; pass the run directory of a run that wrote a checkpoint (run.checkpoint_every)")


def truncate_jsonl(path: Path, keep_lines: int) -> None:
    """Keep the first ``keep_lines`` lines of a JSON-lines file (a resumed run continues after them)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)[:keep_lines]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(lines))
    tmp.rename(path)
