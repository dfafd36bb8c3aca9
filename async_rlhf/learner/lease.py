"""A learner's lease on the groups it holds: renewed with the buffer while a step runs.

The buffer hands a delivered group to another learner once its learner has not acknowledged it within
``buffer.visibility_timeout_s`` (the learner is presumed dead). A step that is merely long (long chains of
thought, a slow optimizer step under ZeRO-3) must not lose its groups that way, or they are trained twice:
:class:`LeaseKeeper` renews them every quarter of the timeout, on its own thread and buffer client (a ZeroMQ
socket is one thread's), from the moment they arrive until they are acknowledged. A learner that dies stops
renewing, so its groups still go back after the timeout (or at once when the driver declares it dead).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)


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
        self.renewals = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, group_ids: Iterable[str]) -> None:
        """These groups were just delivered to this learner: keep them until :meth:`done`."""
        with self._lock:
            self._held.update(dict.fromkeys(map(str, group_ids)))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="buffer-lease", daemon=True)
            self._thread.start()

    def done(self, group_ids: Iterable[str] | None = None) -> None:
        """Acknowledged (or given up): stop renewing these ids (all of them with None)."""
        with self._lock:
            if group_ids is None:
                self._held.clear()
            else:
                for gid in map(str, group_ids):
                    self._held.pop(gid, None)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

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
