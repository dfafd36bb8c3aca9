"""Figures of the live progress line that must survive a generator restart (pure).

A generator's counters (tokens generated, held-out evaluations) live in its process: a restarted
generator starts them again from zero. Summing the fleet's counters and differencing the sums gave a
negative rate (``gen -12491 tok/s``) the moment one restarted; here each generator's counter is
differenced on its own, and a counter that went down is a restart (its value is what the new process
made since), never a negative delta.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def tokens_since(prev: Mapping[int, float], cur: Mapping[int, float]) -> float:
    """Tokens generated between two readings of per-generator counters (generator id -> tokens so far).

    A counter below its previous reading belongs to a restarted generator: all of it is new. A generator
    missing from ``cur`` (not answering, restarting) adds nothing; one seen for the first time (added or
    back from a restart) adds what it has made so far.
    """
    total = 0.0
    for gen, now in cur.items():
        before = prev.get(gen)
        total += now if before is None or now < before else now - before
    return total


class TokenRate:
    """Generated tokens per second over the last window of at least ``window_s``."""

    def __init__(self, window_s: float = 1.0) -> None:
        self.window_s = window_s
        self.rate = 0.0
        self._last: dict[int, float] = {}
        self._t: float | None = None

    def update(self, now: float, counters: Mapping[int, float]) -> float:
        """Feed one reading (time, generator id -> tokens so far); returns the current rate (never below 0)."""
        if self._t is None:  # the first reading is the baseline
            self._t, self._last = now, dict(counters)
            return self.rate
        if now - self._t >= self.window_s:
            self.rate = tokens_since(self._last, counters) / (now - self._t)
            self._t = now
            # generators that did not answer keep their last reading for the next window
            self._last = {**self._last, **counters}
        return self.rate


def fresh_evals(written: set[int], evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evaluations not written yet, one per policy version, in version order.

    A restarted evaluator starts its list again (and may evaluate a version already written): positions
    in its list mean nothing across a restart, versions do. ``written`` is updated.
    """
    out = []
    for ev in sorted(evals, key=lambda e: int(e["version"])):
        v = int(ev["version"])
        if v not in written:
            written.add(v)
            out.append(ev)
    return out
