"""The staleness rule: who may start a prompt group (admission) and what may be trained (consumption).

Admission (AReaL's rule), counted in prompt groups::

        accepted + running  <  (max_staleness + v + 1) * groups_per_version
        ^^^^^^^^   ^^^^^^^      ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        finished   started,     how many groups may exist for learner version v
        and kept   not finished

    v=0, max_staleness=0, B=4:   |####|                 generators may start 4 groups, then wait
    learner trains on them -> v=1: |####|####|          4 more may start
    max_staleness=2:             |####|####|####|       generators run up to 2 versions ahead

``accepted`` counts every group ever put and not dropped (consumed ones included), so the
right-hand side grows by one batch per version: with ``max_staleness = 0`` this is exactly synchronous
on-policy training on the same code path.

Consumption: a group whose oldest token is more than ``max_staleness`` versions behind the learner is
dropped with reason ``stale`` (and frees its admission slot); it is never silently trained on.
"""

from __future__ import annotations

from dataclasses import dataclass


def staleness(learner_version: int, min_token_version: int) -> int:
    return learner_version - min_token_version


def is_stale(learner_version: int, min_token_version: int, max_staleness: int) -> bool:
    return staleness(learner_version, min_token_version) > max_staleness


@dataclass
class AdmissionControl:
    groups_per_version: int
    max_staleness: int
    version: int = 0
    accepted: int = 0
    running: int = 0

    @property
    def capacity(self) -> int:
        return (self.max_staleness + self.version + 1) * self.groups_per_version

    def admit(self, want: int) -> int:
        """Grant up to ``want`` new groups; the caller starts exactly the granted number."""
        granted = max(0, min(want, self.capacity - self.accepted - self.running))
        self.running += granted
        return granted

    def finished(self, n: int = 1, slots_released: bool = False) -> None:
        """``n`` started groups arrived complete. ``slots_released``: their running slots were given back already
        (their generator was declared dead while they were on their way): they are accepted, and end none."""
        if not slots_released:
            self.running = max(0, self.running - n)
        self.accepted += n

    def release(self, n: int) -> None:
        """Slots granted but never used (a generator stopping or dying)."""
        self.running = max(0, self.running - n)

    def dropped(self, n: int = 1) -> None:
        """Accepted groups that will not be trained: their slots go back to the generators."""
        self.accepted = max(0, self.accepted - n)

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"learner version went backwards: {self.version} -> {version}")
        self.version = version
