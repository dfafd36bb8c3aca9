"""A reward source that keeps failing stops its generator with the source named; a success resets the count."""

import pytest

from async_rlhf.rewards.streak import FailureStreak, RewardSourceFailed


def test_the_limit_of_failures_in_a_row_stops_with_the_source_and_its_last_error() -> None:
    streak = FailureStreak(limit=3, sources="function")
    for _ in range(2):
        streak.observe("reward_errors", "reward_error: ZeroDivisionError('x')")
        streak.check(0)
    streak.observe("reward_timeouts", "reward_timeout")
    with pytest.raises(RewardSourceFailed, match=r"'function' failed 3 times in a row on generator 7.*reward_timeout"):
        streak.check(7)


def test_a_success_in_between_resets_the_count_and_other_events_do_not() -> None:
    streak = FailureStreak(limit=2, sources="http")
    streak.observe("reward_errors", "boom")
    streak.observe("put")  # rewarded at once
    streak.observe("reward_errors", "boom")
    streak.observe("put_pending")  # a late reward still to come: neither
    streak.observe("dropped", "reward_error: boom")
    streak.check(0)
    streak.observe("reward_timeouts")
    with pytest.raises(RewardSourceFailed):
        streak.check(0)
    streak.observe("rewarded")
    streak.check(0)


def test_zero_never_stops() -> None:
    streak = FailureStreak(limit=0, sources="task")
    for _ in range(1000):
        streak.observe("reward_errors", "x")
    streak.check(0)
