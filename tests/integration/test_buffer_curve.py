"""CURVE on the buffer socket, tested on 127.0.0.1 by forcing it on: only allowed client keys get answers."""

import pytest

from async_rlhf.buffer.build import build_service, client_keys
from async_rlhf.buffer.client import BufferClient, BufferUnavailable
from async_rlhf.buffer.curve import CurveClientKeys, CurveServerKeys, keypair, parse_keys
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.config import load_config


@pytest.fixture
def curve_service():
    server_pub, server_sec = keypair()
    client_pub, client_sec = keypair()
    logic = BufferLogic(MemoryStore(), groups_per_version=2, max_staleness=0)
    svc = BufferService(logic, curve=CurveServerKeys(server_sec, server_pub, [client_pub])).start()
    try:
        yield svc, server_pub, (client_pub, client_sec)
    finally:
        svc.stop()


def test_allowed_key_is_answered(curve_service):
    svc, server_pub, (pub, sec) = curve_service
    c = BufferClient(svc.address, timeout_s=3.0, curve=CurveClientKeys(sec, pub, server_pub))
    try:
        assert c.admit(5) == (2, 0)
        assert c.stats()["buffer/admitted"] == 2
    finally:
        c.close()


def test_clients_without_the_right_key_get_no_answer(curve_service):
    svc, server_pub, _ = curve_service
    stranger_pub, stranger_sec = keypair()
    wrong_server_pub, _ = keypair()
    clients = {
        "plain": BufferClient(svc.address, timeout_s=0.5),
        "unknown_key": BufferClient(svc.address, timeout_s=0.5,
                                    curve=CurveClientKeys(stranger_sec, stranger_pub, server_pub)),
        "wrong_server_key": BufferClient(svc.address, timeout_s=0.5,
                                         curve=CurveClientKeys(stranger_sec, stranger_pub, wrong_server_pub)),
    }
    try:
        for name, c in clients.items():
            with pytest.raises(BufferUnavailable):
                c.admit(1)
            assert svc.logic.counters["admitted"] == 0, name  # nothing reached the logic
    finally:
        for c in clients.values():
            c.close()


def test_non_loopback_bind_needs_curve():
    logic = BufferLogic(MemoryStore(), groups_per_version=1, max_staleness=0)
    with pytest.raises(ValueError, match="buffer.curve"):
        BufferService(logic, host="0.0.0.0")
    pub, sec = keypair()
    cpub, _ = keypair()
    svc = BufferService(logic, host="0.0.0.0", curve=CurveServerKeys(sec, pub, [cpub]))
    assert svc.address.startswith("tcp://0.0.0.0:")
    svc.stop()


def test_curve_from_config():
    pub, sec = keypair()
    cpub, csec = keypair()
    server = ["buffer.curve=true", f"buffer.curve_secret_key='{sec}'", f"buffer.curve_public_key='{pub}'"]
    cfg = load_config(None, [*server, f"buffer.curve_client_keys='{cpub}'", f"buffer.curve_client_secret_key='{csec}'",
                             f"buffer.curve_client_public_key='{cpub}'"])
    svc = build_service(cfg).start()
    c = BufferClient(svc.address, timeout_s=3.0, curve=client_keys(cfg.buffer))
    try:
        assert c.admit(1)[0] == 1
    finally:
        c.close()
        svc.stop()
    with pytest.raises(ValueError, match="40"):
        parse_keys("short")
    with pytest.raises(ValueError, match="curve_client_keys"):  # refused when the config loads
        load_config(None, server)
