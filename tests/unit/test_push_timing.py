"""async_rlhf/driver/push_timeline.py: which push a record is (epoch, k), and the timeline from a push's
acknowledgement to each generator serving it, cut at the engine step in progress and the load; and push_timing.py's
run-queue figure."""

from __future__ import annotations

import pytest

from async_rlhf.driver.push_timeline import served_timeline, timeline_summary, training_pushes
from async_rlhf.driver.push_timing import longest_wait_s, thread_run_delays

pytestmark = pytest.mark.unit


def push(version: int, epoch: int, acked: float, push_s: float = 0.01) -> dict[str, float]:
    return {"sync/version": float(version), "sync/epoch": float(epoch), "sync/acked_time": acked, "sync/push_s": push_s}


def test_k_is_the_push_index_in_its_epoch() -> None:
    records = [{"step": 1}, push(2, 0, 10.0), push(1, 0, 9.0), {"step": 3}, push(4, 1, 12.0), push(5, 1, 13.0)]
    got = [(p["sync/version"], p["epoch"], p["k"]) for p in training_pushes(records)]
    assert got == [(1.0, 0, 0), (2.0, 0, 1), (4.0, 1, 0), (5.0, 1, 1)]  # version 3's record was lost: epoch 1 from 4


def test_the_wait_is_cut_at_the_step_in_progress_and_the_load() -> None:
    # gen0: acknowledged at 10.000 inside a step 9.98-10.03, then 4 ms of loop, then a load 10.034-10.044 (live at
    # 10.043); gen1: idle at the acknowledgement, served 60 ms later with a 10 ms load: beyond step + apply + poll
    intervals = [{"steps": [(9.9, 9.95), (9.98, 10.03)], "loads": [(10.034, 10.044)]},
                 {"steps": [(9.0, 9.1)], "loads": [(10.05, 10.06)]}]
    rows = served_timeline([push(3, 0, 10.0)], [{"gen0": 10.043, "gen1": 10.059}], intervals, poll_s=0.005)
    g0, g1 = rows
    assert g0["member"] == "gen0" and g0["step_s"] == pytest.approx(0.05) and g0["step_left_s"] == pytest.approx(0.03)
    assert g0["between_s"] == pytest.approx(0.004) and g0["apply_s"] == pytest.approx(0.01)
    assert g0["wait_s"] == pytest.approx(0.043) and g0["held"]  # 43 ms <= 50 + 10 + 5
    assert g1["step_s"] == 0.0 and g1["between_s"] == pytest.approx(0.05) and not g1["held"]  # 59 ms > 0 + 10 + 5
    summary = timeline_summary(rows, [push(3, 0, 10.0)], [{"gen0": 10.043, "gen1": 10.059}], members=2)
    assert summary["pairs"] == 2 and summary["bound_held"] == 1 and summary["in_step_at_ack"] == 1
    assert summary["served_s"] == pytest.approx(0.069)  # from the push's start (acked - push_s) to the last live
    assert summary["worst"]["member"] == "gen1" and summary["skipped"] == 0


def test_a_version_a_generator_never_served_is_counted_as_skipped() -> None:
    intervals = [{"steps": [], "loads": [(10.01, 10.02)]}, {"steps": [], "loads": []}]
    pushes, lives = [push(1, 0, 10.0), push(2, 0, 10.1)], [{"gen0": 10.02}, {"gen0": 10.12, "gen1": 10.2}]
    rows = served_timeline(pushes, lives, intervals, poll_s=0.005)
    summary = timeline_summary(rows, pushes, lives, members=2)
    assert summary["pairs"] == 3 and summary["skipped"] == 1
    assert summary["served_s"] == pytest.approx(0.11)  # only the push both served: 10.2 - (10.1 - 0.01)


def test_when_a_member_held_it_and_when_its_loop_asked() -> None:
    # pushed at 9.99, gen0's fetch returned version 3 at 9.997; acknowledged by all at 10.0; no step in progress;
    # the loop put a group (reward_and_put 10.0-10.03), asked at 10.031 (polls before found nothing new: -2),
    # loaded 10.032-10.042
    intervals = [{"steps": [], "loads": [(10.032, 10.042)], "fetches": {"gen0": [(9.997, 3)]},
                  "polls": [(9.99, -2), (10.0, -2), (10.031, 3)],
                  "states": [["generate", 9.9, 10.0], ["reward_and_put", 10.0, 10.03], ["generate", 10.03, 10.04]]}]
    (row,) = served_timeline([push(3, 0, 10.0)], [{"gen0": 10.041}], intervals, poll_s=0.005)
    assert row["staged_s"] == pytest.approx(0.007) and row["asked_s"] == pytest.approx(0.031)
    assert row["loop_state"] == "reward_and_put" and row["apply_s"] == pytest.approx(0.01)
    assert not row["held"]  # 41 ms > 0 + 10 + 5: the loop's own work kept the version waiting
    summary = timeline_summary([row], [push(3, 0, 10.0)], [{"gen0": 10.041}], members=1)
    assert summary["loop_states_late"] == {"reward_and_put": 1} and summary["staged_s"] == pytest.approx(0.007)


