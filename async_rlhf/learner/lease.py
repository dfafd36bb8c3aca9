"""A learner's lease on the groups it holds: renewed with the buffer while a step runs.

The buffer hands a delivered group to another learner once its learner has not acknowledged it within
``buffer.visibility_timeout_s`` (the learner is presumed dead). A step that is merely long (long chains of
thought, a slow optimizer step under ZeRO-3) must not lose its groups that way, or they are trained twice:
:class:`LeaseKeeper` renews them every quarter of the timeout, on its own thread and buffer client (a ZeroMQ
socket is one thread's), from the moment they arrive until they are acknowledged. A learner that dies stops
renewing, so its groups still go back after the timeout (or at once when the driver declares it dead).

A renewal that comes too late (the learner's process starved, the buffer unreachable for a while) finds a group
another learner has taken meanwhile: the buffer answers that this learner no longer holds it (``lost``). Such a
group is never trained here: :func:`take_share` leaves it out of the step and fetches another in its place
(counted as ``buffer/lease_lost``); the buffer has it delivered to the other learner, which trains and
acknowledges it. One lost after the step's update began has been trained already (the renewal period is a
quarter of the timeout, so only a learner stalled for longer than that meets it): it is logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)


class HasGroupId(Protocol):
    group_id: str


G = TypeVar("G", bound=HasGroupId)


class LeaseKeeper:
    """Renews the ids passed to :meth:`hold` every ``period_s`` until :meth:`done`; ``lost`` collects the ids
    the buffer said this consumer no longer holds (taken by another learner: do not train them)."""

    def __init__(self, make_client: Callable[[], Any], period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"the lease renewal period must be above 0, got {period_s}")
        self._make_client = make_client
        self.period_s = period_s
        self._held: dict[str, None] = {}
        self.lost: set[str] = set()
        self.dropped = 0
        """Groups :meth:`keep_held` left out so far (lost before they were trained)."""
        self.renewals = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, group_ids: Iterable[str]) -> None:
        """These groups were just delivered to this learner: keep them until :meth:`done` (one lost earlier and
        delivered here again is held anew)."""
        ids = list(map(str, group_ids))
        with self._lock:
            self._held.update(dict.fromkeys(ids))
            self.lost.difference_update(ids)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="buffer-lease", daemon=True)
            self._thread.start()

    def done(self, group_ids: Iterable[str] | None = None) -> None:
        """Acknowledged (or given up): stop renewing these ids (all of them with None). One of them reported lost
        meanwhile was trained all the same (it was lost after the step's update began): logged."""
        with self._lock:
            ids = list(self._held) if group_ids is None else [str(gid) for gid in group_ids]
            late = sorted(self.lost.intersection(ids))
            self.lost.difference_update(ids)
            for gid in ids:
                self._held.pop(gid, None)
        if late:
            log.warning("trained %d groups whose lease was lost during the step (another learner has them too): %s",
                        len(late), late[:5])

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def keep_held(self, groups: list[G]) -> list[G]:
        """``groups`` without those the buffer said this learner no longer holds (:attr:`lost`): they are
        another learner's now and must not be trained here. Those are no longer renewed and are counted in
        :attr:`dropped`."""
        with self._lock:
            gone = {g.group_id for g in groups if g.group_id in self.lost}
            for gid in gone:
                self.lost.discard(gid)
                self._held.pop(gid, None)
            self.dropped += len(gone)
        if gone:
            log.warning("left %d groups out of this step: their lease lapsed and another learner took them (%s)",
                        len(gone), sorted(gone)[:5])
        return [g for g in groups if g.group_id not in gone]

    def _run(self) -> None:
        client = None
        try:
            while not self._stop.wait(self.period_s):
                ids = self.held()
                if not ids:
                    continue
                try:
                    if client is None:
                        client = self._make_client()
                    lost = client.renew(ids)
                except Exception as exc:  # noqa: BLE001 - the buffer may be restarting: try again next period
                    log.warning("could not renew the lease on %d groups: %s", len(ids), exc)
                    continue
                self.renewals += 1
                # ids acknowledged (done) while the renewal was on its way are gone from the buffer as they should be
                still = set(self.held())
                lost = [gid for gid in lost if gid in still]
                if lost:
                    log.warning("the buffer no longer delivers %d held groups to this learner: %s", len(lost),
                                lost[:5])
                    with self._lock:
                        self.lost.update(lost)
        finally:
            if client is not None:
                client.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.period_s + 5)


def take_share(get: Callable[[int], list[G]], lease: LeaseKeeper, share: int) -> tuple[list[G], int]:
    """A learner rank's ``share`` of groups for one step, each one still held: ``get(n)`` asks the buffer for up
    to ``n`` more; every delivered group is held under ``lease`` at once. A group whose lease was lost while the
    rank waited for the rest (another learner took it) is left out and another fetched in its place. Returns the
    groups and how many were left out."""
    groups: list[G] = []
    dropped = 0
    while len(groups) < share:
        got = get(share - len(groups))
        kept = lease.keep_held(groups)  # before holding what came: a lost group may have come back to this rank
        dropped += len(groups) - len(kept)
        lease.hold(g.group_id for g in got)
        mine = {g.group_id for g in kept}
        groups = kept + [g for g in got if g.group_id not in mine]
    return groups, dropped
