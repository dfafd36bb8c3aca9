"""The readings of bench/vs_trl.py: what TRL holds by its end, and the time a curve takes to hold a level."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def bench(load_bench: Any) -> Any:
    return load_bench("vs_trl.py")


def curve(*points: tuple[float, float]) -> list[dict[str, float]]:
    return [{"time_s": t, "accuracy": a} for t, a in points]


def test_held_accuracy_is_the_mean_of_the_second_half_not_a_dipping_last_evaluation(bench: Any) -> None:
    trl = curve((0, 0.4), (100, 0.9), (300, 0.99), (450, 0.98), (600, 0.91))
    assert bench.held_accuracy(trl, 300) == pytest.approx((0.99 + 0.98 + 0.91) / 3)
    # no evaluation in the second half: the last one
    assert bench.held_accuracy(curve((0, 0.4), (100, 0.8)), 300) == pytest.approx(0.8)


def test_time_to_hold_needs_consecutive_evaluations_not_one_lucky_one(bench: Any) -> None:
    ours = curve((0, 0.4), (5, 0.97), (10, 0.85), (15, 0.9), (20, 0.96), (25, 0.97), (30, 0.98))
    assert bench.time_to(ours, 0.95) == 5  # one evaluation above is enough for the first reading
    # means of three in a row: 0.74, 0.907, 0.903, 0.943, 0.970
    assert bench.time_to(ours, 0.95, 3) == 30
    assert bench.time_to(ours, 0.9, 3) == 15
    assert bench.time_to(ours, 0.99, 3) is None
    assert bench.time_to(ours[:2], 0.1, 3) is None  # fewer evaluations than the window
