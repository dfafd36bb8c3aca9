"""The driver's view of the buffer actor: alive, restarting, or dead.

    buffer.store=memory   a dead actor is dead: its groups are gone, the run stops (RunFailure, one line)
    buffer.store=redis    Ray restarts the actor (run.buffer_max_restarts) on the same port; it recovers its
                          state from Redis and the clients reconnect. The run stops only when the actor is out
                          of restarts, or has not answered for buffer.redis_retry_s + buffer.request_timeout_s

The driver asks for the buffer's stats every loop with a short timeout; while they do not come it keeps the
last ones (the progress line goes on) and asks Ray what became of the actor.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from async_rlhf.driver.handles import BufferStats, RoleCluster

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0
ACTOR_TIMEOUT_S = 2.0
DEAD_CONFIRMATIONS = 3


class BufferWatch:
    def __init__(self, cluster: RoleCluster, client: BufferStats) -> None:
        cfg = cluster.cfg
        self.cluster = cluster
        self.client = client
        self.restartable = cfg.buffer.store == "redis" and cfg.run.buffer_max_restarts > 0
        self.patience_s = cfg.buffer.redis_retry_s + cfg.buffer.request_timeout_s
        self.down_since: float | None = None
        self.restarts = 0
        self.last: dict[str, Any] = {}

    def stats(self) -> dict[str, Any]:
        """The buffer's stats; while it does not answer, the last ones. Raises RunFailure once it is dead."""
        from async_rlhf.buffer.client import BufferUnavailable

        try:
            buf = self.client.stats(timeout_s=STATS_TIMEOUT_S)
        except BufferUnavailable as exc:
            self._not_answering(str(exc))
            return self.last
        restarted = float(buf.get("buffer/uptime_s", 0.0)) < float(self.last.get("buffer/uptime_s", 0.0))
        if restarted or self.down_since is not None:
            self._back(restarted)
        self.last = buf
        return buf

    def check(self) -> None:
        """Ask Ray about the actor (the driver does it every few seconds); raises RunFailure if it is dead."""
        import ray

        for attempt in range(DEAD_CONFIRMATIONS):
            try:
                ray.get(self.cluster.buffer.address.remote(), timeout=ACTOR_TIMEOUT_S)
                return
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                return  # busy, or being restarted (calls wait for the new process): stats() keeps the time
            except ray.exceptions.RayActorError as exc:
                # a call in flight when the process died fails even if Ray restarts the actor: a fresh call
                # waits for the new process (or times out) unless the actor is gone for good
                if not self.restartable or attempt == DEAD_CONFIRMATIONS - 1:
                    self._dead(exc)
                time.sleep(0.5)

    def _not_answering(self, why: str) -> None:
        from async_rlhf.driver.fleet import RunFailure

        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            log.warning("buffer: not answering (%s)%s", why, "; waiting for Ray to restart it" if self.restartable
                        else "")
        self.check()
        if now - self.down_since > self.patience_s:
            raise RunFailure(f"the buffer at {self.cluster.buffer_address} has not answered for "
                             f"{now - self.down_since:.0f} s (buffer.redis_retry_s + buffer.request_timeout_s); "
                             f"last error: {why}")

    def _back(self, restarted: bool) -> None:
        """The buffer answers again; ``restarted``: by a new process (its uptime went back)."""
        down = "" if self.down_since is None else f" after {time.monotonic() - self.down_since:.1f} s"
        self.down_since = None
        if restarted:
            self.restarts += 1
            try:
                self.cluster.pin_buffer()  # the new process gets the buffer's cores and niceness again
            except Exception as exc:  # noqa: BLE001 - an unpinned buffer still serves: say so, go on
                log.warning("buffer: could not pin the restarted process to its cores: %r", exc)
            log.warning("buffer: restarted (%d of run.buffer_max_restarts=%d) and recovered from Redis; it "
                        "answers again%s", self.restarts, self.cluster.cfg.run.buffer_max_restarts, down)
        else:
            log.warning("buffer: answers again%s", down)

    def _dead(self, exc: Exception) -> None:
        from async_rlhf.driver.fleet import RunFailure
        from async_rlhf.run_logs import role_log_note

        if self.cluster.cfg.buffer.store == "redis":
            kept = (f"restarted {self.restarts} time(s), run.buffer_max_restarts="
                    f"{self.cluster.cfg.run.buffer_max_restarts}; the Redis store keeps its groups for --resume")
        else:
            kept = "the groups it held in memory are lost (buffer.store=redis survives this)"
        note = role_log_note(self.cluster.cfg.run.dir, "buffer")
        raise RunFailure(f"the buffer actor died ({type(exc).__name__}; {note}); {kept}") from exc
