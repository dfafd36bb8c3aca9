"""A finished run's timeline: timeline.json and timeline.png in the run directory, and the busy fractions per role
kind that summary.json reports (the learners' compute and push-wait shares among them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_timeline(figures: dict[str, Any], run_dir: Path) -> dict[str, float]:
    """timeline.json and timeline.png in the run directory; returns busy fractions per role kind."""
    from async_rlhf.plots import plot_timeline, role_busy_fraction

    timelines = figures["timelines"]
    (run_dir / "timeline.json").write_text(json.dumps(timelines))
    plot_timeline(timelines, figures["t_start"], run_dir / "timeline.png")
    fractions: dict[str, list[float]] = {}
    for tl in timelines:
        fractions.setdefault(str(tl["role"]).split()[0], []).append(role_busy_fraction(tl))
    return {**{f"{kind}_busy_fraction": sum(v) / len(v) for kind, v in fractions.items()},
            **learner_fractions([tl for tl in timelines if str(tl["role"]).startswith("learner")])}


def learner_fractions(learners: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over learner ranks of the share of wall time spent computing on batches
    (``learner_compute_fraction``) and waiting for a weight push beyond its own transfer, i.e. for the push
    thread to finish before the optimizer step (``learner_push_wait_fraction``)."""
    from async_rlhf.learner.actor import COMPUTE
    from async_rlhf.timeline import busy_fraction

    if not learners:
        return {}
    n = len(learners)
    return {"learner_compute_fraction": sum(busy_fraction(tl["totals"], COMPUTE) for tl in learners) / n,
            "learner_push_wait_fraction": sum(busy_fraction(tl["totals"], ("push_wait",)) for tl in learners) / n}
