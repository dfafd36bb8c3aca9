"""Run-directory metrics: one JSON line per record in metrics.jsonl, and the record's scalars to the trackers of
``run.report_to`` (TensorBoard by default; wandb, MLflow: async_rlhf/driver/trackers.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from async_rlhf.driver.trackers import Tracker, scalars, start_trackers, warning_line


class MetricsWriter:
    """``report_to``: tracker names as ``config.parse_report_to`` gives them; ``config``: what the trackers record
    of the run's configuration (config.json's content: no secrets)."""

    def __init__(self, run_dir: Path, report_to: Iterable[str] = ("tensorboard",),
                 config: dict[str, Any] | None = None) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        self.trackers: list[Tracker] = start_trackers(report_to, run_dir, config or {})

    def write(self, record: dict[str, Any], step: int) -> None:
        self._jsonl.write(json.dumps(record, default=float) + "\n")
        self._jsonl.flush()
        values = scalars(record)
        if not values:
            return
        for tracker in list(self.trackers):
            try:
                tracker.log(values, step)
            except Exception as exc:  # a tracker never stops the run: warned once, then left out
                print(warning_line(tracker.name, f"cannot log step {step}", exc, tracker.fix(exc)), flush=True)
                self.trackers.remove(tracker)
                with contextlib.suppress(Exception):  # what it has written so far stays readable
                    tracker.close()

    def close(self) -> None:
        self._jsonl.close()
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:
                print(warning_line(tracker.name, "cannot close", exc, tracker.fix(exc),
                                   "may miss its last records"), flush=True)
        self.trackers = []
