"""The buffer service's consumer leases and the resume: what happens to groups once delivered to a learner.

A delivered group is leased to its consumer until acknowledged: :meth:`~ConsumerLeases.renew` extends the lease
while a long step runs, :meth:`~ConsumerLeases.tick` takes back those whose lease lapsed (and expires late
rewards), :meth:`~ConsumerLeases.declare_dead` and :meth:`~ConsumerLeases.reclaim` take back a dead learner's or
lost replies, :meth:`~ConsumerLeases.drop_held` ends a run's undelivered groups, and
:meth:`~ConsumerLeases.restore_admission` takes back every delivery of a killed run before its resume.

Apart from ``logic.py`` (storage, admission, sampling, metrics), which stays under the project's module size this
way; the methods are :class:`~async_rlhf.buffer.logic.BufferLogic`'s, through this mixin, and read its state.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from async_rlhf.buffer.admission import AdmissionControl
from async_rlhf.buffer.store import HELD, Store, StoredGroup
from async_rlhf.wire import unpack_array


def _newest_version(group: StoredGroup) -> int:
    """The newest policy version among a stored group's tokens (its start version if it has none)."""
    wire = group.wire
    newest = [int(unpack_array(s["versions"]).max()) for s in wire["samples"] if s["versions"]["shape"][0]]
    return max(newest, default=int((wire.get("meta") or {}).get("start_version", group.min_version)))


class ConsumerLeases:
    """Lease and resume transitions of :class:`~async_rlhf.buffer.logic.BufferLogic` (its base class)."""

    store: Store
    admission: AdmissionControl
    counters: Counter[str]
    holdings: Counter[str]
    visibility_timeout_s: float

    if TYPE_CHECKING:  # BufferLogic's
        def _meta(self) -> dict[str, int]: ...

        def expire_rewards(self, now: float | None = None) -> int: ...

    def tick(self, now: float | None = None) -> int:
        """Redeliver every group whose learner has not acked it within the visibility timeout."""
        now = time.time() if now is None else now
        self.expire_rewards(now)
        overdue = [gid for gid, d in self.store.delivered().items() if now - d.at > self.visibility_timeout_s]
        return self._redeliver(overdue, "visibility_timeout")

    def declare_dead(self, consumer: str) -> int:
        """Take back everything delivered to ``consumer`` (its learner died) so others get it."""
        mine = [gid for gid, d in self.store.delivered().items() if d.consumer == consumer]
        return self._redeliver(mine, "consumer_dead")

    def reclaim(self, consumer: str, holding: list[str]) -> int:
        """Take back what was delivered to ``consumer`` beyond the ids it says it ``holding`` (received, not yet
        acknowledged): replies it never got, e.g. a ``get`` answered just before the service died, or the
        late answer to a get it gave up on. Those groups are held again and delivered to the next get."""
        keep = set(holding)
        lost = [gid for gid, d in self.store.delivered().items() if d.consumer == consumer and gid not in keep]
        return self._redeliver(lost, "reply_lost")

    def renew(self, consumer: str, group_ids: list[str]) -> dict[str, Any]:
        """``consumer`` still trains ``group_ids`` (its lease, renewed well within the visibility timeout while
        a long step runs): their timeout starts again, so :meth:`tick` never hands them to another learner.

        One whose lease lapsed anyway (the renewal came late) and that no other learner has taken yet is
        delivered back to ``consumer``. ``lost``: the ids ``consumer`` no longer holds (taken by another learner,
        trained, dropped or unknown): it must not train them."""
        gids = list(dict.fromkeys(map(str, group_ids)))
        renewed = set(self.store.renew(gids, consumer))
        lapsed = [g for g in gids if g not in renewed and self.store.state(g) == HELD]
        if lapsed:
            self.counters["lease_reclaimed"] += len(lapsed)
            renewed |= {g.group_id for g in self.store.deliver(lapsed, consumer, self.admission.version,
                                                               self._meta())}
        self.counters["lease_renewed"] += len(renewed)
        return {"renewed": len(renewed), "lost": [g for g in gids if g not in renewed]}

    def _redeliver(self, gids: list[str], why: str) -> int:
        if not gids:
            return 0
        self.counters[f"returned_{why}"] += len(gids)
        return len(self.store.redeliver(gids, self._meta()))

    def drop_held(self, reason: str) -> int:
        """Mark every held or awaiting group dropped (end of a run: generated, never trained)."""
        held = [g.group_id for g in self.store.held()] + list(self.store.awaiting())
        if held:
            self.admission.dropped(len(held))
            self.counters[f"dropped_{reason}"] += len(held)
            self.store.drop(held, reason, self._meta())
        return len(held)

    def restore_admission(self, version: int, consumed: int) -> dict[str, Any]:
        """Admission state of a run resumed from a checkpoint at learner ``version``, after ``consumed`` groups
        trained (steps x batch size); called before any generator or learner of the resumed run connects.

        A durable store may hold the killed run's later state: its version (which goes back here), slots its
        generators held (``running`` = 0), groups delivered to its learners (held again), groups awaiting a
        late reward its generators will never send (dropped, reason ``reward_lost``), and groups with tokens
        of versions above ``version``, made by weights the resume rolled back (dropped, reason
        ``rolled_back``). Prompts of dropped groups are issued again by the driver. The groups kept stay
        accepted, so admission opens exactly ``max_staleness + 1`` versions' worth beyond what was consumed.
        """
        version, consumed = int(version), int(consumed)
        if version < 0 or consumed < 0:
            raise ValueError(f"restore_admission needs version and consumed >= 0, got {version}, {consumed}")
        self._redeliver(list(self.store.delivered()), "resumed")
        held = list(self.store.held())
        rolled = [g.group_id for g in held if _newest_version(g) > version]
        lost = list(self.store.awaiting())
        a = self.admission
        a.version, a.running, a.accepted = version, 0, consumed + len(held) - len(rolled)
        self.holdings.clear()
        for gids, reason in ((rolled, "rolled_back"), (lost, "reward_lost")):
            if gids:
                self.counters[f"dropped_{reason}"] += len(gids)
                self.store.drop(gids, reason, self._meta())
        self.store.save_meta(self._meta())
        return {"version": version, "accepted": a.accepted, "kept": len(held) - len(rolled),
                "rolled_back": len(rolled), "reward_lost": len(lost)}
