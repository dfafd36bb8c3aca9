"""BufferLogic.restore_admission: a run resumed from a checkpoint on a store that kept the killed run's
later state (what a Redis store reloads) continues with the checkpoint's admission window."""

import pytest
from test_buffer_logic import ledger, new_logic, wire


def killed_run_state():
    """The buffer a run killed at version 5 leaves behind, resumed from its checkpoint at version 4."""
    logic = new_logic(groups_per_version=4, max_staleness=2)
    logic.set_version(5)
    assert logic.admit(12)["granted"] == 12  # its generators held slots when they died
    logic.put(wire("delivered", (4, 4)))
    logic.put(wire("kept", (3, 4)))
    assert len(logic.take(1, 5, consumer="learner-0")) == 1  # the killed learner never acknowledged it
    logic.put(wire("newer", (4, 5)))  # some tokens from weights after the checkpoint
    logic.put(wire("all_newer", (5, 5)))
    logic.put(wire("awaiting", (4, 4)), rewards_pending=True)  # its generator died computing the reward
    assert ledger(logic)["delivered"] == ["delivered"]
    return logic


def test_restore_rolls_back_the_version_and_keeps_only_groups_of_kept_weights():
    logic = killed_run_state()
    out = logic.restore_admission(4, consumed=16)
    assert out == {"version": 4, "accepted": 18, "kept": 2, "rolled_back": 2, "reward_lost": 1}
    led = ledger(logic)
    assert sorted(led["held"]) == ["delivered", "kept"] and not led["delivered"] and not led["awaiting_reward"]
    assert led["dropped"] == {"newer": "rolled_back", "all_newer": "rolled_back", "awaiting": "reward_lost"}
    stats = logic.stats()
    assert (stats["buffer/version"], stats["buffer/running"], stats["buffer/accepted"]) == (4, 0, 18)
    assert stats["buffer/dropped_rolled_back"] == 2 and stats["buffer/dropped_reward_lost"] == 1
    # the window of version 4 with max_staleness 2: (2 + 4 + 1) * 4 = 28 groups, 18 accepted
    assert logic.admit(100)["granted"] == 10
    assert sorted(ids_of(logic.take(2, 4, consumer="learner-0"))) == ["delivered", "kept"]
    logic.set_version(5)  # the resumed learner's next version is not "backwards"


def ids_of(groups) -> list[str]:
    return [g.group_id for g in groups]


def test_restore_on_a_fresh_store_opens_one_window_beyond_what_was_consumed():
    logic = new_logic(groups_per_version=4, max_staleness=2)
    assert logic.restore_admission(10, consumed=40) == {"version": 10, "accepted": 40, "kept": 0,
                                                        "rolled_back": 0, "reward_lost": 0}
    assert logic.admit(100)["granted"] == (2 + 10 + 1) * 4 - 40


def test_restore_refuses_negative_values():
    with pytest.raises(ValueError):
        new_logic().restore_admission(-1, 0)
