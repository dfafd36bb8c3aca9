"""When a reward source is broken rather than unlucky: consecutive failures of one generator's rewards (pure).

Every failed or timed-out reward drops its group and the prompt is generated again, so a source that always
fails would keep a run busy forever with nothing trained. After ``rewards.max_consecutive_failures`` in a row
(a success in between resets the count) the generator stops with :class:`RewardSourceFailed`, and the driver
stops the run with that error.
"""

from __future__ import annotations

from dataclasses import dataclass

FAILURES = ("reward_errors", "reward_timeouts")
SUCCESSES = ("put", "rewarded")
"""Generator events (``GroupRunner.record``) that mean a group's rewards failed, or arrived."""


class RewardSourceFailed(RuntimeError):
    """A generator's reward sources failed too many times in a row: the run stops (not retried)."""


@dataclass
class FailureStreak:
    limit: int
    """Failures in a row that stop the run (0: never)."""
    sources: str
    count: int = 0
    last: str = ""

    def observe(self, event: str, reason: str = "") -> None:
        if event in FAILURES:
            self.count += 1
            self.last = reason
        elif event in SUCCESSES:
            self.count = 0

    def check(self, generator: int) -> None:
        """Raise :class:`RewardSourceFailed` once the streak reaches the limit."""
        if self.limit and self.count >= self.limit:
            raise RewardSourceFailed(
                f"reward source(s) {self.sources!r} failed {self.count} times in a row on generator {generator} "
                f"(rewards.max_consecutive_failures={self.limit}); last: {self.last[:300]}")
