"""The buffer service: one ZeroMQ ROUTER socket in front of :class:`BufferLogic` (store, staleness rule, ledger).

    generator (DEALER) --admit/put/release--> +----------------+ <--get/ack/set_version-- learner (DEALER)
                                              | ROUTER socket  |
    launcher  (DEALER) --stats/release------> | BufferLogic    |
                                              |  store, ledger |
                                              +----------------+

Frames (after the ROUTER identity)::

    request   [msgpack request]                       every kind; a put carries one group map ("group") or
                                                      a list of groups' msgpack bytes ("groups"), or
              [put parts=1 sizes=[..]] [g1 g2 .. gk]   k small groups packed in one frame (the client's way), or
              [put parts=k, rewards_pending] [g1]..[gk]   k groups as frames (batches with a large group)
    reply     [msgpack reply]                         a get with as_bytes: ids=[...] and groups=[bytes...], or
              [reply ids=[..] sizes=[..] parts=1] [g1..gk]   packed (a get with packed=true), or
              [reply ids=[...] parts=k] [g1]..[gk]     parts=k frames (large groups are never copied)

Every request carries ``req_id``; the reply echoes it. A put answers for each group ``ok``, ``duplicate``
(its id is known in any state: a retried put is harmless) or ``full``; an ``admit`` may carry a
``request_id`` that makes its retry return the first answer. ``get`` is a long poll: the service parks it
until enough fresh groups are held or its ``wait_s`` passes (then it answers with what it has, possibly
nothing). ``get`` and ``ack`` name a ``consumer`` (the learner); a group delivered to a consumer that does
not ack within ``visibility_timeout_s``, or whose consumer is declared dead (``release`` with a
``consumer`` field), goes back to the held groups and is delivered again. A client that lost the reply to a
get (the service restarted, or it gave up waiting) sends its next get with ``holding``, the ids it received
and has not acknowledged: every other group delivered to it is taken back (reclaim) before that get is served.

A malformed, oversized or unknown message is answered with ``error`` where a reply address is known,
counted by reason and logged; the loop never stops on bad input. The socket binds to loopback unless
CURVE keys are given (see curve.py); frames above the size limit are cut off by ZeroMQ itself
(``MAXMSGSIZE`` drops the connection, counted by no one, answered to no one).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from async_rlhf.buffer.curve import LOOPBACK, CurveServerKeys, secure_server
from async_rlhf.buffer.frames import as_frames, frames_as_buffers, unpack_sizes
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.prompt_window import Windows, decode_windows
from async_rlhf.wire import WireError, decode, encode

log = logging.getLogger(__name__)

__all__ = ["BufferLogic", "BufferService", "PendingGet"]

TICK_S = 0.2
BURST_S = 0.01
MAX_CONSUMER_NAME = 200


@dataclass
class PendingGet:
    identity: bytes
    req_id: int
    n: int
    version: int
    deadline: float
    consumer: str
    t_recv: float
    at_least: int | None = None
    as_bytes: bool = False
    """Answer with each group's msgpack bytes as stored (the current client) instead of decoded maps."""
    packed: bool = False
    """The client takes small groups packed (one frame, their ``sizes`` in the reply; see frames.py)."""


def _consumer(msg: dict[str, Any]) -> str:
    name = msg.get("consumer")
    if name is None:
        return "anon"
    if not isinstance(name, str) or not name or len(name) > MAX_CONSUMER_NAME or name.startswith("_"):
        raise WireError("malformed", f"consumer must be a name of 1-{MAX_CONSUMER_NAME} characters not "
                                     "starting with '_'")
    return name


