"""The run's control endpoint: a ZeroMQ ROUTER on loopback whose address the driver writes to
``run_dir/control.json``, and its client (:func:`send_control`, what ``launch/cluster.py scale|stop`` use)::

    python launch/cluster.py scale --run-dir runs/demo --generators 2

Messages are JSON objects (never pickled): ``{"op": "scale", "generators": 2}``, ``{"op": "stop"}`` (end the
run early with a checkpoint), ``{"op": "status"}`` or ``{"op": "pids"}`` (process ids of the learner ranks,
generators and the buffer, e.g. to send one a signal in a fault test). A request is one frame of at most
``MAX_REQUEST_BYTES`` (ZeroMQ drops a peer that sends more); anything else (not JSON, not an object, an
unknown op or key, a target that is not a strict integer or more than the cluster can place, several frames)
is answered ``{"ok": false, "error": ...}`` and the endpoint keeps serving.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rlhf.driver.handles import FleetControl

log = logging.getLogger(__name__)

CONTROL_FILE = "control.json"
MAX_REQUEST_BYTES = 64 << 10
OPS = {"scale": {"generators"}, "stop": set(), "status": set(), "pids": set()}
"""Each op and the keys it takes besides ``op``."""


class RequestError(ValueError):
    """A control request that cannot be served; the message says what a valid one looks like."""


def parse_request(raw: bytes, max_generators: Callable[[], int]) -> dict[str, Any]:
    """The request in ``raw``, checked: a JSON object with a known ``op``, only that op's keys, and for
    ``scale`` a strict integer between 1 and ``max_generators()`` (asked only for a scale request: it reads
    the cluster's free resources)."""
    try:
        msg = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RequestError(f"not a JSON request ({type(exc).__name__}); send e.g. {{\"op\": \"status\"}}") from None
    if type(msg) is not dict:
        raise RequestError(f"a request is a JSON object such as {{\"op\": \"status\"}}, not {type(msg).__name__}")
    op = msg.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise RequestError(f"unknown op {str(op)[:40]!r}; use {', '.join(OPS)}")
    extra = set(msg) - OPS[op] - {"op"}
    if extra:
        raise RequestError(f"op {op} takes {sorted(OPS[op]) or 'no other keys'}, not {sorted(extra)[:5]}")
    if op == "scale":
        n = msg.get("generators")
        if type(n) is not int:  # not bool, float, str: "3" or 2.9 or true are refused, not guessed
            raise RequestError(f"scale needs generators, an integer; got {str(n)[:40]!r}")
        if n < 1 or n > (limit := max_generators()):
            bound = "at least 1" if n < 1 else f"at most {limit} (what this cluster can place now)"
            raise RequestError(f"generators must be {bound}, got {n if abs(n) < 10**12 else 'a huge number'}")
    return msg


class ControlServer:
    """ZeroMQ ROUTER on loopback answering scale, stop, status and pids requests for one :class:`Fleet`.

    A ROUTER, not a REP: a peer that sends several frames or never reads its reply cannot wedge the socket's
    request/reply state for everyone else (``send_control``'s REQ socket talks to it unchanged)."""

    def __init__(self, fleet: FleetControl, run_dir: Path, host: str = "127.0.0.1") -> None:
        import zmq

        self.fleet = fleet
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)  # a larger frame drops its peer unread
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.file = run_dir / CONTROL_FILE
        self.file.write_text(json.dumps({"address": self.address, "pid": os.getpid()}))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(200):
                    continue
                frames = self._sock.recv_multipart()
                # the routing id and, from a REQ peer, its empty delimiter; then the request's own frames
                envelope = frames[:2] if len(frames) > 1 and frames[1] == b"" else frames[:1]
                reply = self._answer(frames[len(envelope):])
                self._sock.send_multipart([*envelope, json.dumps(reply).encode()])
            except Exception:  # noqa: BLE001 - the endpoint outlives any one request
                log.exception("control endpoint: a request could not be answered; serving on")

    def _answer(self, body: list[bytes]) -> dict[str, Any]:
        try:
            if len(body) != 1:
                raise RequestError(f"a request is one frame, got {len(body)}")
            return self._handle(parse_request(body[0], self.fleet.max_generators))
        except RequestError as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - e.g. Ray failing under a status request
            return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "scale":
            self.fleet.request_scale(msg["generators"])
            return {"ok": True, "applied_at": "next progress poll (membership at the next version boundary)"}
        if op == "stop":
            self.fleet.request_stop()
            return {"ok": True, "applied_at": "learners stop at the next common step, with a checkpoint"}
        if op == "status":
            return {"ok": True, **self.fleet.status()}
        return {"ok": True, **self.fleet.pids()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self.file.unlink(missing_ok=True)


def send_control(run_dir: str | Path, msg: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Client side of the endpoint; raises RuntimeError with what to check when no run answers."""
    import zmq

    f = Path(run_dir) / CONTROL_FILE
    if not f.is_file():
        raise RuntimeError(f"{f} not found: no run with a control endpoint is active in {run_dir}")
    address = json.loads(f.read_text())["address"]
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(json.dumps(msg).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"the run at {address} (from {f}) did not answer within {timeout_s:g} s; "
                               "it may have ended")
        return json.loads(sock.recv().decode())
    finally:
        sock.close(0)
