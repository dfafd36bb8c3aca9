"""Where a role's time goes: a sequence of named states, each entered at a time (pure, thread-safe).

    generator 0  |generate|wait_admission|generate|paused_for_push|generate| ...
    learner 0    |wait_data|compute|push|wait_data|compute| ...

``enter(state)`` closes the current interval and opens the next; entering the state already open does
nothing, so calling it in a hot loop costs a comparison.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict


class Timeline:
    def __init__(self, role: str, max_intervals: int = 500_000) -> None:
        self.role = role
        self.max_intervals = max_intervals
        self._lock = threading.Lock()
        self._state: str | None = None
        self._since = 0.0
        self._intervals: list[tuple[str, float, float]] = []
        self._totals: dict[str, float] = defaultdict(float)

    def enter(self, state: str, now: float | None = None) -> None:
        if state == self._state:
            return
        now = time.time() if now is None else now
        with self._lock:
            self._close(now)
            self._state, self._since = state, now

    def stop(self, now: float | None = None) -> None:
        with self._lock:
            self._close(time.time() if now is None else now)
            self._state = None

    def _close(self, now: float) -> None:
        if self._state is None:
            return
        self._totals[self._state] += now - self._since
        if len(self._intervals) < self.max_intervals:
            self._intervals.append((self._state, self._since, now))

    def totals(self) -> dict[str, float]:
        """Seconds per state so far, the open interval included."""
        with self._lock:
            out = dict(self._totals)
            if self._state is not None:
                out[self._state] = out.get(self._state, 0.0) + time.time() - self._since
            return out

    def intervals(self) -> list[tuple[str, float, float]]:
        with self._lock:
            return list(self._intervals)

    def to_dict(self) -> dict[str, object]:
        return {"role": self.role, "totals": self.totals(), "intervals": self.intervals()}


def busy_fraction(totals: dict[str, float], busy: tuple[str, ...]) -> float:
    total = sum(totals.values())
    return sum(totals.get(s, 0.0) for s in busy) / total if total else 0.0
