"""The run's frozen reference model (the KL anchor, DPO's reference), recorded at the first start in
``run_dir/reference.json`` (its path and a digest of the weights the learner loaded) so that every resume anchors
to the same weights: a resumed policy is never the reference. No torch or ray import here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from async_rlhf.config import ConfigError

REFERENCE_FILE = "reference.json"


def read_reference(run_dir: str | Path) -> dict[str, Any] | None:
    """What the run's first start recorded, or None (a run written before the record existed)."""
    path = Path(run_dir) / REFERENCE_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is unreadable ({exc}); it names the run's reference model: restore it, or "
                          "delete it to take the reference from the run's config (model.path)") from None
    if not isinstance(data, dict) or not isinstance(data.get("path"), str):
        raise ConfigError(f"{path} names no reference model path; delete it to take the reference from the run's "
                          "config (model.path)")
    return data


def write_reference(run_dir: str | Path, path: str, sha256: str | None) -> None:
    body = json.dumps({"path": str(path), "sha256": sha256}, indent=2)
    tmp = Path(run_dir) / (REFERENCE_FILE + ".tmp")
    tmp.write_text(body)
    tmp.rename(Path(run_dir) / REFERENCE_FILE)


def check_reference(recorded: dict[str, Any], path: str, sha256: str | None) -> None:
    """Refuse a resume whose reference weights differ from those the run started with (the model directory
    was rebuilt or replaced): its KL term would anchor to another model without a word."""
    want = recorded.get("sha256")
    if want and sha256 and want != sha256:
        raise ConfigError(f"the reference model at {path} is not the one this run started from (weights sha256 "
                          f"{sha256[:12]}..., recorded {want[:12]}...): restore that model directory, or start a "
                          "new run (a resume must anchor its KL term to the same reference)")
