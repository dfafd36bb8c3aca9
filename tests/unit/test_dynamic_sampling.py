"""Dynamic sampling in the buffer: groups whose rewards are all equal never reach a learner (zero_advantage)."""

import msgpack
import numpy as np

from async_rlhf.buffer.service import BufferLogic
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.config import TrainConfig, drops_zero_advantage
from async_rlhf.types import Group, Sample


def group(gid: str, rewards: list[float]) -> dict:
    samples = [Sample(np.array([5, 6], np.int32), np.full(2, -0.5, np.float32), np.zeros(2, np.int32), r)
               for r in rewards]
    return Group(gid, np.array([1, 2], np.int32), samples, generator=0).to_wire()


def logic(drop: bool) -> BufferLogic:
    return BufferLogic(MemoryStore(), groups_per_version=2, max_staleness=0, drop_zero_advantage=drop)


def test_uniform_groups_are_dropped_and_their_admission_slots_come_back() -> None:
    buf = logic(drop=True)
    assert buf.admit(2)["granted"] == 2
    assert buf.admit(1)["granted"] == 0  # the bound: one batch of 2 at version 0
    buf.put(group("all-right", [1.0, 1.0, 1.0]))
    buf.put(group("mixed", [1.0, 0.0, 1.0]))
    assert buf.store.dropped() == {"all-right": "zero_advantage"}
    assert buf.counters["dropped_zero_advantage"] == 1
    assert buf.admit(2)["granted"] == 1  # the dropped group's slot is free again: the batch can still fill
    got = buf.try_get(1, version=0)
    assert [msgpack.unpackb(g)["group_id"] for g in got] == ["mixed"]
    # the next ack tells the learner which prompts were used up without training (once)
    assert buf.ack(["mixed"]) == {"acked": 1, "consumed": ["all-right"]}
    assert buf.ack([]) == {"acked": 0}


def test_a_late_reward_that_makes_a_group_uniform_drops_it() -> None:
    buf = logic(drop=True)
    buf.admit(2)
    buf.put(group("late-a", [0.0, 0.0]), rewards_pending=True)  # placeholder rewards: not judged yet
    buf.put(group("late-b", [0.0, 0.0]), rewards_pending=True)
    assert not buf.store.dropped()
    assert buf.reward("late-a", [0.5, 0.5]) == {"ok": True, "dropped": "zero_advantage"}
    assert buf.reward("late-b", [0.5, 1.0]) == {"ok": True}
    assert buf.store.dropped() == {"late-a": "zero_advantage"}
    assert [msgpack.unpackb(g)["group_id"] for g in buf.try_get(1, version=0)] == ["late-b"]


def test_without_dynamic_sampling_uniform_groups_are_trained() -> None:
    buf = logic(drop=False)
    buf.admit(1)
    buf.put(group("all-wrong", [0.0, 0.0]))
    assert not buf.store.dropped() and len(buf.try_get(1, version=0)) == 1


def test_auto_is_on_only_where_a_uniform_group_has_no_gradient() -> None:
    assert drops_zero_advantage(TrainConfig())  # grpo, group baseline, no KL
    kl = TrainConfig()
    kl.objective.kl_coef = 0.1
    assert not drops_zero_advantage(kl)  # the KL term still has a gradient
    assert not drops_zero_advantage(TrainConfig(advantage="reinforce_pp"))  # a batch baseline
    assert not drops_zero_advantage(TrainConfig(algorithm="ppo"))  # a critic
    assert drops_zero_advantage(TrainConfig(algorithm="ppo", drop_zero_advantage="on"))
    assert not drops_zero_advantage(TrainConfig(drop_zero_advantage="off"))


def test_a_policy_that_always_fails_still_trains_after_a_streak_of_uniform_groups() -> None:
    from async_rlhf.buffer.logic import DROP_STREAK_BATCHES

    buf = BufferLogic(MemoryStore(), groups_per_version=2, max_staleness=100, drop_zero_advantage=True)
    limit = DROP_STREAK_BATCHES * 2
    buf.admit(limit + 3)
    for i in range(limit + 2):
        buf.put(group(f"fail-{i}", [0.0, 0.0]))
    assert buf.counters["dropped_zero_advantage"] == limit  # then it gives up dropping
    assert buf.counters["kept_zero_advantage"] == 2 and len(buf.try_get(2, version=0)) == 2
    buf.put(group("mixed", [0.0, 1.0]))  # an informative group resets the streak: uniform ones drop again
    buf.admit(1)
    buf.put(group("fail-again", [0.0, 0.0]))
    assert buf.store.dropped()["fail-again"] == "zero_advantage"


def test_on_and_off_survive_yaml_on_the_command_line() -> None:
    from async_rlhf.config import load_config

    assert load_config(None, ["train.drop_zero_advantage=off"]).train.drop_zero_advantage == "off"
    assert load_config(None, ["train.drop_zero_advantage=on"]).train.drop_zero_advantage == "on"
