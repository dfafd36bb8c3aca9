"""Fault tests on a real redis-server: whatever crashes, every group is trained exactly once or dropped.

Each test starts its own ``redis-server`` (append-only, fsync always) on a free loopback port, runs
producer and learner threads through BufferClient, injects one fault with SIGKILL, and checks the final
ledger: every produced id trained exactly once or dropped with a reason, and the persisted counters agree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.logic import BufferLogic
from async_rlhf.buffer.redis_store import RedisStore
from async_rlhf.buffer.service import BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.buffer.testing import (
    Learner,
    Producer,
    RedisServer,
    assert_exactly_once,
    free_port,
    make_group,
    retrying,
)

pytestmark = [pytest.mark.integration, pytest.mark.isolated]

BATCH = 4
PREFIX = "fault"


@pytest.fixture
def redis_server(tmp_path: Path):
    srv = RedisServer(tmp_path / "redis").start()
    try:
        yield srv
    finally:
        srv.stop()


def start_service_process(port: int, redis_url: str, visibility_s: float = 1.0) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_rlhf.buffer", f"buffer.port={port}", "buffer.store=redis",
         f"buffer.redis_url={redis_url}", f"buffer.redis_prefix={PREFIX}", f"train.batch_size={BATCH}",
         "train.max_staleness=1", f"buffer.visibility_timeout_s={visibility_s}", "buffer.capacity=64"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"buffer service did not start: {line!r}"
    return proc


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def run_workload(address: str, producers: int, per_producer: int, fault, fault_after_trained: int,
                 train_s: float = 0.002):
    """Producers and one learner through ``address``; ``fault()`` runs once enough groups are trained."""
    done = threading.Event()
    prods = [Producer(address, f"p{i}", per_producer) for i in range(producers)]
    learner = Learner(address, "learner-0", BATCH, done, train_s=train_s)
    for t in [*prods, learner]:
        t.start()
    watcher = BufferClient(address, timeout_s=2.0)
    try:
        wait_until(lambda: retrying(watcher.stats)["buffer/trained_total"] >= fault_after_trained, 30, "training")
        fault()
        for p in prods:
            p.join(timeout=60)
            assert p.error is None, f"{p.name} failed: {p.error!r}"
        done.set()
        learner.join(timeout=60)
        assert not learner.is_alive(), "the learner did not drain the buffer"
        assert learner.error is None, f"learner failed: {learner.error!r}"
        stats = retrying(lambda: watcher.stats(ledger=True))
    finally:
        watcher.close()
    produced = {gid for p in prods for gid in p.produced}
    assert len(produced) == producers * per_producer
    return stats, produced, learner


def check_counters(stats: dict, produced: set[str], learner: Learner) -> None:
    led = stats["ledger"]
    assert_exactly_once(led, produced)
    # counters were persisted with each transition, so they agree with the ledger after any crash
    assert stats["buffer/put"] == len(produced)
    assert stats["buffer/trained"] == len(led["trained"])
    assert stats["buffer/accepted"] == len(produced) - len(led["dropped"])
    # an admit granted by a service killed before it could answer is retried with the same request id; the
    # restarted service finds the grant in Redis and answers it again, so no slot leaks
    assert stats["buffer/running"] == 0
    assert stats["buffer/version"] == learner.version
    assert set(led["trained"]) <= set(learner.received)


def test_service_sigkill_and_restart_on_redis(redis_server: RedisServer):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [start_service_process(port, redis_server.url)]
    before: dict = {}

    def kill_and_restart() -> None:
        probe = BufferClient(address, timeout_s=2.0)
        # kill while the learner holds a batch (it "trains" 30 ms per batch, acks in about 1 ms)
        wait_until(lambda: probe.stats()["buffer/delivered_unacked"] > 0, 10, "a delivered batch")
        os.kill(procs[-1].pid, signal.SIGSTOP)  # freeze it, read its state from Redis, then kill it
        led = BufferLogic(RedisStore(redis_server.url, prefix=PREFIX), BATCH, 1).stats(ledger=True)
        before.update(led)
        probe.close()
        os.kill(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait(timeout=10)
        time.sleep(0.3)  # clients time out against a dead port meanwhile
        procs.append(start_service_process(port, redis_server.url))

    try:
        stats, produced, learner = run_workload(address, producers=3, per_producer=60, fault=kill_and_restart,
                                                fault_after_trained=40, train_s=0.03)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    check_counters(stats, produced, learner)
    # the killed service's state, as Redis held it, was the starting point of the restarted one
    assert before["buffer/trained_total"] >= 40
    assert before["ledger"]["delivered"], "the kill did not hit a delivered-unacknowledged batch"
    assert set(before["ledger"]["delivered"]) <= set(stats["ledger"]["trained"]) | set(stats["ledger"]["dropped"])
    assert set(before["ledger"]["trained"]) <= set(stats["ledger"]["trained"])
    assert set(before["ledger"]["dropped"]).issubset(stats["ledger"]["dropped"])
    assert stats["buffer/version"] >= before["buffer/version"] > 0


def test_redis_sigkill_and_restart_from_aof(redis_server: RedisServer):
    store = RedisStore(redis_server.url, prefix=PREFIX, retry_s=30.0)
    logic = BufferLogic(store, groups_per_version=BATCH, max_staleness=1, capacity=64, visibility_timeout_s=1.0)
    service = BufferService(logic).start()

    def kill_redis_and_restart() -> None:
        redis_server.kill()
        time.sleep(0.5)  # the service blocks on Redis meanwhile; clients wait or retry
        redis_server.start()

    try:
        stats, produced, learner = run_workload(service.address, producers=3, per_producer=60,
                                                fault=kill_redis_and_restart, fault_after_trained=40)
        assert store.retries > 0, "the fault did not hit the service"
        # what Redis replayed from its append-only file is exactly the state the service kept
        mirror = logic.stats(ledger=True)["ledger"]
    finally:
        service.stop()
    reloaded = BufferLogic(RedisStore(redis_server.url, prefix=PREFIX), groups_per_version=BATCH, max_staleness=1)
    assert reloaded.stats(ledger=True)["ledger"] == mirror
    assert reloaded.admission.version == learner.version
    check_counters(stats, produced, learner)


VICTIM = """
import sys, time
from async_rlhf.buffer.client import BufferClient
c = BufferClient(sys.argv[1], timeout_s=5.0, consumer="victim")
groups = c.get(3, 0, wait_s=5.0)
print(" ".join(g.group_id for g in groups), flush=True)
time.sleep(600)  # "training" forever, holding the batch unacknowledged
"""


@pytest.mark.parametrize("store_kind,recovery", [("redis", "timeout"), ("redis", "declared_dead"),
                                                  ("memory", "timeout")])
def test_learner_killed_holding_a_batch(redis_server: RedisServer, store_kind: str, recovery: str):
    store = RedisStore(redis_server.url, prefix=PREFIX) if store_kind == "redis" else MemoryStore()
    visibility = 1.0 if recovery == "timeout" else 300.0
    logic = BufferLogic(store, groups_per_version=100, max_staleness=10, visibility_timeout_s=visibility)
    service = BufferService(logic).start()
    client = BufferClient(service.address, timeout_s=5.0)
    victim = None
    try:
        produced = {f"g{i}" for i in range(12)}
        for gid in sorted(produced):
            assert client.put(make_group(gid)) is True
        victim = subprocess.Popen([sys.executable, "-c", VICTIM, service.address], stdout=subprocess.PIPE, text=True)
        held_by_victim = victim.stdout.readline().split()
        assert len(held_by_victim) == 3
        assert client.stats()["buffer/delivered_unacked"] == 3
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        t_killed = time.monotonic()
        if recovery == "declared_dead":
            assert client.declare_dead("victim") == 3
        done = threading.Event()
        done.set()  # nothing more will be produced: the healthy learner drains everything
        healthy = Learner(service.address, "healthy", 4, done, set_version=False)
        healthy.start()
        healthy.join(timeout=30)
        assert healthy.error is None and not healthy.is_alive()
        elapsed = time.monotonic() - t_killed
        stats = client.stats(ledger=True)
    finally:
        client.close()
        service.stop()
        if victim is not None and victim.poll() is None:
            victim.kill()
    assert_exactly_once(stats["ledger"], produced)
    assert set(stats["ledger"]["trained"]) == produced  # nothing was stale, so nothing was dropped
    assert set(held_by_victim) <= set(healthy.received)
    assert healthy.acked_fresh == len(produced)
    assert stats["buffer/redelivered"] == 3
    key = "buffer/returned_visibility_timeout" if recovery == "timeout" else "buffer/returned_consumer_dead"
    assert stats[key] == 3
    if recovery == "timeout":
        assert elapsed >= 0.9  # not before the visibility timeout
    else:
        assert elapsed < 5.0
