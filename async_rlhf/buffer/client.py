"""Client of the buffer service: one DEALER socket, one request at a time, every wait bounded.

Each client is a named consumer (``consumer``, by default unique to this process and socket): the service
records which consumer holds which delivered groups, so a dead learner's groups can be given to others.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from async_rlhf.buffer.curve import CurveClientKeys, secure_client
from async_rlhf.types import Group
from async_rlhf.wire import decode, encode

log = logging.getLogger(__name__)
T = TypeVar("T")


class BufferUnavailable(RuntimeError):
    """The service did not answer in time: it is down, overloaded or at the wrong address."""


class BufferFull(BufferUnavailable):
    """The buffer stayed at its capacity for the whole wait: learners are not keeping up."""


class BufferRequestError(RuntimeError):
    """The service refused a request; the message carries its reason."""


def default_consumer_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class BufferClient:
    def __init__(self, address: str, timeout_s: float = 30.0, max_message_bytes: int = 64 << 20, *,
                 consumer: str | None = None, curve: CurveClientKeys | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.max_bytes = max_message_bytes
        self.consumer = consumer or default_consumer_name()
        self._ids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            secure_client(self._sock, curve)
        self._sock.connect(address)

    def close(self) -> None:
        self._sock.close(0)

    def request(self, kind: str, timeout_s: float | None = None, **fields: Any) -> dict[str, Any]:
        req_id = next(self._ids)
        wait = timeout_s if timeout_s is not None else self.timeout_s
        deadline = time.monotonic() + wait
        # a DEALER with no live peer (e.g. a refused CURVE handshake) blocks in send: bound that wait too
        self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(wait * 1000)))
        try:
            self._sock.send(encode(kind, req_id=req_id, **fields))
        except zmq.Again:
            raise BufferUnavailable(f"buffer service at {self.address} accepted no '{kind}' request within "
                                    f"{wait:g} s (no connection; for CURVE check the keys)") from None
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms):
                raise BufferUnavailable(
                    f"buffer service at {self.address} did not answer a '{kind}' request within "
                    f"{timeout_s or self.timeout_s:g} s; check that it is running (buffer.request_timeout_s)"
                )
            reply = decode(self._sock.recv(), self.max_bytes)
            if reply.get("req_id") not in (req_id, None):
                continue  # the late answer to a request that already timed out
            if reply["kind"] == "error":
                raise BufferRequestError(f"buffer refused '{kind}': {reply.get('detail')}")
            return reply

    # -- typed helpers -----------------------------------------------------------------------
    def admit(self, want: int) -> tuple[int, int]:
        r = self.request("admit", want=want)
        return int(r["granted"]), int(r["version"])

    def put(self, group: Group, *, full_wait_s: float | None = None) -> bool:
        """Hand over a finished group; True if stored, False if its id was already known (idempotent).

        While the buffer is at capacity the service answers "full"; the put is retried with a growing pause
        for up to ``full_wait_s`` (default: the client timeout), then :class:`BufferFull` is raised.
        """
        wire = group.to_wire()
        deadline = time.monotonic() + (self.timeout_s if full_wait_s is None else full_wait_s)
        pause = 0.005
        while True:
            r = self.request("put", group=wire)
            if not r.get("full"):
                return bool(r["accepted"])
            if time.monotonic() >= deadline:
                raise BufferFull(f"buffer at {self.address} stayed full for {full_wait_s or self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def release(self, n: int) -> None:
        self.request("release", n=n)

    def declare_dead(self, consumer: str) -> int:
        """Tell the service that learner ``consumer`` died: its unacknowledged groups go to others now."""
        return int(self.request("release", n=0, consumer=consumer).get("redelivered", 0))

    def get(self, n: int, version: int, wait_s: float = 1.0, *, consumer: str | None = None) -> list[Group]:
        r = self.request("get", timeout_s=wait_s + self.timeout_s, n=n, version=version, wait_s=wait_s,
                         consumer=consumer or self.consumer)
        return [Group.from_wire(g) for g in r["groups"]]

    def ack(self, group_ids: list[str], *, consumer: str | None = None) -> int:
        return int(self.request("ack", group_ids=list(group_ids), consumer=consumer or self.consumer)["acked"])

    def set_version(self, version: int) -> None:
        self.request("set_version", version=version)

    def stats(self, ledger: bool = False) -> dict[str, Any]:
        r = self.request("stats", ledger=ledger)
        return {k: v for k, v in r.items() if k not in ("schema", "kind", "req_id")}


def with_retry(call: Callable[[], T], what: str, give_up_after_s: float) -> T:
    """Retry ``call`` while the buffer is unreachable (restarting, or full) for up to ``give_up_after_s``.

    Every request a retry can repeat is idempotent on the service side (puts by group id, acks by id,
    versions by value), so a reply lost in a restart is harmless.
    """
    deadline = time.monotonic() + give_up_after_s
    delay = 0.1
    while True:
        try:
            return call()
        except BufferUnavailable as exc:
            if time.monotonic() >= deadline:
                raise BufferUnavailable(f"{what}: gave up after {give_up_after_s:g} s: {exc}") from exc
            log.warning("%s: %s; retrying in %.1f s", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
