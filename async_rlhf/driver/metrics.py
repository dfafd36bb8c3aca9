"""Run-directory metrics: one JSON line per record, TensorBoard scalars beside them."""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional; the JSONL file is the record
            self._tb = None

    def write(self, record: dict[str, Any], step: int) -> None:
        self._jsonl.write(json.dumps(record, default=float) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if "/" in key and isinstance(value, numbers.Number) and not isinstance(value, bool):
                    self._tb.add_scalar(key, float(value), step)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
