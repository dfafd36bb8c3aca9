"""When a learner step ends with a checkpoint: every ``run.checkpoint_every`` steps or every
``run.checkpoint_every_s`` seconds, whichever comes first.

Step checkpoints stay at multiples of ``checkpoint_every`` (as without the time trigger); the seconds count
from the last checkpoint of any kind (the final or stop checkpoint included), or from the start of training.
With ``checkpoint_every=100, checkpoint_every_s=600`` a run loses at most 100 steps or 600 s of training.

Saving is collective across learner ranks, and each rank reads its own clock at a slightly different moment:
with more than one rank the decision is shared (``any_rank``: a rank whose time is up makes every rank save
at that step). No torch import here.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CheckpointTrigger:
    def __init__(self, every_steps: int, every_s: float, clock: Callable[[], float] = time.monotonic,
                 any_rank: Callable[[bool], bool] | None = None) -> None:
        """``clock``: seconds, monotonic; ``any_rank``: True on every rank when it is True on one (a
        collective, called at every step while ``every_s`` is on)."""
        self.every_steps = every_steps
        self.every_s = every_s
        self.clock = clock
        self.any_rank = any_rank
        self.last_time = clock()

    def due(self, step: int) -> bool:
        """Should the step just finished (``step``, counted from the run's start) be checkpointed? Call it on
        every rank after every step, in the same order."""
        by_steps = bool(self.every_steps) and step % self.every_steps == 0
        if not self.every_s:
            return by_steps
        by_time = self.clock() - self.last_time >= self.every_s
        if self.any_rank is not None:
            by_time = self.any_rank(by_time)
        return by_steps or by_time

    def saved(self) -> None:
        """A checkpoint was just written (whatever triggered it): the seconds count again from now."""
        self.last_time = self.clock()
