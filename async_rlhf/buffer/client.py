"""Client of the buffer service: one DEALER socket, one request at a time, every wait bounded.

Each client is a named consumer (``consumer``, by default unique to this process and socket): the service
records which consumer holds which delivered groups, so a dead learner's groups can be given to others.

The service may die and come back on the same address (a restarted buffer actor on the Redis store):
a dropped connection fails the request waiting on it at once (a socket monitor sees the disconnect),
requests are only queued on a live connection (``IMMEDIATE``), and callers retry with :func:`with_retry`
until a deadline. A get whose reply was lost is followed by a get naming the groups this client holds
(``holding``), so the service takes back the lost ones instead of leaving them delivered to no one.
Once the process is stopping (:func:`stop_retries`), every wait and retry ends within a short grace.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from async_rlhf.buffer.curve import CurveClientKeys, secure_client
from async_rlhf.buffer.frames import as_frames, frames_as_buffers, unpack_sizes
from async_rlhf.prompt_window import encode_windows
from async_rlhf.retry import retry
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


STOP_GRACE_S = 2.0
_stop_deadline: float | None = None
"""Monotonic time by which a stopping process's clients give up (None: not stopping)."""


def stop_retries(grace_s: float = STOP_GRACE_S) -> None:
    """This process is stopping: every request and retry of its clients gives up within ``grace_s`` from now
    (a generator told to stop must not retry a dead buffer for the full ``buffer.redis_retry_s``)."""
    global _stop_deadline
    _stop_deadline = time.monotonic() + grace_s


def _bounded(wait: float) -> float:
    """``wait``, cut to what is left of the stop grace once the process is stopping."""
    if _stop_deadline is None:
        return wait
    return max(0.05, min(wait, _stop_deadline - time.monotonic()))


