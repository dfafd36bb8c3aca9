"""Learner rank 0's end of the weight push, off the training thread.

    training thread                         push thread (one)
    ---------------                         -----------------
    optimizer step -> weights are v + 1
    start(params, v + 1) ----------------->  sender.push(params, v + 1): broadcast to every generator (their
    next step: wait_data, forward/backward    receives are already posted), one allreduce of acknowledgements;
    wait() before the optimizer step <-----  a dead member is dropped and the push repeated without it;
      (the only time the learner waits       then tell the buffer v + 1 is held everywhere (admission opens
       on the fleet: time/push_wait_s)        one more batch)

The parameters are read in place, so the training thread must not write them (the optimizer step) before
:meth:`WeightPusher.wait` returns.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from async_rlhf.config import Config

log = logging.getLogger(__name__)


class WeightPusher:
    def __init__(self, cfg: Config, buckets: list, host: str, port: int, buffer_address: str) -> None:
        from async_rlhf.sync.sender import Sender

        self.cfg, self.buffer_address = cfg, buffer_address
        self.sender = Sender(buckets, host, port, cfg.sync.backend, cfg.sync.timeout_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-push")
        self._future: Future | None = None
        self._client: Any = None  # the push thread's own buffer client (a ZeroMQ socket is one thread's)

    def members_died(self, member_ids: list[str]) -> None:
        """Seen dead by the driver: a push in flight aborts at once and the next one leaves them out."""
        self.sender.fail_members(member_ids)

    def push(self, params: Mapping[str, Any], version: int) -> dict[str, float]:
        """Send ``version`` to every live generator, then publish it to the buffer; returns the push's metrics.
        A dead or hung member is named, dropped, and the push repeated on the rebuilt group."""
        from async_rlhf.sync.sender import PushError

        dropped: list[str] = []
        for _ in range(len(self.sender.members) + 2):
            try:
                metrics = self.sender.push(params, version)
                break
            except PushError as err:
                log.error("%s: rebuilding the push group without %s", err, err.failed_members)
                self.sender.drop(err.failed_members)
                dropped += err.failed_members
        else:
            raise RuntimeError(f"the weight push of version {version} kept failing; see the errors above")
        self._publish(version)
        return {**metrics, "sync/dropped": float(len(dropped))}

    def _publish(self, version: int) -> None:
        from async_rlhf.buffer.build import make_client
        from async_rlhf.buffer.client import with_retry

        if self._client is None:
            self._client = make_client(self.cfg, self.buffer_address, consumer="learner-push")
        patience = self.cfg.buffer.redis_retry_s + self.cfg.buffer.request_timeout_s
        with_retry(lambda: self._client.set_version(version), "set_version", patience)

    def start(self, params: Mapping[str, Any], version: int) -> None:
        """:meth:`push` on the push thread; returns at once (call :meth:`wait` before writing ``params``)."""
        if self._future is not None:
            raise RuntimeError("a push is still in flight: wait() for it first")
        self._future = self._pool.submit(self.push, params, version)

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def wait(self) -> dict[str, float]:
        """Block until the push in flight is done; its metrics (raises what it raised)."""
        future, self._future = self._future, None
        return future.result() if future is not None else {}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
