"""Ending a run early: SIGINT/SIGTERM, a stop request, the time budget (``train.max_time_s``).

    signal / `cluster.py stop` / budget  ->  driver: fleet.request_stop()  ->  learners stop a few steps ahead
    at one common step, checkpointed  ->  policy, plots, summary.json (steps actually done, stop_reason)
"""

from __future__ import annotations

import threading
from typing import Any

from async_rlhf.config import Config


def stop_reason(cfg: Config, elapsed_s: float, signalled: bool, requested: bool) -> str | None:
    """Why the run should stop before ``train.steps`` now, if it should."""
    if signalled:
        return "a stop signal (SIGINT/SIGTERM)"
    if requested:
        return "a stop request (launch/cluster.py stop)"
    if cfg.train.max_time_s and elapsed_s >= cfg.train.max_time_s:
        return f"the time budget (train.max_time_s={cfg.train.max_time_s:g})"
    return None


def catch_stop_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop`` (the run ends after the learners' current step, with a checkpoint and
    summary); a second one raises KeyboardInterrupt. Installed again once Ray is up: ``ray.init`` replaces the
    driver's SIGTERM handler with one that exits at once."""
    import signal

    from async_rlhf.run_logs import console_stderr

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(f"{signal.Signals(signum).name}: stopping after the learners' current step with a checkpoint and "
              "summary.json (send it again to abort without them)", file=console_stderr(), flush=True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