def _left_ms(deadline: float) -> int:
    """Milliseconds to wait now: until ``deadline`` or the stop grace's end, in slices of at most 0.5 s (so a
    stop that comes during a wait cuts it short)."""
    end = deadline if _stop_deadline is None else min(deadline, _stop_deadline)
    return min(500, int((end - time.monotonic()) * 1000))


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
        self._unanswered_admit: str | None = None
        """Request id of an admit that got no reply; the next admit repeats it, so no slot is granted twice."""
        self._holding: dict[str, None] = {}
        """Ids this client received from gets and has not acknowledged yet (in order)."""
        self._reply_lost = False
        """A get failed without its reply: the next get names what it holds, the service takes back the rest."""
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no request queued for a dead connection, replayed after it
        if curve is not None:
            secure_client(self._sock, curve)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)

    def _disconnected(self) -> bool:
        """Whether the connection dropped since the last look (the events are consumed)."""
        dropped = False
        while self._monitor.poll(0):
            dropped = recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED or dropped
        return dropped

    def request(self, kind: str, timeout_s: float | None = None, parts: list[bytes] | None = None,
                **fields: Any) -> dict[str, Any]:
        """Send one request (``parts``: group frames after it) and wait for its reply.

        A reply's own frames after its header (the groups of a ``get``) are returned under ``"parts"``.
        """
        req_id = self.send_request(kind, timeout_s, parts, **fields)
        return self.wait_reply(kind, req_id, timeout_s)

    def send_request(self, kind: str, timeout_s: float | None = None, parts: list[bytes] | None = None,
                     **fields: Any) -> int:
        """The sending half of :meth:`request` (for pipelining: several sends, then their replies)."""
        req_id = next(self._ids)
        wait = _bounded(timeout_s if timeout_s is not None else self.timeout_s)
        self._disconnected()  # a drop before this request is not this request's failure
        if parts:
            fields["parts"] = len(parts)
        frames = [encode(kind, req_id=req_id, **fields), *(parts or [])]
        # a DEALER with no live peer (service down or restarting, a refused CURVE handshake) cannot send: wait
        # for a connection, bounded too
        deadline = time.monotonic() + wait
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)  # large frames: not copied
                return req_id
            except zmq.Again:
                left = _left_ms(deadline)
                if left <= 0:
                    raise BufferUnavailable(f"buffer service at {self.address} accepted no '{kind}' request "
                                            f"within {wait:g} s (no connection; for CURVE check the keys)") from None
                self._sock.poll(left, zmq.POLLOUT)

    def wait_reply(self, kind: str, req_id: int, timeout_s: float | None = None) -> dict[str, Any]:
        """The reply to request ``req_id``; replies to older requests (timed out, or pipelined) are skipped."""
        wait = _bounded(timeout_s if timeout_s is not None else self.timeout_s)
        deadline = time.monotonic() + wait
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            left_ms = _left_ms(deadline)
            ready = dict(poller.poll(left_ms)) if left_ms > 0 else {}
            if self._sock not in ready:
                if left_ms > 0 and not (self._monitor in ready and self._disconnected()):
                    continue  # another monitor event, or a slice of the wait passed
                if self._monitor in ready:
                    raise BufferUnavailable(f"the connection to the buffer service at {self.address} dropped "
                                            f"while waiting for a '{kind}' reply (the service died or restarts)")
                raise BufferUnavailable(
                    f"buffer service at {self.address} did not answer a '{kind}' request within "
                    f"{wait:g} s; check that it is running (buffer.request_timeout_s)"
                )
            frames = frames_as_buffers(self._sock.recv_multipart(copy=False))
            reply = decode(frames[0], self.max_bytes)
            if reply.get("req_id") not in (req_id, None):
                continue  # the late answer to a request that already timed out
            if reply["kind"] == "error":
                raise BufferRequestError(f"buffer refused '{kind}': {reply.get('detail')}")
            if reply.get("parts", 0) != len(frames) - 1:
                raise BufferRequestError(f"buffer reply to '{kind}' announced {reply.get('parts', 0)} parts "
                                         f"but carried {len(frames) - 1}")
            reply["parts"] = frames[1:]
            return reply

    # -- typed helpers -----------------------------------------------------------------------
    def admit(self, want: int) -> tuple[int, int]:
        """Ask for ``want`` new groups; returns (granted, learner version). Safe to call again after a timeout.

        Each admit carries a request id; when the reply is lost (BufferUnavailable) the next call repeats the
        same id and the service answers with its first grant instead of granting again.
        """
        rid = self._unanswered_admit = self._unanswered_admit or uuid.uuid4().hex
        r = self.request("admit", want=want, request_id=rid, holder=self.consumer)
        self._unanswered_admit = None
        granted, version = int(r["granted"]), int(r["version"])
        if granted > want:  # the repeated request had asked for more than this call wants
            self.release(granted - want)
            granted = want
        return granted, version

    def put(self, group: Group, *, full_wait_s: float | None = None, rewards_pending: bool = False) -> bool:
        """Hand over a finished group; True if stored, False if its id was already known (idempotent).

        With ``rewards_pending`` the group is kept (state ``awaiting_reward``) but not delivered until
        :meth:`reward` fills its rewards. While the buffer is at capacity the service answers "full"; the put
        is retried with a growing pause for up to ``full_wait_s`` (default: the client timeout), then
        :class:`BufferFull` is raised.
        """
        return self.put_many([group], full_wait_s=full_wait_s, rewards_pending=rewards_pending)[0]

    def put_many(self, groups: list[Group], *, full_wait_s: float | None = None,
                 rewards_pending: bool = False) -> list[bool]:
        """Hand over several groups in one request (one reply, one status per group); see :meth:`put`."""
        return self.put_encoded([encode_group(g) for g in groups], full_wait_s=full_wait_s,
                                rewards_pending=rewards_pending)

    def put_encoded(self, groups: list[bytes], *, full_wait_s: float | None = None,
                    rewards_pending: bool = False) -> list[bool]:
        """:meth:`put_many` of groups already encoded with :func:`encode_group` (True: stored, False: duplicate)."""
        accepted: list[bool | None] = [None] * len(groups)
        todo = list(range(len(groups)))
        deadline = time.monotonic() + (self.timeout_s if full_wait_s is None else full_wait_s)
        pause = 0.005
        while True:
            r = self._send_put([groups[i] for i in todo], rewards_pending, wait=True)
            full = []
            for i, status in zip(todo, r["status"], strict=True):
                if status == "full":
                    full.append(i)
                else:
                    accepted[i] = status == "ok"
            if not full:
                return [bool(a) for a in accepted]
            if time.monotonic() >= deadline:
                raise BufferFull(f"buffer at {self.address} stayed full for {full_wait_s or self.timeout_s:g} s")
            todo = full
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def put_pipelined(self, batches: Iterable[list[bytes]], window: int = 4, *,
                      rewards_pending: bool = False) -> Iterator[tuple[list[bytes], list[str]]]:
        """Puts of encoded batches with up to ``window`` requests in flight; yields (batch, statuses) in order.

        Statuses are ``ok``, ``duplicate`` or ``full`` (the caller puts those again later). The service
        answers requests of one connection in order, so the oldest reply is always the next to wait for.
        """
        inflight: deque[tuple[int, list[bytes]]] = deque()
        for batch in batches:
            if len(inflight) >= window:
                rid, sent = inflight.popleft()
                yield sent, self.wait_reply("put", rid)["status"]
            inflight.append((self._send_put(batch, rewards_pending), batch))
        while inflight:
            rid, sent = inflight.popleft()
            yield sent, self.wait_reply("put", rid)["status"]

    def _send_put(self, batch: list[bytes], rewards_pending: bool, wait: bool = False) -> Any:
        """Send one put of encoded groups; with ``wait``, its reply.

        Small groups travel packed: one frame of their bytes back to back and their ``sizes`` in the request
        (no msgpack list to build or decode); a batch with a large group goes as one frame each (no copy).
        """
        if as_frames(batch):
            rid = self.send_request("put", parts=batch, rewards_pending=rewards_pending, holder=self.consumer)
        else:
            rid = self.send_request("put", parts=[b"".join(batch)], sizes=[len(g) for g in batch],
                                    rewards_pending=rewards_pending, holder=self.consumer)
        return self.wait_reply("put", rid) if wait else rid

    def reward(self, group_id: str, rewards: list[float]) -> dict[str, Any]:
        """Late rewards (one per sample, in sample order) of a group put with ``rewards_pending``.

        Returns ``{"ok": True}`` once the group is deliverable, or ``{"ok": False, "reason": ...}`` for a
        group that is unknown, finished (trained, dropped, e.g. ``reward_timeout``) or already rewarded.
        A wrong number of rewards raises :class:`BufferRequestError`. Safe to repeat: a repeat answers
        ``already_rewarded``.
        """
        r = self.request("reward", group_id=group_id, rewards=[float(x) for x in rewards])
        return {"ok": bool(r["ok"]), "reason": r.get("reason"), "state": r.get("state")}

    def release(self, n: int) -> None:
        """Give back ``n`` admission slots this client holds (admitted, never to be put)."""
        self.request("release", n=n, holder=self.consumer)

    def abandon(self, group_ids: list[str]) -> list[str]:
        """Give up on the late rewards of these groups (put with rewards pending): the buffer drops them now with
        reason ``reward_abandoned`` (admission back at once); returns the ids it dropped."""
        return [str(g) for g in self.request("release", n=0, abandon=list(group_ids)).get("abandoned", [])]

    def release_holder(self, holder: str) -> int:
        """The generator whose client is named ``holder`` died: the service gives back exactly the admission
        slots it still held (granted, not put or released); returns how many."""
        return int(self.request("release", n=0, dead_holder=holder).get("released", 0))

    def declare_dead(self, consumer: str) -> int:
        """Tell the service that learner ``consumer`` died: its unacknowledged groups go to others now."""
        return int(self.request("release", n=0, consumer=consumer).get("redelivered", 0))

    def get(self, n: int, version: int, wait_s: float = 1.0, *, consumer: str | None = None) -> list[Group]:
        return [decode_group(g) for g in self.get_encoded(n, version, wait_s, consumer=consumer)[1]]

    def get_encoded(self, n: int, version: int, wait_s: float = 1.0, *, consumer: str | None = None,
                    at_least: int | None = None, ack: list[str] | None = None) -> tuple[list[str], list[bytes]]:
        """:meth:`get` without building the groups: (ids, msgpack bytes as the generator sent them).

        ``at_least`` (default ``n``): answer as soon as that many are held, with up to ``n``. ``ack``: ids
        trained on since the last get, acknowledged before this get is served (saves a round trip).
        """
        extra: dict[str, Any] = {} if at_least is None else {"at_least": at_least}
        if ack:
            extra["ack"] = list(ack)
        mine = consumer is None or consumer == self.consumer
        if mine and self._reply_lost:
            extra["holding"] = list(self._holding)
        try:
            r = self.request("get", timeout_s=wait_s + self.timeout_s, n=n, version=version, wait_s=wait_s,
                             consumer=consumer or self.consumer, as_bytes=True, packed=True, **extra)
        except BufferUnavailable:
            self._reply_lost = self._reply_lost or mine
            raise
        if mine:
            self._reply_lost = False
            self._forget(ack or [])
        if "sizes" in r:  # small groups, back to back in one frame: views of it, no copy
            ids, datas = list(r["ids"]), unpack_sizes(r["parts"], r["sizes"])
        else:
            ids, datas = list(r.get("ids", [])), r["parts"] or list(r.get("groups", []))
        if mine:
            self._holding.update(dict.fromkeys(map(str, ids)))
        return ids, datas

    def _forget(self, group_ids: list[str], consumer: str | None = None) -> None:
        """Acknowledged ids are no longer held (acks for another consumer name change nothing here)."""
        if consumer is None or consumer == self.consumer:
            for gid in group_ids:
                self._holding.pop(str(gid), None)

    def ack(self, group_ids: list[str], *, consumer: str | None = None) -> int:
        acked = int(self.request("ack", group_ids=list(group_ids), consumer=consumer or self.consumer)["acked"])
        self._forget(group_ids, consumer)
        return acked

    def ack_consumed(self, group_ids: list[str]) -> list[str]:
        """:meth:`ack`, returning the ids of groups the buffer dropped as uninformative (zero_advantage) since
        the last ack of any consumer: used up without training (the learner reports them as skipped)."""
        r = self.request("ack", group_ids=list(group_ids), consumer=self.consumer)
        self._forget(group_ids)
        return [str(g) for g in r.get("consumed", [])]

    def renew(self, group_ids: list[str], *, consumer: str | None = None) -> list[str]:
        """Renew this consumer's lease on ``group_ids`` (it is still training them: the buffer does not hand them
        to another learner when the visibility timeout passes); returns the ids it no longer holds."""
        r = self.request("renew", group_ids=list(group_ids), consumer=consumer or self.consumer)
        return [str(g) for g in r.get("lost", [])]

    def set_version(self, version: int) -> None:
        self.request("set_version", version=version)

    def stats(self, ledger: bool = False, timeout_s: float | None = None,
              ledger_of: Mapping[int, tuple[int, Iterable[int]]] | None = None) -> dict[str, Any]:
        """Counters; ``ledger``: group ids by state, only those open in ``ledger_of`` (``prompt_window``) if given."""
        extra = {} if ledger_of is None else {"ledger_of": encode_windows(ledger_of)}
        r = self.request("stats", timeout_s=timeout_s, ledger=ledger, **extra)
        return {k: v for k, v in r.items() if k not in ("schema", "kind", "req_id", "parts")}