def test_a_load_that_waited_for_the_version_applies_from_when_it_arrived() -> None:
    # a quiet generator calls _load_version before the push (it waits inside for the fetch): 9.8-10.02, the bytes
    # held at 10.003, live at 10.019: the apply is 10.003-10.02, not the 220 ms of the whole call
    intervals = [{"steps": [], "loads": [(9.8, 10.02)], "fetches": {"gen0": [(10.003, 7)]}, "polls": []}]
    (row,) = served_timeline([push(7, 0, 10.004, push_s=0.004)], [{"gen0": 10.019}], intervals, poll_s=0.005)
    assert row["apply_s"] == pytest.approx(0.017) and row["staged_s"] == pytest.approx(0.003)
    assert row["held"] and row["between_s"] == pytest.approx(-0.001)  # held by the member before the last ack


def test_steps_begun_on_old_weights_after_the_acknowledgement_are_counted() -> None:
    # acknowledged at 10.0: gen0 began one step at 10.001 (the loop had asked just before) then loaded at 10.003:
    # within the step bound; gen1 began three steps after the ack before its load: a loop that did not look
    intervals = [{"steps": [(9.99, 10.0005), (10.001, 10.0025)], "loads": [(10.003, 10.01)]},
                 {"steps": [(10.001, 10.002), (10.003, 10.004), (10.005, 10.006)], "loads": [(10.007, 10.015)]}]
    rows = served_timeline([push(3, 0, 10.0)], [{"gen0": 10.009, "gen1": 10.014}], intervals, poll_s=0.0)
    g0, g1 = rows
    assert (g0["late_steps"], g0["held_steps"]) == (1, True)
    assert (g1["late_steps"], g1["held_steps"]) == (3, False)
    summary = timeline_summary(rows, [push(3, 0, 10.0)], [{"gen0": 10.009, "gen1": 10.014}], members=2)
    assert summary["steps_held"] == 1 and summary["late_steps_max"] == 3


def test_when_a_member_first_saw_the_push_and_held_every_byte() -> None:
    # pushed at 9.99 (acknowledged at 10.0 after 10 ms); gen0's fetch returned at 10.04 having seen the first chunk
    # 38 ms before (transfer_s) and every byte 35 ms before (ack_s): the bytes were here at 10.005, the ack took
    # the rest. A fetch logged without them (an older log) reads -1
    intervals = [{"steps": [], "loads": [(10.04, 10.05)], "fetches": {"gen0": [(10.04, 3, 0.038, 0.035)],
                                                                        "gen1": [(10.02, 3)]}, "polls": []}]
    rows = served_timeline([push(3, 0, 10.0, push_s=0.01)], [{"gen0": 10.05, "gen1": 10.05}],
                           [intervals[0], intervals[0]], poll_s=0.0)
    g0, g1 = rows
    assert g0["first_s"] == pytest.approx(0.012) and g0["bytes_s"] == pytest.approx(0.015)
    assert g0["staged_s"] == pytest.approx(0.05)
    assert g1["first_s"] == -1.0 and g1["bytes_s"] == -1.0
    summary = timeline_summary(rows, [push(3, 0, 10.0, push_s=0.01)], [{"gen0": 10.05, "gen1": 10.05}], members=2)
    assert summary["bytes_s"] == pytest.approx(0.015) and summary["first_s"] == pytest.approx(0.012)


def test_the_longest_wait_for_a_core_of_any_thread() -> None:
    now = thread_run_delays()
    assert now and all(isinstance(v, int) and v >= 0 for v in now.values())  # Linux: this thread at least
    # thread 2 waited 40 ms, thread 1 waited 1 ms, thread 3 is new (not counted), thread 4 ended
    before, after = {"1": 5_000_000, "2": 10_000_000, "4": 0}, {"1": 6_000_000, "2": 50_000_000, "3": 90_000_000}
    assert longest_wait_s(before, after) == pytest.approx(0.040)
    assert longest_wait_s({}, after) == 0.0
