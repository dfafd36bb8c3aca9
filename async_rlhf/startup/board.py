"""The start-up board: a tiny Ray actor (no CPU reserved) every starting rank reports to, and the driver reads.

A rank's constructor runs before the rank can answer any call, so its progress cannot be asked of it: it
tells the board instead. Times are the board's own clock at arrival (one clock for every node's reports).
"""

from __future__ import annotations

import time
from typing import Any

BOARD_ENV = "ASYNC_RLHF_STARTUP_BOARD"
"""Environment variable naming the run's board actor (unset: ranks report nothing, e.g. in tests)."""


class StartupBoard:
    def __init__(self) -> None:
        self.phases: dict[str, list[tuple[str, str, float]]] = {}
        self.beats: dict[str, tuple[float, float]] = {}
        self.done = False

    def phase(self, name: str, phase: str, detail: str) -> None:
        self.phases.setdefault(name, []).append((phase, detail, time.time()))

    def beat(self, name: str, cpu_s: float) -> bool:
        """A heartbeat with the CPU seconds of the rank's process tree; False once start-up is over (the rank's
        heartbeat thread then ends)."""
        self.beats[name] = (time.time(), cpu_s)
        return not self.done

    def forget(self, name: str) -> None:
        """A rank restarted (its actor was made again): its earlier reports no longer apply."""
        self.phases.pop(name, None)
        self.beats.pop(name, None)

    def snapshot(self) -> dict[str, Any]:
        return {"phases": {k: list(v) for k, v in self.phases.items()}, "beats": dict(self.beats),
                "now": time.time()}

    def finish(self) -> None:
        self.done = True
