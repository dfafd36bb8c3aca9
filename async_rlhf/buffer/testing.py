"""Test and benchmark helpers: a throwaway ``redis-server``, and producers/learners that survive restarts.

The Redis server runs on a free loopback port in its own directory, so it can be killed (SIGKILL) and started again
from its append-only file; it never touches a Redis that is already running on this machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import redis

from async_rlhf.buffer.client import BufferClient, BufferUnavailable
from async_rlhf.endpoints import free_port  # noqa: F401  (bench and tests import it from here)
from async_rlhf.retry import retry
from async_rlhf.types import Group, Sample

T = TypeVar("T")


class RedisServer:
    """``redis-server --appendonly yes --appendfsync always --save ""`` in ``directory``."""

    def __init__(self, directory: str | Path, port: int | None = None, fsync: str = "always",
                 password: str = "") -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise RuntimeError("redis-server is not on PATH; scripts/setup_env.sh installs Debian's redis-server")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.fsync = fsync
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        log = open(self.dir / "redis.log", "ab")  # the child keeps it open
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", self.fsync, "--save", "", "--protected-mode", "no",
             "--daemonize", "no", *(["--requirepass", self.password] if self.password else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, password=self.password or None)
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not start; see {self.dir}/redis.log")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final save; what survives is what the AOF had fsynced."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- workload: producers and learners that ride out restarts ---------------------------------------------
def make_group(gid: str, version: int = 0, payload_bytes: int = 64, samples: int = 1) -> Group:
    """A valid group whose completions carry about ``payload_bytes`` of token data in total."""
    per = max(1, payload_bytes // (12 * samples))  # int32 ids + float32 logprobs + int32 versions per token
    out = [Sample(np.arange(per, dtype=np.int32) % 50_000, np.full(per, -0.5, np.float32),
                  np.full(per, version, np.int32), float(i % 2)) for i in range(samples)]
    return Group(gid, np.array([1, 2, 3], np.int32), out, generator=0, meta={})


def retrying(fn: Callable[[], T], stop: threading.Event | None = None, give_up_s: float = 60.0) -> T:
    """Call ``fn`` until the service answers (it may be restarting); requests here are idempotent."""
    return retry(fn, (BufferUnavailable,), give_up_s, first_delay_s=0.05, max_delay_s=0.05,
                 should_stop=None if stop is None else stop.is_set)


class Producer(threading.Thread):
    """A generator stand-in: admit one group, put it (retrying the same id until the service answers)."""

    def __init__(self, address: str, name: str, count: int, timeout_s: float = 2.0, payload_bytes: int = 64) -> None:
        super().__init__(name=f"producer-{name}", daemon=True)
        self.address, self.tag, self.count, self.timeout_s = address, name, count, timeout_s
        self.payload_bytes = payload_bytes
        self.produced: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        client = BufferClient(self.address, timeout_s=self.timeout_s)
        try:
            for i in range(self.count):
                while True:
                    granted, version = retrying(lambda: client.admit(1))
                    if granted:
                        break
                    time.sleep(0.005)
                group = make_group(f"{self.tag}-{i}", version, self.payload_bytes)
                retrying(lambda g=group: client.put(g))
                self.produced.append(group.group_id)
        except BaseException as exc:  # surfaced by the test
            self.error = exc
        finally:
            client.close()


class Learner(threading.Thread):
    """A learner stand-in: get a batch, "train", ack, advance the version; drains the buffer at the end."""

    def __init__(self, address: str, consumer: str, batch: int, producers_done: threading.Event,
                 timeout_s: float = 2.0, train_s: float = 0.0, set_version: bool = True) -> None:
        super().__init__(name=f"learner-{consumer}", daemon=True)
        self.address, self.consumer, self.batch = address, consumer, batch
        self.producers_done, self.timeout_s, self.train_s = producers_done, timeout_s, train_s
        self.set_version = set_version
        self.version = 0
        self.received: list[str] = []
        self.acked_fresh = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        client = BufferClient(self.address, timeout_s=self.timeout_s, consumer=self.consumer)
        try:
            self.version = retrying(lambda: client.stats())["buffer/version"]
            while not self.stop.is_set():
                n = 1 if self.producers_done.is_set() else self.batch
                groups = retrying(lambda n=n: client.get(n, self.version, wait_s=0.2))
                if not groups:
                    if self.producers_done.is_set():
                        s = retrying(lambda: client.stats())
                        if s["buffer/depth"] == 0 and s["buffer/delivered_unacked"] == 0:
                            return
                    continue
                ids = [g.group_id for g in groups]
                self.received += ids
                if self.train_s:
                    time.sleep(self.train_s)
                self.acked_fresh += retrying(lambda ids=ids: client.ack(ids))
                if self.set_version:
                    self.version = max(self.version, retrying(lambda: client.stats())["buffer/version"]) + 1
                    retrying(lambda: client.set_version(self.version))
        except BaseException as exc:
            self.error = exc
        finally:
            client.close()


def assert_exactly_once(ledger: dict[str, Any], produced: set[str]) -> None:
    """Every produced id is trained exactly once or dropped with a reason; nothing else is in the ledger."""
    held, delivered = set(ledger["held"]) | set(ledger.get("awaiting_reward", [])), set(ledger["delivered"])
    trained, dropped = ledger["trained"], ledger["dropped"]
    assert not held and not delivered, f"left in the buffer: held {sorted(held)[:5]} delivered {sorted(delivered)[:5]}"
    assert len(trained) == len(set(trained)), "an id is recorded as trained twice"
    assert not set(trained) & set(dropped), f"trained and dropped: {sorted(set(trained) & set(dropped))[:5]}"
    assert set(trained) | set(dropped) == produced, (
        f"lost: {sorted(produced - set(trained) - set(dropped))[:5]}, "
        f"unknown: {sorted(set(trained) | set(dropped) - produced)[:5]}")
    assert all(isinstance(r, str) and r for r in dropped.values()), "a drop without a reason"
