"""The buffer service: one ZeroMQ ROUTER socket in front of a store, the staleness rule and a ledger.

    generator (DEALER) --admit/put/release--> +----------------+ <--get/ack/set_version-- learner (DEALER)
                                              | ROUTER socket  |
    launcher  (DEALER) --stats--------------> | BufferLogic    |
                                              |  store, ledger |
                                              +----------------+

Every request carries ``req_id``; the reply echoes it. ``get`` is a long poll: the service parks it
until enough fresh groups are held or its ``wait_s`` passes (then it answers with what it has, possibly
nothing). A malformed, oversized or unknown message is answered with ``error`` where a reply address is
known, counted by reason and logged; the loop never stops on bad input.

The ledger makes the accounting exact: every group id is, at any time, in exactly one of
held (in the store), delivered (to a learner, not yet acknowledged), trained (acknowledged), or dropped
(with a reason).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq

from async_rlhf.buffer.admission import AdmissionControl, is_stale, staleness
from async_rlhf.buffer.store import Store, StoredGroup
from async_rlhf.types import Group
from async_rlhf.wire import WireError, decode, encode

log = logging.getLogger(__name__)


@dataclass
class PendingGet:
    identity: bytes
    req_id: int
    n: int
    version: int
    deadline: float


class BufferLogic:
    """Everything the service decides, without sockets (unit tests drive it directly)."""

    def __init__(self, store: Store, groups_per_version: int, max_staleness: int) -> None:
        self.store = store
        self.max_staleness = max_staleness
        self.admission = AdmissionControl(groups_per_version, max_staleness)
        self.counters: Counter[str] = Counter()
        self.rejects: Counter[str] = Counter()
        self.delivered: dict[str, int] = {}  # group id -> learner version it was delivered at
        self.trained: set[str] = set()
        self.dropped: dict[str, str] = {}    # group id -> reason
        self.staleness_hist: Counter[int] = Counter()
        self.started = time.time()

    # -- generators -------------------------------------------------------------------------
    def admit(self, want: int) -> dict[str, Any]:
        granted = self.admission.admit(max(0, int(want)))
        self.counters["admitted"] += granted
        return {"granted": granted, "version": self.admission.version}

    def release(self, n: int) -> dict[str, Any]:
        self.admission.release(max(0, int(n)))
        return {}

    def put(self, wire_group: Any) -> dict[str, Any]:
        group = Group.from_wire(wire_group)  # validates; raises WireError
        gid = group.group_id
        if gid in self.delivered or gid in self.trained or gid in self.dropped:
            self.counters["duplicate_put"] += 1
            return {"accepted": False, "duplicate": True}
        stored = StoredGroup(gid, group.min_version, len(group.samples), group.num_tokens, wire_group)
        if not self.store.put(stored):
            self.counters["duplicate_put"] += 1
            return {"accepted": False, "duplicate": True}
        self.admission.finished()
        self.counters["put"] += 1
        self.counters["put_tokens"] += group.num_tokens
        return {"accepted": True, "duplicate": False}

    # -- learners ---------------------------------------------------------------------------
    def drop_stale(self, version: int) -> int:
        stale = [g for g in self.store.peek_all() if is_stale(version, g.min_version, self.max_staleness)]
        if stale:
            self.store.remove([g.group_id for g in stale])
            for g in stale:
                self.dropped[g.group_id] = "stale"
            self.admission.dropped(len(stale))
            self.counters["dropped_stale"] += len(stale)
        return len(stale)

    def try_get(self, n: int, version: int) -> list[dict[str, Any]] | None:
        """``n`` fresh groups for a learner at ``version``, or None while fewer are held."""
        self.drop_stale(version)
        if len(self.store) < n:
            return None
        taken = self.store.take(n)
        for g in taken:
            self.delivered[g.group_id] = version
            self.staleness_hist[staleness(version, g.min_version)] += 1
        self.counters["delivered"] += len(taken)
        return [g.wire for g in taken]

    def ack(self, group_ids: list[Any]) -> dict[str, Any]:
        fresh = 0
        for gid in map(str, group_ids):
            if gid in self.trained:
                self.counters["duplicate_ack"] += 1
                continue
            if self.delivered.pop(gid, None) is None:
                self.counters["unknown_ack"] += 1
                continue
            self.trained.add(gid)
            fresh += 1
        self.counters["trained"] += fresh
        return {"acked": fresh}

    def drop_held(self, reason: str) -> int:
        """Mark every held group dropped (end of a run: generated, never trained)."""
        held = self.store.take(len(self.store))
        for g in held:
            self.dropped[g.group_id] = reason
        self.admission.dropped(len(held))
        self.counters[f"dropped_{reason}"] += len(held)
        return len(held)

    def set_version(self, version: int) -> dict[str, Any]:
        self.admission.set_version(int(version))
        return {"version": self.admission.version}

    def stats(self, ledger: bool = False) -> dict[str, Any]:
        a = self.admission
        out: dict[str, Any] = {
            "buffer/depth": len(self.store),
            "buffer/version": a.version,
            "buffer/accepted": a.accepted,
            "buffer/running": a.running,
            "buffer/capacity": a.capacity,
            "buffer/delivered_unacked": len(self.delivered),
            **{f"buffer/{k}": v for k, v in self.counters.items()},
            **{f"buffer/reject_{k}": v for k, v in self.rejects.items()},
            "staleness/hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "buffer/uptime_s": time.time() - self.started,
        }
        if ledger:
            out["ledger"] = {
                "held": [g.group_id for g in self.store.peek_all()],
                "delivered": sorted(self.delivered),
                "trained": sorted(self.trained),
                "dropped": dict(self.dropped),
            }
        return out


class BufferService:
    """Runs :class:`BufferLogic` behind a ROUTER socket on a background thread."""

    def __init__(self, logic: BufferLogic, host: str = "127.0.0.1", port: int = 0,
                 max_message_bytes: int = 64 << 20) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"buffer.host={host} would expose the buffer beyond this machine without authentication; "
                "bind to 127.0.0.1 (CURVE-authenticated remote binding is not available in this build)"
            )
        self.logic = logic
        self.max_bytes = max_message_bytes
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
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
        log.info("buffer service listening on %s", self.address)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the logic from another thread of this process, safely."""
        with self._lock:
            return fn(*args)

    def _reply(self, identity: bytes, kind: str, req_id: Any, **fields: Any) -> None:
        self._sock.send_multipart([identity, encode(kind, req_id=req_id, **fields)])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(timeout=5):
                for _ in range(256):  # drain a burst before looking at parked gets
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._handle(frames)
            with self._lock:
                self._serve_pending()
        self._sock.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.logic.rejects["malformed"] += 1
            log.warning("buffer: rejected a request of %d frames (expected 1 after the identity)", len(frames) - 1)
            if frames:
                self._reply(frames[0], "error", None, reason="malformed", detail="send exactly one frame")
            return
        identity, frame = frames
        req_id = None
        try:
            msg = decode(frame, self.max_bytes)
            req_id = msg.get("req_id")
            self._dispatch(identity, msg)
        except WireError as exc:
            self.logic.rejects[exc.reason] += 1
            log.warning("buffer: rejected a message: %s", exc)
            self._reply(identity, "error", req_id, reason=exc.reason, detail=str(exc))
        except (KeyError, TypeError, ValueError) as exc:
            self.logic.rejects["malformed"] += 1
            log.warning("buffer: rejected a request with a missing or bad field: %r", exc)
            self._reply(identity, "error", req_id, reason="malformed", detail=f"missing or bad field: {exc!r}")
        except Exception as exc:  # a bug in handling must not take the service down
            self.logic.rejects["internal"] += 1
            log.exception("buffer: failed to handle a request")
            self._reply(identity, "error", req_id, reason="internal", detail=repr(exc))

    def _dispatch(self, identity: bytes, msg: dict[str, Any]) -> None:
        kind, req_id, logic = msg["kind"], msg.get("req_id"), self.logic
        if kind == "get":
            wait_s = float(msg.get("wait_s", 0.0))
            wait_s = min(wait_s, 60.0) if math.isfinite(wait_s) and wait_s > 0 else 0.0
            self._pending.append(PendingGet(identity, req_id, int(msg["n"]), int(msg["version"]),
                                            time.monotonic() + wait_s))
            self._serve_pending()
            return
        if kind == "admit":
            out = logic.admit(msg["want"])
        elif kind == "put":
            out = logic.put(msg.get("group"))
        elif kind == "release":
            out = logic.release(msg["n"])
        elif kind == "ack":
            out = logic.ack(list(msg.get("group_ids") or []))
        elif kind == "set_version":
            out = logic.set_version(msg["version"])
        elif kind == "stats":
            out = logic.stats(bool(msg.get("ledger", False)))
        else:
            raise WireError("unknown_kind", f"the service does not accept {kind!r} requests")
        self._reply(identity, "reply", req_id, **out)

    def _serve_pending(self) -> None:
        if not self._pending:
            return
        now, still = time.monotonic(), []
        for p in self._pending:
            groups = self.logic.try_get(p.n, p.version)
            if groups is not None:
                self._reply(p.identity, "reply", p.req_id, groups=groups)
            elif now >= p.deadline:
                self._reply(p.identity, "reply", p.req_id, groups=[])
            else:
                still.append(p)
        self._pending = still
