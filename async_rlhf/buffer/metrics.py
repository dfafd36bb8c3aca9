"""Service metrics that need a window: event rates and request-handling latency percentiles."""

from __future__ import annotations

import time
from collections import deque


class RateMeter:
    """Events per second over the last ``window_s`` seconds, in one-second buckets (O(1) per event)."""

    def __init__(self, window_s: int = 10) -> None:
        self.window_s = window_s
        self._buckets: deque[list[int]] = deque()  # [second, count]

    def add(self, n: int = 1, now: float | None = None) -> None:
        sec = int(now if now is not None else time.monotonic())
        if self._buckets and self._buckets[-1][0] == sec:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([sec, n])
        self._trim(sec)

    def rate(self, now: float | None = None) -> float:
        now = now if now is not None else time.monotonic()
        self._trim(int(now))
        if not self._buckets:
            return 0.0
        span = max(1.0, min(float(self.window_s), now - self._buckets[0][0]))
        return sum(c for _, c in self._buckets) / span

    def _trim(self, sec: int) -> None:
        while self._buckets and self._buckets[0][0] <= sec - self.window_s:
            self._buckets.popleft()


class LatencyWindow:
    """The last ``size`` handling times of one request kind; percentiles in milliseconds."""

    def __init__(self, size: int = 4096) -> None:
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)

    def percentiles(self, *qs: float) -> list[float]:
        if not self._samples:
            return [0.0 for _ in qs]
        data = sorted(self._samples)
        return [1000.0 * data[min(len(data) - 1, int(q * len(data)))] for q in qs]

    def extend(self, other: LatencyWindow) -> None:
        self._samples.extend(other._samples)

    def __len__(self) -> int:
        return len(self._samples)
