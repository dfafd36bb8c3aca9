"""Benchmark of the buffer service against raw transports, with the same payloads in the same run.

    python bench/buffer.py [--quick] [--out FILE] [--seconds S] [--fsync everysec|always]

For each payload (1 KB, 16 KB, 256 KB of token data per group) it measures, for ``--seconds`` each:

    store   the buffer                                          raw baseline
    memory  producer put -> service (memory store) -> consumer get+ack     raw pyzmq PUSH -> PULL
    redis   producer put -> service (Redis store)  -> consumer get+ack     raw XADD -> XREADGROUP + XACK

then the same with 16 producers and 4 consumers (rows ``memory-16p4c`` and ``redis-16p4c``). Every
producer, consumer and the service run in their own process (no shared GIL). ``msgs_per_s`` counts groups
consumed; ``p50_ms``/``p99_ms`` are the round-trip latencies of the producers' put requests. The Redis
server is a private one on a free port (append-only, ``--fsync``); nothing touches another Redis.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from async_rlhf.buffer.testing import RedisServer, free_port, make_group  # noqa: E402

PAYLOADS = (1 << 10, 16 << 10, 256 << 10)
BATCH = 8  # groups per consumer get (and per XREADGROUP)


# -- raw baselines ------------------------------------------------------------------------------------
def raw_zmq_producer(address: str, size: int, t0: float, t1: float) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    payload = os.urandom(size)
    time.sleep(max(0.0, t0 - time.time()))
    while time.time() < t1:
        for _ in range(64):
            try:
                sock.send(payload, zmq.NOBLOCK, copy=size < 65536)
            except zmq.Again:
                sock.poll(10, zmq.POLLOUT)
    sock.close(0)


def raw_zmq_consumer(address: str, t0: float, t1: float, out: Any) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    n = 0
    while time.time() < t1:
        if sock.poll(20):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if time.time() >= t0:
                    n += 1
    sock.close(0)
    out.put(("consumed", n, []))


def raw_redis_producer(url: str, stream: str, size: int, t0: float, t1: float) -> None:
    import redis

    r = redis.Redis.from_url(url)
    payload = os.urandom(size)
    time.sleep(max(0.0, t0 - time.time()))
    while time.time() < t1:
        if r.xlen(stream) > 4096:  # the same capacity bound the buffer runs with
            time.sleep(0.001)
            continue
        for _ in range(16):
            r.xadd(stream, {"d": payload})


def raw_redis_consumer(url: str, stream: str, name: str, t0: float, t1: float, out: Any) -> None:
    import redis

    r = redis.Redis.from_url(url)
    n = 0
    while time.time() < t1:
        got = r.xreadgroup("g", name, {stream: ">"}, count=BATCH, block=20)
        ids = [sid for _, entries in got for sid, _ in entries]
        if ids:
            r.xack(stream, "g", *ids)
            r.xdel(stream, *ids)
            if time.time() >= t0:
                n += len(ids)
    out.put(("consumed", n, []))


# -- the buffer service ---------------------------------------------------------------------------------
def buffer_producer(address: str, tag: str, size: int, t0: float, t1: float, out: Any) -> None:
    from async_rlhf.buffer.client import BufferClient

    c = BufferClient(address, timeout_s=30.0)
    group = make_group(f"{tag}-0", payload_bytes=size)
    lat: list[float] = []
    i = 0
    time.sleep(max(0.0, t0 - time.time() - 0.2))
    while time.time() < t1:
        i += 1
        group.group_id = f"{tag}-{i}"
        s = time.perf_counter()
        c.put(group)
        if time.time() >= t0:
            lat.append(time.perf_counter() - s)
    c.close()
    out.put(("latency", 0, lat))


def buffer_consumer(address: str, name: str, t0: float, t1: float, out: Any) -> None:
    from async_rlhf.buffer.client import BufferClient

    c = BufferClient(address, timeout_s=30.0, consumer=name)
    n = 0
    while time.time() < t1:
        groups = c.get(BATCH, 0, wait_s=0.05)
        if groups:
            c.ack([g.group_id for g in groups])
            if time.time() >= t0:
                n += len(groups)
    c.close()
    out.put(("consumed", n, []))


def start_service(store: str, redis_url: str, prefix: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_rlhf.buffer", f"buffer.port={port}", f"buffer.store={store}",
         f"buffer.redis_url={redis_url}", f"buffer.redis_prefix={prefix}", "train.batch_size=100000000",
         "train.max_staleness=0", "buffer.capacity=4096"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"buffer service did not start: {line!r}")
    return proc, line.split()[1]


def run_procs(targets: list[tuple[Any, tuple]], seconds: float) -> tuple[int, list[float]]:
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out) if fn in _WANT_OUT else args) for fn, args in targets]
    for p in procs:
        p.start()
    consumed, lat = 0, []
    expected = sum(1 for fn, _ in targets if fn in _WANT_OUT)
    for _ in range(expected):
        kind, n, samples = out.get(timeout=seconds + 60)
        consumed += n
        lat += samples
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return consumed, lat


_WANT_OUT = {raw_zmq_consumer, raw_redis_consumer, buffer_producer, buffer_consumer}


def measure_raw_zmq(size: int, producers: int, consumers: int, seconds: float) -> float:
    # PUSH/PULL fans out to one bound PULL per consumer; producers connect to all of them
    ports = [free_port() for _ in range(consumers)]
    t0 = time.time() + 1.0
    t1 = t0 + seconds
    targets: list[tuple[Any, tuple]] = [(raw_zmq_consumer, (f"tcp://127.0.0.1:{p}", t0, t1)) for p in ports]
    targets += [(raw_zmq_producer, (f"tcp://127.0.0.1:{ports[i % consumers]}", size, t0, t1))
                for i in range(producers)]
    consumed, _ = run_procs(targets, seconds)
    return consumed / seconds


def measure_raw_redis(url: str, size: int, producers: int, consumers: int, seconds: float) -> float:
    import redis

    stream = f"raw:{size}:{producers}:{time.time_ns()}"
    r = redis.Redis.from_url(url)
    r.xgroup_create(stream, "g", id="0", mkstream=True)
    t0 = time.time() + 1.0
    t1 = t0 + seconds
    targets: list[tuple[Any, tuple]] = [(raw_redis_consumer, (url, stream, f"c{i}", t0, t1)) for i in range(consumers)]
    targets += [(raw_redis_producer, (url, stream, size, t0, t1)) for _ in range(producers)]
    consumed, _ = run_procs(targets, seconds)
    r.delete(stream)
    return consumed / seconds


def measure_buffer(store: str, url: str, size: int, producers: int, consumers: int,
                   seconds: float) -> tuple[float, float, float]:
    proc, address = start_service(store, url, prefix=f"bench:{store}:{size}:{producers}:{time.time_ns()}")
    try:
        t0 = time.time() + 1.0
        t1 = t0 + seconds
        targets: list[tuple[Any, tuple]] = [(buffer_consumer, (address, f"c{i}", t0, t1)) for i in range(consumers)]
        targets += [(buffer_producer, (address, f"p{i}", size, t0, t1)) for i in range(producers)]
        consumed, lat = run_procs(targets, seconds)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    p50, p99 = (float(np.percentile(lat, q)) * 1000 for q in (50, 99)) if lat else (0.0, 0.0)
    return consumed / seconds, p50, p99


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, the load test at 16 KB only (< 1 min)")
    ap.add_argument("--seconds", type=float, default=None, help="measuring time per row")
    ap.add_argument("--fsync", default="everysec", choices=("everysec", "always", "no"),
                    help="appendfsync of the private redis-server")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    cases = [(s, 1, 1) for s in PAYLOADS]
    cases += [(16 << 10, 16, 4)] if args.quick else [(s, 16, 4) for s in PAYLOADS]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp, fsync=args.fsync).start()
        try:
            for size, producers, consumers in cases:
                suffix = "" if producers == 1 else f"-{producers}p{consumers}c"
                raw_z = measure_raw_zmq(size, producers, consumers, seconds)
                raw_r = measure_raw_redis(server.url, size, producers, consumers, seconds)
                for store, raw in (("memory", raw_z), ("redis", raw_r)):
                    rate, p50, p99 = measure_buffer(store, server.url, size, producers, consumers, seconds)
                    rows.append({"store": store + suffix, "payload_bytes": size, "msgs_per_s": round(rate, 1),
                                 "raw_msgs_per_s": round(raw, 1), "ratio": round(rate / raw, 3) if raw else 0.0,
                                 "p50_ms": round(p50, 3), "p99_ms": round(p99, 3)})
                    print_row(rows[-1], header=len(rows) == 1)
        finally:
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=2))
    return 0


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'store':<14}{'payload':>9}{'msgs/s':>11}{'raw msgs/s':>12}{'ratio':>8}{'put p50 ms':>12}"
              f"{'put p99 ms':>12}   (raw: pyzmq PUSH/PULL for memory, XADD/XREADGROUP for redis)")
    print(f"{row['store']:<14}{row['payload_bytes']:>9}{row['msgs_per_s']:>11.0f}{row['raw_msgs_per_s']:>12.0f}"
          f"{row['ratio']:>8.2f}{row['p50_ms']:>12.3f}{row['p99_ms']:>12.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
