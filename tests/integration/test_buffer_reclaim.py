"""A buffer service that dies and comes back on the same port: the waiting client fails at once, and the groups
of a get whose reply was lost are taken back and delivered again (the Redis store recovers the state; here the
same BufferLogic object plays that part)."""

from __future__ import annotations

import threading
import time

import pytest

from async_rlhf.buffer import client as client_module
from async_rlhf.buffer.client import BufferClient, BufferUnavailable, encode_group, stop_retries, with_retry
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import free_port, make_group


def test_reclaim_takes_back_only_what_the_consumer_does_not_hold() -> None:
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=1)
    logic.put_many([encode_group(make_group(f"g{i}")) for i in range(4)])
    logic.take(2, 0, "L")  # delivered, the reply lost
    logic.take(1, 0, "other")
    assert sorted(logic.store.delivered()) == ["g0", "g1", "g2"]
    assert logic.reclaim("L", holding=["g1"]) == 1  # g1 arrived, g0 did not
    assert sorted(logic.store.delivered()) == ["g1", "g2"]
    assert logic.counters["returned_reply_lost"] == 1
    again = logic.take(1, 0, "L")
    assert [g.group_id for g in again] == ["g0"] and again[0].deliveries == 2


def test_a_get_lost_in_a_restart_is_delivered_again() -> None:
    port = free_port()
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=1)
    svc = BufferService(logic, port=port).start()
    client = BufferClient(svc.address, timeout_s=3600.0, consumer="L")
    try:
        failed: list[Exception] = []

        def parked_get() -> None:
            try:
                client.get_encoded(2, 0, wait_s=3600.0)
            except BufferUnavailable as exc:
                failed.append(exc)

        waiting = threading.Thread(target=parked_get)
        waiting.start()
        parked_by = time.monotonic() + 20
        while not svc._pending:  # the get is parked: nothing is held
            assert time.monotonic() < parked_by, "the get never reached the service"
            threading.Event().wait(0.01)
        svc.stop()  # the service dies; the client must not wait out its hour
        waiting.join(timeout=20)
        assert not waiting.is_alive() and len(failed) == 1 and "dropped" in str(failed[0]), failed
        # the state survived (a Redis store recovers it): two groups were delivered to L just before the death
        logic.put_many([encode_group(make_group(f"g{i}")) for i in range(3)])
        logic.take(2, 0, "L")
        svc = BufferService(logic, port=port).start()  # the restarted actor binds the same port
        ids, _ = client.get_encoded(2, 0, wait_s=5.0)  # the retry names what it holds: nothing
        assert sorted(ids) == ["g0", "g1"]
        assert logic.counters["returned_reply_lost"] == 2
        assert client.ack(ids) == 2
        ids2, _ = client.get_encoded(1, 0, wait_s=5.0)  # a normal get: nothing taken back
        assert ids2 == ["g2"] and logic.counters["returned_reply_lost"] == 2
        assert client.ack(ids2) == 1 and sorted(logic.store.trained()) == ["g0", "g1", "g2"]
    finally:
        client.close()
        svc.stop()


def test_a_stopping_process_gives_up_retrying_a_dead_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "_stop_deadline", None)  # the process-wide stop state, restored after
    client = BufferClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=3600.0)  # nothing listens there
    failed: list[Exception] = []

    def retry() -> None:
        try:
            with_retry(client.stats, "stats", give_up_after_s=3600.0)
        except BufferUnavailable as exc:
            failed.append(exc)

    worker = threading.Thread(target=retry)
    worker.start()
    try:
        stop_retries(0.2)  # e.g. the generator was told to stop: its hour of patience ends now
        worker.join(timeout=20)
        assert not worker.is_alive() and len(failed) == 1 and "gave up" in str(failed[0]), failed
    finally:
        client.close()
