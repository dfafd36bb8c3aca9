"""Admission slots of a generator that dies (issue 31, defect 6): the real buffer service knows what each generator
holds (granted, not yet put or released, by its client's name) and gives back exactly that when the driver reports
the death (``BufferClient.release_holder``, called by ``Fleet._restart``). Before, the driver released the
``in_flight`` figure of its last poll, seconds old: slots leaked, or slots of live generators were handed out
twice."""

from __future__ import annotations

import pytest
from test_buffer_service import make_group

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.service import BufferLogic, BufferService
from async_rlhf.buffer.store import MemoryStore

pytestmark = pytest.mark.integration


@pytest.fixture
def svc():
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=1)  # room for 8 groups at v0
    service = BufferService(logic, host="127.0.0.1", port=0).start()
    clients: list[BufferClient] = []

    def client(name: str) -> BufferClient:
        clients.append(BufferClient(service.address, timeout_s=5.0, consumer=name))
        return clients[-1]

    service.client = client
    try:
        yield service
    finally:
        for c in clients:
            c.close()
        service.stop()


def running(svc: BufferService) -> int:
    return svc.call(lambda: svc.logic.admission.running)


def test_a_dead_generator_gives_back_exactly_the_slots_it_held(svc: BufferService) -> None:
    g3, g1, driver = svc.client("generator-3"), svc.client("generator-1"), svc.client("driver")
    assert g3.admit(4)[0] == 4
    assert g3.put(make_group("g3-a"))  # then, before it died: one group put, one slot released
    g3.release(1)
    assert g1.admit(2)[0] == 2
    assert running(svc) == 4 and driver.stats(ledger=True)["holders"] == {"generator-3": 2, "generator-1": 2}

    assert driver.release_holder("generator-3") == 2  # exact, not the 4 the driver's last poll saw
    assert running(svc) == 2 and driver.stats(ledger=True)["holders"] == {"generator-1": 2}
    # capacity: 8 - 1 accepted - 2 running (generator-1's) = 5 admissible now; the stale figure would give 7
    assert g1.admit(8)[0] == 5


def test_a_put_or_release_of_the_dead_generator_arriving_late_frees_nothing_twice(svc: BufferService) -> None:
    g3, g1, driver = svc.client("generator-3"), svc.client("generator-1"), svc.client("driver")
    assert g3.admit(3)[0] == 3 and g1.admit(2)[0] == 2
    assert driver.release_holder("generator-3") == 3
    assert running(svc) == 2
    assert g3.put(make_group("late"))  # was on its way when it died: accepted, no running slot ends again
    g3.release(2)  # its loop's last words: nothing more to give back
    assert running(svc) == 2 and svc.call(lambda: svc.logic.admission.accepted) == 1
    # restarted under the same name: counted afresh
    assert g3.admit(1)[0] == 1 and driver.stats(ledger=True)["holders"] == {"generator-1": 2, "generator-3": 1}
    assert driver.release_holder("generator-3") == 1 and running(svc) == 2


def test_the_stale_figure_over_admits(svc: BufferService) -> None:
    """The old arithmetic on the same history, for the record: releasing the polled in_flight (4) instead of the 2
    slots still held also frees generator-1's 2 slots, which are then granted a second time."""
    g3, g1, driver = svc.client("generator-3"), svc.client("generator-1"), svc.client("driver")
    assert g3.admit(4)[0] == 4
    assert g3.put(make_group("g3-a"))
    g3.release(1)
    assert g1.admit(2)[0] == 2
    driver.release(4)  # Fleet._restart before the fix
    assert running(svc) == 0  # generator-1 still runs 2 groups the buffer no longer counts
    assert svc.client("generator-5").admit(8)[0] == 7  # 2 more than the staleness bound allows
