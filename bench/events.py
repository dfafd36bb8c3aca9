"""How many events a measured rate needs, and the error when a row has fewer.

A rate is events counted in a window over the window's length. Two things bound its precision p (relative):
counting noise (about 1/sqrt(n) for n independent events, so n >= 1/p**2), and the granularity of the count
(an event source that reports q events at once can put up to q of them on the wrong side of each edge of the
window, so n >= 2q/p). A row below that, or with no event at all, measured nothing worth printing: it is an
error that names the row, never a figure of 0.
"""

from __future__ import annotations

import math


class TooFewEvents(RuntimeError):
    """A bench row measured fewer events than its stated precision needs."""


def needed_events(precision: float, quantum: int = 1) -> int:
    """Events a rate needs for ``precision`` (e.g. 0.1 for +-10%) when they are counted ``quantum`` at a time."""
    if not 0 < precision < 1:
        raise ValueError(f"precision must be in (0, 1), got {precision}")
    return max(math.ceil(1 / precision ** 2 - 1e-9), math.ceil(2 * max(1, quantum) / precision - 1e-9))


def check_events(row: str, events: int, needed: int, seconds: float | None = None) -> None:
    """Raise :class:`TooFewEvents` (one line naming ``row``) unless ``events >= needed`` and ``events > 0``."""
    if events > 0 and events >= needed:
        return
    during = f" in {seconds:.1f} s" if seconds is not None else ""
    raise TooFewEvents(f"{row}: measured {events} events{during}, needs at least {max(1, needed)} for its stated "
                       "precision (the machine is too slow or too busy for this window: raise --max-seconds)")
