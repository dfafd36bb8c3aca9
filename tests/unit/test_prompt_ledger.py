"""Prompt keys, the resumable stream and the driver's ledger: what is re-issued after a crash or a resume."""

from __future__ import annotations

import itertools

import pytest

from async_rlhf.driver.prompt_ledger import PromptLedger
from async_rlhf.generator.stream import PromptStream, group_id, key_of_group, keys_of_group


def letters():
    return (f"p{i}" for i in itertools.count(1))  # the i-th prompt of a deterministic stream is "p<i>"


def test_group_id_round_trips_to_its_prompt_key() -> None:
    assert key_of_group(group_id(12, "ab12cd", 345)) == "12:345"
    with pytest.raises(ValueError, match="does not name a prompt"):
        key_of_group("eval-7")


def test_a_group_id_names_the_prompts_passed_over_right_before_it() -> None:
    gid = group_id(3, "ab12cd", 17, passed_over=2)
    assert gid == "g3-ab12cd-17~2" and key_of_group(gid) == "3:17"
    assert keys_of_group(gid) == ["3:15", "3:16", "3:17"] and keys_of_group(group_id(3, "t", 4)) == ["3:4"]
    for bad in ("g3-t-17~", "g3-t-17~x", "g3-t-2~2"):  # no count, not a number, more than came before it
        with pytest.raises(ValueError, match="does not name a prompt"):
            keys_of_group(bad)


def test_a_stream_says_whether_its_next_draw_is_the_next_position() -> None:
    stream = PromptStream(letters(), start=3, reissue=[2], skip=[5])
    assert not stream.next_is_contiguous  # a re-issued prompt comes first
    next(stream)
    assert stream.next_is_contiguous  # 4
    assert next(stream) == (4, "p4") and not stream.next_is_contiguous  # 5 is skipped: 6 comes next


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


def test_prompts_passed_over_are_used_up_with_their_group_and_held_with_it_in_the_buffer() -> None:
    led = PromptLedger()
    led.observe_position(0, 10)
    led.observe_trained([group_id(0, "t", 4, passed_over=3)])  # 1, 2, 3 skipped by the filter, 4 trained
    assert led.outstanding[0] == {5, 6, 7, 8, 9, 10}
    plan = led.plan(0, in_buffer=[group_id(0, "t", 7, passed_over=2)])  # 5, 6 skipped, 7 still in the buffer
    assert plan.reissue == [8, 9, 10]
    led.observe_trained([group_id(0, "t", 12, passed_over=1)])  # beyond the position seen: ahead, 11 too
    led.observe_position(0, 12)
    assert led.outstanding[0] == {5, 6, 7, 8, 9, 10} and led.duplicates == []


def test_ledger_state_round_trip_keeps_skip_beyond_position() -> None:
    led = PromptLedger()
    led.observe_position(1, 3)
    led.observe_trained([group_id(1, "t", 2), group_id(1, "t", 5)])
    back = PromptLedger.from_state(led.to_state())
    plan = back.plan(1)
    assert (plan.position, plan.reissue, plan.skip) == (3, [1, 3], [5])
