"""Prompt keys, the resumable stream and the driver's ledger: what is re-issued after a crash or a resume."""

from __future__ import annotations

import itertools

import pytest

from async_rlhf.driver.prompt_ledger import PromptLedger
from async_rlhf.generator.stream import PromptStream, group_id, key_of_group


def letters():
    return (f"p{i}" for i in itertools.count(1))  # the i-th prompt of a deterministic stream is "p<i>"


def test_group_id_round_trips_to_its_prompt_key() -> None:
    assert key_of_group(group_id(12, "ab12cd", 345)) == "12:345"
    with pytest.raises(ValueError, match="does not name a prompt"):
        key_of_group("eval-7")


def test_stream_reissues_then_continues_and_skips() -> None:
    stream = PromptStream(letters(), start=5, reissue=[2, 4], skip=[7])
    got = [next(stream) for _ in range(4)]
    assert got == [(2, "p2"), (4, "p4"), (6, "p6"), (8, "p8")]
    assert stream.position == 8


def test_stream_refuses_reissue_beyond_its_position() -> None:
    with pytest.raises(ValueError, match="must lie in 1..3"):
        PromptStream(letters(), start=3, reissue=[4])


def test_ledger_outstanding_is_drawn_minus_trained() -> None:
    led = PromptLedger()
    led.observe_position(0, 6)
    led.observe_trained([group_id(0, "t", s) for s in (1, 2, 5)])
    led.observe_trained([group_id(0, "t", 8)])  # drawn and trained between two polls
    led.observe_position(0, 9)
    assert led.outstanding[0] == {3, 4, 6, 7, 9}
    # restart: 3 is still in the buffer (it will be trained), the rest was in flight and is issued again
    plan = led.plan(0, in_buffer=[group_id(0, "t", 3)])
    assert (plan.position, plan.reissue, plan.skip) == (9, [4, 6, 7, 9], [])
    led.observe_trained([group_id(0, "t2", 4), group_id(0, "t", 4)])
    assert led.duplicates == ["0:4"]


def test_ledger_state_round_trip_keeps_skip_beyond_position() -> None:
    led = PromptLedger()
    led.observe_position(1, 3)
    led.observe_trained([group_id(1, "t", 2), group_id(1, "t", 5)])
    back = PromptLedger.from_state(led.to_state())
    plan = back.plan(1)
    assert (plan.position, plan.reissue, plan.skip) == (3, [1, 3], [5])
