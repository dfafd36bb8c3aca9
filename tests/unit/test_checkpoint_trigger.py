"""run.checkpoint_every and run.checkpoint_every_s: whichever comes first writes a checkpoint (an injected
clock, no wall time)."""

from __future__ import annotations

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.learner.checkpoint_trigger import CheckpointTrigger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(trigger: CheckpointTrigger, clock: Clock, seconds_per_step: list[float]) -> list[int]:
    """The steps the learner loop checkpoints, each step taking the given seconds."""
    saved = []
    for step, dt in enumerate(seconds_per_step, start=1):
        clock.now += dt
        if trigger.due(step):
            saved.append(step)
            trigger.saved()
    return saved


def test_steps_only_checkpoint_at_multiples_whatever_the_time():
    clock = Clock()
    assert _run(CheckpointTrigger(3, 0.0, clock), clock, [100.0] * 10) == [3, 6, 9]


def test_off_by_default_never_triggers():
    clock = Clock()
    assert _run(CheckpointTrigger(0, 0.0, clock), clock, [1e6] * 5) == []


def test_time_only_counts_from_the_last_checkpoint():
    clock = Clock()
    # 4 s per step, every 10 s: 12 s at step 3 (save), 12 s later at step 6, ...
    assert _run(CheckpointTrigger(0, 10.0, clock), clock, [4.0] * 10) == [3, 6, 9]
    clock = Clock()
    # slow steps then fast ones: the count restarts at each save, not at multiples of 10 s
    assert _run(CheckpointTrigger(0, 10.0, clock), clock, [11.0, 1.0, 1.0, 7.0, 30.0]) == [1, 5]


def test_whichever_comes_first():
    clock = Clock()
    # every 4 steps or 10 s: fast steps (1 s) save by steps, slow ones (6 s) by time
    saved = _run(CheckpointTrigger(4, 10.0, clock), clock, [1.0] * 8 + [6.0] * 4)
    assert saved == [4, 8, 10, 12]


def test_any_checkpoint_restarts_the_seconds():
    clock = Clock()
    trigger = CheckpointTrigger(5, 10.0, clock)
    clock.now += 9.0
    assert not trigger.due(1)
    trigger.saved()  # e.g. the step-5 checkpoint or a stop checkpoint
    clock.now += 9.0
    assert not trigger.due(2)
    clock.now += 1.0
    assert trigger.due(3)


def test_ranks_share_the_decision():
    """A rank whose clock has not reached the interval saves when another rank's has (``any_rank``)."""
    clock = Clock()
    asked = []

    def any_rank(due: bool) -> bool:
        asked.append(due)
        return True  # another rank is due

    trigger = CheckpointTrigger(0, 10.0, clock, any_rank=any_rank)
    clock.now += 1.0
    assert trigger.due(1) and asked == [False]
    none_due = CheckpointTrigger(100, 0.0, clock, any_rank=any_rank)
    assert not none_due.due(1) and asked == [False]  # no time trigger: no collective call at all


def test_checkpoint_every_s_config():
    assert load_config(None, []).run.checkpoint_every_s == 0.0
    assert load_config(None, ["run.checkpoint_every_s=600"]).run.checkpoint_every_s == 600.0
    with pytest.raises(ConfigError, match="run.checkpoint_every_s must be 0 or more"):
        load_config(None, ["run.checkpoint_every_s=-1"])