class BufferService:
    """Runs :class:`BufferLogic` behind a ROUTER socket on a background thread."""

    def __init__(self, logic: BufferLogic, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 << 20, curve: CurveServerKeys | None = None) -> None:
        if host not in LOOPBACK and curve is None:
            raise ValueError(
                f"buffer.host={host} would expose the buffer beyond this machine without authentication; "
                "bind to 127.0.0.1, or set buffer.curve=true with CURVE keys (buffer.curve_secret_key, "
                "buffer.curve_public_key, buffer.curve_client_keys)"
            )
        self.logic = logic
        self.max_bytes = max_message_bytes
        self.curve = curve is not None
        # a CURVE server gets its own context: the ZAP handler is per context
        self._ctx = zmq.Context() if curve else zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._auth = secure_server(self._ctx, self._sock, curve) if curve else None
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 4096)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
            self.port = port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{self.port}"
        self._pending: list[PendingGet] = []
        self._lock = threading.Lock()  # the socket thread and in-process callers (see call) share logic
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="buffer-service", daemon=True)

    def start(self) -> BufferService:
        self._thread.start()
        log.info("buffer service listening on %s (store %s, policy %s%s)", self.address, self.logic.store.name,
                 self.logic.policy, ", CURVE" if self.curve else "")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is None:  # never started: the socket is still ours to close
            self._sock.close(0)
        else:
            self._thread.join(timeout=5)
        if self._auth is not None:
            self._auth.stop()
            self._ctx.term()

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the logic from another thread of this process, safely."""
        with self._lock:
            return fn(*args)

    def _reply(self, identity: bytes, kind: str, req_id: Any, parts: list[bytes] | None = None,
               **fields: Any) -> None:
        """One reply frame, then ``parts`` (group bytes sent as they are stored, without copying)."""
        header = encode(kind, req_id=req_id, **fields, **({"parts": len(parts)} if parts else {}))
        # copy=False: pyzmq still copies frames below its threshold (64 KB), larger ones are sent from our memory
        self._sock.send_multipart([identity, header, *(parts or [])], copy=False)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        while not self._stop.is_set():
            try:
                if poller.poll(timeout=5):
                    burst_end = time.monotonic() + BURST_S
                    for _ in range(256):  # drain a burst before looking at parked gets
                        if time.monotonic() > burst_end:
                            break  # big puts pouring in must not starve the learners' parked gets
                        try:
                            frames = frames_as_buffers(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
                        except zmq.Again:
                            break
                        with self._lock:
                            self._handle(frames)
                with self._lock:
                    if time.monotonic() >= next_tick:
                        next_tick = time.monotonic() + TICK_S
                        self.logic.tick()
                    self._serve_pending()
            except Exception:  # e.g. the store gave up waiting for Redis: keep serving, report it
                self.logic.rejects["internal"] += 1
                log.exception("buffer: the service loop failed; continuing")
                time.sleep(0.05)
        self._sock.close(0)

    def _handle(self, frames: list[Any]) -> None:
        t0 = time.perf_counter()
        if len(frames) < 2:
            self.logic.rejects["malformed"] += 1
            log.warning("buffer: rejected a request of %d frames (expected 1 after the identity)", len(frames) - 1)
            if frames:
                self._reply(frames[0], "error", None, reason="malformed", detail="send exactly one frame")
            return
        identity, frame, parts = bytes(frames[0]), frames[1], frames[2:]
        req_id = None
        try:
            msg = decode(frame, self.max_bytes)
            req_id = msg.get("req_id")
            if parts:
                _check_parts(msg, parts, self.max_bytes)
            kind = self._dispatch(identity, msg, t0, parts)
            if kind != "get":
                self.logic.record_latency(kind, time.perf_counter() - t0)
        except WireError as exc:
            self.logic.rejects[exc.reason] += 1
            log.warning("buffer: rejected a message: %s", exc)
            self._reply(identity, "error", req_id, reason=exc.reason, detail=str(exc))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            self.logic.rejects["malformed"] += 1
            log.warning("buffer: rejected a request with a missing or bad field: %r", exc)
            self._reply(identity, "error", req_id, reason="malformed", detail=f"missing or bad field: {exc!r}")
        except Exception as exc:  # a bug in handling, or Redis gone for too long: the service stays up
            self.logic.rejects["internal"] += 1
            log.exception("buffer: failed to handle a request")
            self._reply(identity, "error", req_id, reason="internal", detail=repr(exc))

    def _dispatch(self, identity: bytes, msg: dict[str, Any], t_recv: float, parts: list[bytes]) -> str:
        kind, req_id, logic = msg["kind"], msg.get("req_id"), self.logic
        if kind == "get":
            if msg.get("ack"):  # the previous batch's ack rides on the next get: one round trip per batch
                logic.ack(list(msg["ack"]))
            if "holding" in msg:  # the client lost a reply: what it does not hold goes back to the held groups
                consumer = _consumer(msg)
                self._pending = [p for p in self._pending if p.consumer != consumer]  # gets it gave up on
                logic.reclaim(consumer, _ids(msg, "holding"))
            wait_s = float(msg.get("wait_s", 0.0))
            wait_s = min(wait_s, 60.0) if math.isfinite(wait_s) and wait_s > 0 else 0.0
            self._pending.append(PendingGet(identity, req_id, _count(msg, "n"), _count(msg, "version"),
                                            time.monotonic() + wait_s, _consumer(msg), t_recv,
                                            _count(msg, "at_least") if "at_least" in msg else None,
                                            msg.get("as_bytes") is True, msg.get("packed") is True))
            self._serve_pending()
            return kind
        if kind == "admit":
            out = logic.admit(_count(msg, "want"), _request_id(msg), _holder(msg))
        elif kind == "put":
            out = self._put(msg, parts)
        elif kind == "reward":
            out = logic.reward(msg.get("group_id"), msg.get("rewards"))
        elif kind == "release" and "abandon" in msg:  # a draining generator gives up on these late rewards
            out = logic.abandon(_ids(msg, "abandon"))
        elif kind == "release" and "dead_holder" in msg:  # the driver: that generator died
            out = logic.release_holder(_consumer({"consumer": msg["dead_holder"]}))
        elif kind == "release":
            consumer = msg.get("consumer")
            out = logic.release(_count(msg, "n"), _consumer(msg) if consumer is not None else None, _holder(msg))
        elif kind == "ack":
            _consumer(msg)
            out = logic.ack(list(msg.get("group_ids") or []))
        elif kind == "renew":
            out = logic.renew(_consumer(msg), _ids(msg, "group_ids"))
        elif kind == "set_version":
            out = logic.set_version(_count(msg, "version"))
        elif kind == "stats":
            out = logic.stats(bool(msg.get("ledger", False)), _windows(msg))
        else:
            raise WireError("unknown_kind", f"the service does not accept {kind!r} requests")
        self._reply(identity, "reply", req_id, **out)
        return kind

    def _put(self, msg: dict[str, Any], parts: list[bytes]) -> dict[str, Any]:
        """One group as a map (``group``), or many as msgpack bytes (``groups``, or frames after the request):
        one status per group. A batch is checked whole before anything is stored: one malformed group
        refuses the request.
        """
        pending = msg.get("rewards_pending", False)
        if not isinstance(pending, bool):
            raise WireError("malformed", "rewards_pending must be true or false")
        holder = _holder(msg)
        if "sizes" in msg:  # small groups back to back in one frame; copied out, so none pins the whole frame
            return {"status": self.logic.put_many(unpack_sizes(parts, msg["sizes"], copy=True), pending, holder)}
        if parts:
            return {"status": self.logic.put_many(parts, pending, holder)}
        if "groups" not in msg:
            return self.logic.put(msg.get("group"), pending, holder)
        groups = msg["groups"]
        if not isinstance(groups, list) or not groups or not all(isinstance(g, bytes) for g in groups):
            raise WireError("malformed", "groups must be a non-empty list of msgpack-encoded groups (bytes)")
        return {"status": self.logic.put_many(groups, pending, holder)}

    def _serve_pending(self) -> None:
        if not self._pending:
            return
        now, still = time.monotonic(), []
        for p in self._pending:
            t0 = time.perf_counter()
            taken = self.logic.take(p.n, p.version, p.consumer, p.at_least)
            if taken is not None:
                if p.as_bytes:  # the stored bytes, inline or as frames; the ids let a consumer ack without decoding
                    datas, ids = [g.data for g in taken], [g.group_id for g in taken]
                    if as_frames(datas):
                        self._reply(p.identity, "reply", p.req_id, datas, ids=ids)
                    elif p.packed:  # one copy (the join) instead of msgpack's; the client keeps views of it
                        self._reply(p.identity, "reply", p.req_id, [b"".join(datas)], ids=ids,
                                    sizes=[len(d) for d in datas])
                    else:
                        self._reply(p.identity, "reply", p.req_id, groups=datas, ids=ids)
                else:
                    self._reply(p.identity, "reply", p.req_id, groups=[msgpack.unpackb(g.data) for g in taken])
                # handling time of the call that answered (a parked get's wait is not service latency)
                self.logic.record_latency("get", time.perf_counter() - t0)
            elif now >= p.deadline:
                self._reply(p.identity, "reply", p.req_id, groups=[], ids=[])
            else:
                still.append(p)
        self._pending = still


MAX_COUNT = 1 << 40  # far above any real version or group count, far below what msgpack's int64 overflows at


def _check_parts(msg: dict[str, Any], parts: list[bytes], max_bytes: int) -> None:
    """Frames after the request are allowed only as the groups of a put that announces their number."""
    if msg.get("kind") != "put" or msg.get("parts") != len(parts):
        raise WireError("malformed", f"send exactly one frame (or a put with parts={len(parts)} and "
                                     f"{len(parts)} group frames)")
    total = sum(len(p) for p in parts)
    if total > max_bytes:
        raise WireError("oversized", f"{total} bytes of groups exceed the limit of {max_bytes}")


def _holder(msg: dict[str, Any]) -> str | None:
    """The name of the client that holds admission slots (a generator's), if the request gives one."""
    return _consumer({"consumer": msg["holder"]}) if msg.get("holder") is not None else None


def _request_id(msg: dict[str, Any]) -> str | None:
    rid = msg.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= MAX_CONSUMER_NAME):
        raise WireError("malformed", f"request_id must be a string of 1-{MAX_CONSUMER_NAME} characters")
    return rid


def _windows(msg: dict[str, Any]) -> Windows | None:
    """A stats request's ``ledger_of`` (the driver's open ledger), checked."""
    if "ledger_of" not in msg:
        return None
    try:
        return decode_windows(msg["ledger_of"])
    except ValueError as exc:
        raise WireError("malformed", str(exc)) from None


def _ids(msg: dict[str, Any], key: str) -> list[str]:
    """A list of group ids (strings)."""
    value = msg[key]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise WireError("malformed", f"field {key!r} must be a list of group ids (strings)")
    return value


def _count(msg: dict[str, Any], key: str) -> int:
    """A non-negative integer field; anything else (a float, a bool, 2**63) is a malformed request."""
    value = msg[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise WireError("malformed", f"field {key!r} must be an integer in [0, 2**40), got {value!r}")
    return value
