"""The control endpoint survives whatever reaches its port: every bad request is answered (or its peer dropped)
and `status` and `scale` still work afterwards. A real ControlServer on loopback with a stand-in fleet."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from async_rlhf.driver.control import ControlServer, parse_request, send_control


class StandInFleet:
    def __init__(self) -> None:
        self.targets: list[int] = []
        self.stopped = threading.Event()

    def max_generators(self) -> int:
        return 3

    def request_scale(self, generators: int) -> None:
        self.targets.append(generators)

    def request_stop(self) -> None:
        self.stopped.set()

    def status(self) -> dict[str, Any]:
        return {"generators": [0, 1], "targets": list(self.targets)}

    def pids(self) -> dict[str, Any]:
        return {"learners": {"0": 1}, "generators": {}, "buffer": 2}


@pytest.fixture
def endpoint(tmp_path: Path):
    fleet = StandInFleet()
    server = ControlServer(fleet, tmp_path)
    try:
        yield server, fleet, tmp_path
    finally:
        server.close()


def ask_raw(address: str, *frames: bytes, timeout_ms: int = 5000) -> dict[str, Any] | None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(list(frames))
        return json.loads(sock.recv()) if sock.poll(timeout_ms) else None
    finally:
        sock.close(0)


BAD = [b"1", b"[]", b'"x"', b"null", b"[" * 60_000, b'{"op":"scale","generators":1e400}',
       b'{"op":"scale","generators":true}', b'{"op":"scale","generators":"3"}', b'{"op":"scale","generators":2.9}',
       b'{"op":"scale","generators":[2]}', b'{"op":"scale","generators":4}', b'{"op":"scale","generators":0}',
       b'{"op":"scale","generators":' + b"9" * 5000 + b"}", b'{"op":"reboot"}', b'{"op":"status","x":1}',
       b"\xff\xfe\x00", b"{}"]


@pytest.mark.parametrize("raw", BAD, ids=[repr(b[:30]) for b in BAD])
def test_a_bad_request_is_answered_with_an_error_and_the_endpoint_goes_on(endpoint, raw: bytes) -> None:
    server, fleet, run_dir = endpoint
    reply = ask_raw(server.address, raw)
    assert reply is not None and reply["ok"] is False and reply["error"], reply
    assert send_control(run_dir, {"op": "status"})["ok"] is True
    assert fleet.targets == []  # nothing was scaled by a bad request


def test_multipart_oversize_and_tcp_garbage_leave_status_and_scale_working(endpoint) -> None:
    server, fleet, run_dir = endpoint
    reply = ask_raw(server.address, b'{"op":"status"}', b'{"op":"stop"}')
    assert reply is not None and reply["ok"] is False and "one frame" in reply["error"]
    assert not fleet.stopped.is_set()
    assert ask_raw(server.address, b"x" * (1 << 20), timeout_ms=500) is None  # the peer is dropped unread
    host, port = server.address.removeprefix("tcp://").split(":")
    for _ in range(200):
        with socket.create_connection((host, int(port)), timeout=2) as conn:
            conn.sendall(os.urandom(300))
    assert send_control(run_dir, {"op": "status"}) == {"ok": True, "generators": [0, 1], "targets": []}
    assert send_control(run_dir, {"op": "scale", "generators": 2})["ok"] is True
    assert fleet.targets == [2]
    assert send_control(run_dir, {"op": "pids"})["buffer"] == 2
    assert server._thread.is_alive()


def test_parse_request_keeps_valid_requests_as_they_are() -> None:
    assert parse_request(b'{"op":"scale","generators":3}', lambda: 3) == {"op": "scale", "generators": 3}

    def no_resources() -> int:
        raise AssertionError("only a scale request asks what the cluster can place")

    assert parse_request(b'{"op":"pids"}', no_resources) == {"op": "pids"}
