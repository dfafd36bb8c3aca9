"""Where a role's time goes: a sequence of named states, each entered at a time (pure, thread-safe).

    generator 0  |generate|wait_admission|generate|paused_for_push|generate| ...
    learner 0    |wait_data|compute|push|wait_data|compute| ...

States: a generator is ``generate`` (engine steps), ``reward_and_put`` (scoring and handing a finished group
to the buffer), ``wait_admission`` (nothing in flight: the staleness bound or the buffer holds it back),
``wait_env_or_reward`` (groups in flight, but they await their environment or a late reward) or
``paused_for_push`` (loading a new version); a learner is ``wait_data``, ``compute``, ``push`` or
``checkpoint``. Busy means generate/reward_and_put and compute/push (``async_rlhf.plots.BUSY``).

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

    @property
    def state(self) -> str | None:
        """The state open now (None when stopped)."""
        return self._state

    def intervals(self) -> list[tuple[str, float, float]]:
        with self._lock:
            return list(self._intervals)

    def to_dict(self) -> dict[str, object]:
        return {"role": self.role, "totals": self.totals(), "intervals": self.intervals()}


def busy_fraction(totals: dict[str, float], busy: tuple[str, ...]) -> float:
    total = sum(totals.values())
    return sum(totals.get(s, 0.0) for s in busy) / total if total else 0.0


def busy_fraction_between(intervals: list[tuple[str, float, float]], busy: tuple[str, ...], start: float,
                          end: float) -> float:
    """Share of ``[start, end]`` spent in ``busy`` states (time outside every interval counts as idle).

    Benchmarks use it on the steady state of a run, leaving out the start-up and the drain at the end."""
    if end <= start:
        return 0.0
    inside = sum(max(0.0, min(e, end) - max(s, start)) for state, s, e in intervals if state in busy)
    return inside / (end - start)
