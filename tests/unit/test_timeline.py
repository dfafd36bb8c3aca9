from __future__ import annotations

import pytest

from async_rlhf.plots import role_busy_fraction
from async_rlhf.timeline import Timeline, busy_fraction


def test_intervals_and_totals_follow_state_changes() -> None:
    tl = Timeline("generator 0")
    tl.enter("generate", now=10.0)
    tl.enter("generate", now=11.0)  # same state: nothing closes
    tl.enter("wait_admission", now=13.0)
    tl.enter("generate", now=13.5)
    tl.stop(now=16.0)
    assert tl.intervals() == [("generate", 10.0, 13.0), ("wait_admission", 13.0, 13.5), ("generate", 13.5, 16.0)]
    assert tl.totals() == {"generate": 5.5, "wait_admission": 0.5}
    assert busy_fraction(tl.totals(), ("generate",)) == pytest.approx(5.5 / 6.0)


def test_interval_cap_keeps_totals_exact() -> None:
    tl = Timeline("learner 0", max_intervals=2)
    for i, state in enumerate(["wait_data", "compute", "push", "compute"]):
        tl.enter(state, now=float(i))
    tl.stop(now=4.0)
    assert len(tl.intervals()) == 2
    assert tl.totals() == {"wait_data": 1.0, "compute": 2.0, "push": 1.0}


def test_role_busy_fraction_uses_the_role_kind() -> None:
    learner = {"role": "learner 1", "totals": {"forward_backward": 2.0, "optimizer": 1.0, "push": 1.0,
                                               "wait_data": 4.0}}
    generator = {"role": "generator 0", "totals": {"generate": 9.0, "wait_admission": 1.0}}
    assert role_busy_fraction(learner) == pytest.approx(0.5)
    assert role_busy_fraction(generator) == pytest.approx(0.9)


def test_waiting_on_a_push_or_the_buffer_is_never_busy() -> None:
    learner = {"role": "learner 0", "totals": {"forward_backward": 3.0, "push_wait": 5.0, "ack": 1.0,
                                               "wait_data": 1.0}}
    assert role_busy_fraction(learner) == pytest.approx(0.3)


def test_busy_fraction_between_clips_intervals_to_the_window() -> None:
    from async_rlhf.timeline import busy_fraction_between

    intervals = [("generate", 0.0, 4.0), ("wait_admission", 4.0, 5.0), ("generate", 5.0, 10.0)]
    assert busy_fraction_between(intervals, ("generate",), 2.0, 6.0) == pytest.approx(3.0 / 4.0)
    assert busy_fraction_between(intervals, ("generate",), 8.0, 12.0) == pytest.approx(2.0 / 4.0)  # ran out
    assert busy_fraction_between(intervals, ("generate",), 5.0, 5.0) == 0.0


def test_learner_fractions_count_compute_and_push_wait_only() -> None:
    from async_rlhf.driver.timeline_figures import learner_fractions

    ranks = [{"role": "learner 0", "totals": {"forward_backward": 5.0, "optimizer": 1.0, "push_wait": 2.0,
                                              "wait_data": 2.0}},
             {"role": "learner 1", "totals": {"collate": 2.0, "push": 4.0, "wait_data": 4.0}}]
    out = learner_fractions(ranks)
    assert out["learner_compute_fraction"] == pytest.approx((0.6 + 0.2) / 2)  # a synchronous push is not compute
    assert out["learner_push_wait_fraction"] == pytest.approx((0.2 + 0.0) / 2)
    assert learner_fractions([]) == {}