def encode_group(group: Group) -> bytes:
    """A group's wire form as the msgpack bytes the buffer stores and hands to learners unchanged."""
    return msgpack.packb(group.to_wire(views=True), use_bin_type=True)  # one copy: into the message


def decode_group(data: bytes | memoryview) -> Group:
    return Group.from_wire(msgpack.unpackb(data, raw=False, strict_map_key=True))


def with_retry(call: Callable[[], T], what: str, give_up_after_s: float) -> T:
    """Retry ``call`` while the buffer is unreachable (restarting, or full) for up to ``give_up_after_s``.

    Every request a retry can repeat is idempotent on the service side (puts by group id, acks by id,
    versions by value), so a reply lost in a restart is harmless.
    """
    def stopping() -> bool:
        return _stop_deadline is not None and time.monotonic() >= _stop_deadline

    try:  # up to 2 s apart: a restarted service is back within seconds, look again soon
        return retry(call, (BufferUnavailable,), give_up_after_s, first_delay_s=0.1, max_delay_s=2.0,
                     should_stop=stopping,
                     on_retry=lambda exc, delay, _left: log.warning("%s: %s; retrying in %.1f s", what, exc, delay))
    except BufferUnavailable as exc:
        after = "as this process stops" if stopping() else f"after {give_up_after_s:g} s"
        raise BufferUnavailable(f"{what}: gave up {after}: {exc}") from exc
