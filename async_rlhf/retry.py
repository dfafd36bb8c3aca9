"""One retry loop for every call that may meet a peer in the middle of a restart (Redis loading its AOF, the
buffer service coming back): exponential back-off from ``first_delay_s`` up to ``max_delay_s``, a deadline,
and a stop check. Only calls that are safe to repeat are retried (idempotent on the other side)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def retry(call: Callable[[], T], retry_on: tuple[type[BaseException], ...], give_up_after_s: float, *,
          first_delay_s: float = 0.05, max_delay_s: float = 2.0, should_stop: Callable[[], bool] | None = None,
          on_retry: Callable[[BaseException, float, float], None] | None = None,
          sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> T:
    """``call()``; when it raises one of ``retry_on``, wait and call again until ``give_up_after_s`` have passed
    or ``should_stop()`` is true, then re-raise the last error. ``on_retry(error, delay, seconds_left)`` is
    called before each wait (to log it)."""
    deadline = clock() + give_up_after_s
    delay = first_delay_s
    while True:
        try:
            return call()
        except retry_on as exc:
            left = deadline - clock()
            if left <= 0 or (should_stop is not None and should_stop()):
                raise
            if on_retry is not None:
                on_retry(exc, delay, left)
            sleep(min(delay, left))
            delay = min(delay * 2, max_delay_s)
