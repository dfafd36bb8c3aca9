"""The one retry loop: back-off, deadline, stop check, only the named errors retried."""

from __future__ import annotations

import pytest

from async_rlhf.retry import retry


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def flaky(failures: int, error: type[Exception] = ConnectionError):
    calls = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise error(f"down ({len(calls)})")
        return "up"

    return call, calls


def test_backs_off_doubling_up_to_the_cap_and_returns_once_the_peer_answers() -> None:
    clock, seen = Clock(), []
    call, calls = flaky(5)
    out = retry(call, (ConnectionError,), 60.0, first_delay_s=0.1, max_delay_s=0.5, sleep=clock.sleep,
                clock=lambda: clock.now, on_retry=lambda e, d, left: seen.append((str(e), d)))
    assert out == "up" and len(calls) == 6
    assert clock.sleeps == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert [d for _, d in seen] == pytest.approx(clock.sleeps) and seen[0][0] == "down (1)"


def test_gives_up_at_the_deadline_with_the_last_error() -> None:
    clock = Clock()
    call, calls = flaky(1000)
    with pytest.raises(ConnectionError, match="down"):
        retry(call, (ConnectionError,), 1.0, first_delay_s=0.3, max_delay_s=0.3, sleep=clock.sleep,
              clock=lambda: clock.now)
    assert clock.now == pytest.approx(1.0) and len(calls) == 5  # never sleeps past the deadline


def test_stops_when_asked_and_never_retries_other_errors() -> None:
    clock = Clock()
    call, calls = flaky(1000)
    with pytest.raises(ConnectionError):
        retry(call, (ConnectionError,), 60.0, should_stop=lambda: len(calls) >= 3, sleep=clock.sleep,
              clock=lambda: clock.now)
    assert len(calls) == 3
    call, calls = flaky(1, ValueError)
    with pytest.raises(ValueError):
        retry(call, (ConnectionError,), 60.0, sleep=clock.sleep, clock=lambda: clock.now)
    assert len(calls) == 1
