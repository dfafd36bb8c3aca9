"""The progress line's generation rate and held-out figures across generator restarts."""

from __future__ import annotations

from async_rlhf.driver.progress_rates import TokenRate, fresh_evals, tokens_since


def test_a_restarted_generator_counts_its_new_tokens_not_a_negative_delta() -> None:
    # generator 1 restarted: its counter went from 12491 back to 40
    assert tokens_since({0: 1000.0, 1: 12491.0}, {0: 1100.0, 1: 40.0}) == 100.0 + 40.0


def test_missing_and_new_generators() -> None:
    assert tokens_since({0: 500.0, 1: 300.0}, {0: 600.0}) == 100.0  # 1 is not answering: adds nothing
    assert tokens_since({0: 500.0}, {0: 600.0, 2: 30.0}) == 130.0  # 2 was added: all it made is new


def test_rate_over_a_restart_is_never_negative() -> None:
    rate = TokenRate(window_s=1.0)
    assert rate.update(0.0, {0: 0.0, 1: 0.0}) == 0.0  # baseline
    assert rate.update(1.0, {0: 1000.0, 1: 12491.0}) == 13491.0
    assert rate.update(2.0, {0: 2000.0}) == 1000.0  # generator 1 died: not answering
    # generator 1 is back with a fresh counter; its last reading (12491) was kept, the drop is a restart
    assert rate.update(3.0, {0: 3000.0, 1: 200.0}) == 1200.0
    assert rate.update(3.5, {0: 9000.0, 1: 900.0}) == 1200.0  # within the window: the last rate


def test_evals_are_taken_once_per_version_across_an_evaluator_restart() -> None:
    written: set[int] = set()
    before = [{"version": 0, "accuracy": 0.1}, {"version": 10, "accuracy": 0.3}]
    assert [e["version"] for e in fresh_evals(written, before)] == [0, 10]
    assert fresh_evals(written, before) == []
    # restarted: its list starts again, shorter than before; a new version is still taken (a position would not)
    after = [{"version": 20, "accuracy": 0.5}]
    assert fresh_evals(written, after) == after
    assert fresh_evals(written, [{"version": 20, "accuracy": 0.4}]) == []  # re-evaluated: written once
