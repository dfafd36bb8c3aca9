"""Benchmark of the buffer service against raw transports, with the same payloads in the same run.

    python bench/buffer.py [--quick] [--out FILE] [--seconds S] [--fsync everysec|always]

For each payload (1 KB, 16 KB, 256 KB of token data per group) it measures, for ``--seconds`` each:

    store   the buffer                                          raw baseline
    memory  producer put -> service (memory store) -> consumer get+ack     raw pyzmq PUSH -> PULL
    redis   producer put -> service (Redis store)  -> consumer get+ack     raw XADD -> XREADGROUP + XACK

then the same with 16 producers and 4 consumers (rows ``memory-16p4c`` and ``redis-16p4c``). Memory rows also
carry a raw *relay* (producers PUSH -> one process that only forwards -> consumers PULL; ``relay_msgs_per_s``,
``relay_ratio`` = buffer / relay, ``relay_cpu_us_per_msg``): the same processes and hops as the buffer with
none of its work, i.e. what any broker between processes costs on this machine. Every
producer, consumer and the service run in their own process (no shared GIL). ``msgs_per_s`` counts groups
consumed; ``p50_ms``/``p99_ms`` are the round-trip latencies of the producers' put requests. The Redis
server is a private one on a free port (append-only, ``--fsync``); nothing touches another Redis.

How the buffer client batches (printed, and stored as ``client`` in the JSON): a producer encodes each group
afresh (own id) and puts PUT_BATCH groups per request with PUT_WINDOW requests in flight; small groups go
packed (their bytes back to back in one frame, sizes in the request), a batch with a group of 64 KB or more
as one frame per group. The service validates (msgpack-decodes and checks) each group, de-duplicates and
stores it (a small one copied out of the packed frame, a large one as a view of its own frame) and answers
one status per group. A consumer asks for up to
GET_BATCH groups (answered as soon as one is held), receives their stored bytes (packed, or as frames when
large) and acks their ids with its next get. The raw baselines send the same payload sizes without any of
that (PUSH/PULL: no acknowledgement at all).

Every row also reports CPU microseconds per consumed group, by role (``cpu_us_per_msg``: producers, service,
consumers, total; ``raw_cpu_us_per_msg``: producers, consumers, total; the redis-server's own CPU is in
neither). They are process CPU times (all threads) over the measured window, so they show where a ratio
below 1 comes from: on 2 cores a pipeline that needs k times the raw CPU per message runs at most 1/k of
its rate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from async_rlhf.buffer.testing import RedisServer, free_port, make_group  # noqa: E402

PAYLOADS = (1 << 10, 16 << 10, 256 << 10)
BATCH = 8  # groups per XREADGROUP of the raw Redis consumer
PUT_BATCH = 16  # most groups per put request of the buffer client (64: ~10-25% less CPU per group at 1p1c,
# but 16 producers x 1 MB requests fill the 4096-group capacity and most service CPU goes to puts
# answered "full", 0.11x instead of 0.21x at 16p4c) ...
PUT_BATCH_BYTES = 1 << 20  # ... and at most this many payload bytes per request (256 KB groups: 4 per request)
PUT_WINDOW = 4  # put requests in flight per producer (fewer for large groups: see put_window)
WINDOW_BYTES = 2 << 20  # most payload bytes one producer has in flight
WARMUP_S = 1.0  # processes start and connect before the measured window (0.5 with --quick)
GET_BATCH = 64  # most groups per get request of a buffer consumer (answered as soon as one is held)
CLIENT_NOTE = (f"buffer client: puts of min({PUT_BATCH}, {PUT_BATCH_BYTES >> 10} KB / payload) groups per request "
               "(small groups packed in one frame, large ones a frame each), "
               f"at most {PUT_WINDOW} requests and {WINDOW_BYTES >> 20} MB in flight per producer, each group "
               "acknowledged (a 'full' one is put again after 5 ms); "
               f"consumers get up to {GET_BATCH} per request and ack them with their next get; "
               "latency = put request round trip")


def put_batch(size: int) -> int:
    return max(1, min(PUT_BATCH, PUT_BATCH_BYTES // size))


def put_window(size: int) -> int:
    return max(1, min(PUT_WINDOW, WINDOW_BYTES // (size * put_batch(size))))


# -- raw baselines ------------------------------------------------------------------------------------
class CpuWindow:
    """CPU seconds of this process (all its threads: ZeroMQ's I/O thread too) between t0 and t1."""

    def __init__(self, t0: float) -> None:
        self.t0, self.start, self.spent = t0, None, 0.0

    def tick(self) -> None:
        """Call in the loop: the first call at or after t0 starts the window."""
        if self.start is None and time.time() >= self.t0:
            self.start = time.process_time()

    def stop(self) -> float:
        self.spent = time.process_time() - self.start if self.start is not None else 0.0
        return self.spent


def raw_zmq_producer(address: str, size: int, t0: float, t1: float, out: Any) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    payload = os.urandom(size)
    time.sleep(max(0.0, t0 - time.time()))
    cpu = CpuWindow(t0)
    while time.time() < t1:
        cpu.tick()
        for _ in range(64):
            try:
                sock.send(payload, zmq.NOBLOCK, copy=size < 65536)
            except zmq.Again:
                sock.poll(10, zmq.POLLOUT)
    out.put(("producers", 0, [], cpu.stop()))
    sock.close(0)


def raw_zmq_consumer(address: str, t0: float, t1: float, out: Any, bind: bool = True) -> None:
    """Counts messages received; binds ``address`` (producers connect), or connects to a bound PUSH (a relay's)."""
    import zmq

    sock = zmq.Context().socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address) if bind else sock.connect(address)
    n = 0
    cpu = CpuWindow(t0)
    while time.time() < t1:
        cpu.tick()
        if sock.poll(20):
            while True:
                try:
                    sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if time.time() >= t0:
                    n += 1
    sock.close(0)
    out.put(("consumers", n, [], cpu.stop()))


def raw_zmq_relay(pull_address: str, push_address: str, t0: float, t1: float, out: Any) -> None:
    """A broker that does nothing but forward: PULL from producers, PUSH to consumers (no id, no check, no
    store, no acknowledgement). The floor of any broker between processes on this machine."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock, address in ((pull, pull_address), (push, push_address)):
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
    cpu = CpuWindow(t0)
    while time.time() < t1:
        cpu.tick()
        if pull.poll(20):
            for _ in range(256):
                try:
                    frame = pull.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                while time.time() < t1:  # consumers stop at t1: never block past it
                    try:
                        push.send(frame, zmq.NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        push.poll(10, zmq.POLLOUT)
    out.put(("service", 0, [], cpu.stop()))
    pull.close(0)
    push.close(0)


def raw_redis_producer(url: str, stream: str, size: int, t0: float, t1: float, out: Any) -> None:
    import redis

    r = redis.Redis.from_url(url)
    payload = os.urandom(size)
    time.sleep(max(0.0, t0 - time.time()))
    cpu = CpuWindow(t0)
    while time.time() < t1:
        cpu.tick()
        if r.xlen(stream) > 4096:  # the same capacity bound the buffer runs with
            time.sleep(0.001)
            continue
        for _ in range(16):
            r.xadd(stream, {"d": payload})
    out.put(("producers", 0, [], cpu.stop()))


def raw_redis_consumer(url: str, stream: str, name: str, t0: float, t1: float, out: Any) -> None:
    import redis

    r = redis.Redis.from_url(url)
    n = 0
    cpu = CpuWindow(t0)
    while time.time() < t1:
        cpu.tick()
        got = r.xreadgroup("g", name, {stream: ">"}, count=BATCH, block=20)
        ids = [sid for _, entries in got for sid, _ in entries]
        if ids:
            r.xack(stream, "g", *ids)
            r.xdel(stream, *ids)
            if time.time() >= t0:
                n += len(ids)
    out.put(("consumers", n, [], cpu.stop()))


# -- the buffer service ---------------------------------------------------------------------------------
def buffer_producer(address: str, tag: str, size: int, t0: float, t1: float, out: Any) -> None:
    """Encodes every group afresh (a new id each), puts them in batches of PUT_BATCH with PUT_WINDOW requests
    in flight; every group is acknowledged by the service ("ok"), "full" ones are put again."""
    from async_rlhf.buffer.client import BufferClient, encode_group

    c = BufferClient(address, timeout_s=30.0)
    group = make_group(f"{tag}-0", payload_bytes=size)
    lat: list[float] = []
    sent_at: dict[int, float] = {}
    retry: list[bytes] = []
    counter = iter(range(1, 1 << 62))

    per_request = put_batch(size)

    def batches():
        while time.time() < t1:
            batch = retry[:per_request]
            del retry[:len(batch)]
            while len(batch) < per_request:
                group.group_id = f"{tag}-{next(counter)}"
                batch.append(encode_group(group))
            sent_at[id(batch)] = time.perf_counter()
            yield batch

    time.sleep(max(0.0, t0 - time.time() - 0.2))
    cpu = CpuWindow(t0)
    for batch, status in c.put_pipelined(batches(), window=put_window(size)):
        cpu.tick()
        done = time.perf_counter()
        if time.time() >= t0:
            lat.append(done - sent_at.pop(id(batch)))
        else:
            sent_at.pop(id(batch))
        full = [g for g, st in zip(batch, status, strict=True) if st == "full"]
        if full:  # the buffer is at capacity (consumers are behind): put them again a little later
            retry += full
            time.sleep(0.005)
    spent = cpu.stop()
    c.close()
    out.put(("producers", 0, lat, spent))


def buffer_consumer(address: str, name: str, t0: float, t1: float, out: Any) -> None:
    """Gets up to GET_BATCH groups per request (their bytes and ids, not decoded); acks them with the next get."""
    from async_rlhf.buffer.client import BufferClient

    c = BufferClient(address, timeout_s=30.0, consumer=name)
    n = 0
    done: list[str] = []
    cpu = CpuWindow(t0)
    while time.time() < t1:
        cpu.tick()
        ids, groups = c.get_encoded(GET_BATCH, 0, wait_s=0.05, at_least=1, ack=done)
        done = ids  # acknowledged with the next get
        if ids and time.time() >= t0:
            n += len(groups)
    spent = cpu.stop()
    if done:
        c.ack(done)
    c.close()
    out.put(("consumers", n, [], spent))


def start_service(store: str, redis_url: str, prefix: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "async_rlhf.buffer", f"buffer.port={port}", f"buffer.store={store}",
         f"buffer.redis_url={redis_url}", f"buffer.redis_prefix={prefix}", "train.batch_size=2048",
         "train.max_staleness=0", "buffer.capacity=4096"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"buffer service did not start: {line!r}")
    return proc, line.split()[1]


def run_procs(targets: list[tuple], seconds: float) -> tuple[int, list[float], dict[str, float]]:
    """Run every target (fn, args[, kwargs]) in its own process; (groups consumed, put latencies, CPU seconds
    by role)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=t[0], args=(*t[1], out), kwargs=t[2] if len(t) > 2 else {}) for t in targets]
    for p in procs:
        p.start()
    consumed, lat, cpu = 0, [], {"producers": 0.0, "consumers": 0.0, "service": 0.0}
    for _ in targets:
        role, n, samples, spent = out.get(timeout=seconds + 60)
        consumed += n
        lat += samples
        cpu[role] += spent
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return consumed, lat, cpu


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_msg_us(cpu: dict[str, float], consumed: int) -> dict[str, float]:
    """CPU microseconds per consumed group, by role and in total (all processes of the run)."""
    out = {role: round(s / consumed * 1e6, 1) if consumed else 0.0 for role, s in cpu.items()}
    out["total"] = round(sum(cpu.values()) / consumed * 1e6, 1) if consumed else 0.0
    return out


def measure_raw_zmq(size: int, producers: int, consumers: int, seconds: float) -> tuple[float, dict[str, float]]:
    # PUSH/PULL fans out to one bound PULL per consumer; producers connect to all of them
    ports = [free_port() for _ in range(consumers)]
    t0 = time.time() + WARMUP_S
    t1 = t0 + seconds
    targets: list[tuple[Any, tuple]] = [(raw_zmq_consumer, (f"tcp://127.0.0.1:{p}", t0, t1)) for p in ports]
    targets += [(raw_zmq_producer, (f"tcp://127.0.0.1:{ports[i % consumers]}", size, t0, t1))
                for i in range(producers)]
    consumed, _, cpu = run_procs(targets, seconds)
    return consumed / seconds, per_msg_us(cpu, consumed)


def measure_raw_relay(size: int, producers: int, consumers: int, seconds: float) -> tuple[float, dict[str, float]]:
    """Producers -> one forwarding process -> consumers, all raw pyzmq (see :func:`raw_zmq_relay`)."""
    inbound, outbound = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    t0 = time.time() + WARMUP_S
    t1 = t0 + seconds
    targets: list[tuple] = [(raw_zmq_relay, (inbound, outbound, t0, t1))]
    targets += [(raw_zmq_consumer, (outbound, t0, t1), {"bind": False}) for _ in range(consumers)]
    targets += [(raw_zmq_producer, (inbound, size, t0, t1)) for _ in range(producers)]
    consumed, _, cpu = run_procs(targets, seconds)
    return consumed / seconds, per_msg_us(cpu, consumed)


def measure_raw_redis(url: str, size: int, producers: int, consumers: int,
                      seconds: float) -> tuple[float, dict[str, float]]:
    import redis

    stream = f"raw:{size}:{producers}:{time.time_ns()}"
    r = redis.Redis.from_url(url)
    r.xgroup_create(stream, "g", id="0", mkstream=True)
    t0 = time.time() + WARMUP_S
    t1 = t0 + seconds
    targets: list[tuple[Any, tuple]] = [(raw_redis_consumer, (url, stream, f"c{i}", t0, t1)) for i in range(consumers)]
    targets += [(raw_redis_producer, (url, stream, size, t0, t1)) for _ in range(producers)]
    consumed, _, cpu = run_procs(targets, seconds)
    r.delete(stream)
    return consumed / seconds, per_msg_us(cpu, consumed)  # the redis-server's own CPU is not counted


def measure_buffer(store: str, url: str, size: int, producers: int, consumers: int,
                   seconds: float) -> tuple[float, float, float, dict[str, float]]:
    proc, address = start_service(store, url, prefix=f"bench:{store}:{size}:{producers}:{time.time_ns()}")
    service_cpu: list[float] = []

    def sample_service() -> None:  # the service's CPU over the same window as the clients'
        for at in (t0, t1):
            time.sleep(max(0.0, at - time.time()))
            service_cpu.append(proc_cpu_s(proc.pid))

    try:
        t0 = time.time() + WARMUP_S
        t1 = t0 + seconds
        sampler = threading.Thread(target=sample_service, daemon=True)
        sampler.start()
        targets: list[tuple[Any, tuple]] = [(buffer_consumer, (address, f"c{i}", t0, t1)) for i in range(consumers)]
        targets += [(buffer_producer, (address, f"p{i}", size, t0, t1)) for i in range(producers)]
        consumed, lat, cpu = run_procs(targets, seconds)
        sampler.join(timeout=seconds + 10)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    cpu["service"] = service_cpu[1] - service_cpu[0] if len(service_cpu) == 2 else 0.0
    p50, p99 = (float(np.percentile(lat, q)) * 1000 for q in (50, 99)) if lat else (0.0, 0.0)
    return consumed / seconds, p50, p99, per_msg_us(cpu, consumed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, the load test at 16 KB only (< 1 min)")
    ap.add_argument("--seconds", type=float, default=None, help="measuring time per row")
    ap.add_argument("--fsync", default="everysec", choices=("everysec", "always", "no"),
                    help="appendfsync of the private redis-server")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measure raw and buffer alternately this many times and report medians (default: 1 with "
                         "--quick, else 3); on a shared machine this keeps load swings from deciding the ratio")
    args = ap.parse_args()
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    repeats = max(1, args.repeats or (1 if args.quick else 3))
    global WARMUP_S
    WARMUP_S = 0.5 if args.quick else 1.0
    cases = [(s, 1, 1) for s in PAYLOADS]
    cases += [(16 << 10, 16, 4)] if args.quick else [(s, 16, 4) for s in PAYLOADS]
    rows = []
    print(CLIENT_NOTE)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp, fsync=args.fsync).start()
        try:
            for size, producers, consumers in cases:
                suffix = "" if producers == 1 else f"-{producers}p{consumers}c"
                for store in ("memory", "redis"):
                    raws, runs, relays = [], [], []
                    for _ in range(repeats):  # alternate, so both see the same swings of the machine's load
                        raws.append(measure_raw_zmq(size, producers, consumers, seconds) if store == "memory"
                                    else measure_raw_redis(server.url, size, producers, consumers, seconds))
                        runs.append(measure_buffer(store, server.url, size, producers, consumers, seconds))
                        if store == "memory":
                            relays.append(measure_raw_relay(size, producers, consumers, seconds))
                    raw = float(np.median([r[0] for r in raws]))
                    rate, p50, p99 = (float(np.median([r[i] for r in runs])) for i in range(3))
                    rows.append({"store": store + suffix, "payload_bytes": size, "msgs_per_s": round(rate, 1),
                                 "raw_msgs_per_s": round(raw, 1), "ratio": round(rate / raw, 3) if raw else 0.0,
                                 "p50_ms": round(p50, 3), "p99_ms": round(p99, 3), "repeats": repeats,
                                 "cpu_us_per_msg": median_cpu([r[3] for r in runs]),
                                 "raw_cpu_us_per_msg": median_cpu([r[1] for r in raws])})
                    if relays:  # what a broker costs before it does anything: same producers and consumers
                        relay = float(np.median([r[0] for r in relays]))
                        rows[-1].update({"relay_msgs_per_s": round(relay, 1),
                                         "relay_ratio": round(rate / relay, 3) if relay else 0.0,
                                         "relay_cpu_us_per_msg": median_cpu([r[1] for r in relays])})
                    print_row(rows[-1], header=len(rows) == 1)
        finally:
            server.stop()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"rows": rows, "client": CLIENT_NOTE}, indent=2))
    return 0


def median_cpu(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(float(np.median([r[k] for r in runs])), 1) for k in runs[0]}


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'store':<14}{'payload':>9}{'msgs/s':>11}{'raw msgs/s':>12}{'ratio':>8}{'put p50 ms':>12}"
              f"{'put p99 ms':>12}   CPU us/msg: buffer (producers+service+consumers) | raw (producers+consumers)")
    cpu, raw = row["cpu_us_per_msg"], row["raw_cpu_us_per_msg"]
    print(f"{row['store']:<14}{row['payload_bytes']:>9}{row['msgs_per_s']:>11.0f}{row['raw_msgs_per_s']:>12.0f}"
          f"{row['ratio']:>8.2f}{row['p50_ms']:>12.3f}{row['p99_ms']:>12.3f}   "
          f"{cpu['total']:.1f} ({cpu['producers']:.1f}+{cpu['service']:.1f}+{cpu['consumers']:.1f}) | "
          f"{raw['total']:.1f} ({raw['producers']:.1f}+{raw['consumers']:.1f})", flush=True)
    if "relay_msgs_per_s" in row:
        relay = row["relay_cpu_us_per_msg"]
        print(f"{'  raw relay':<14}{'':>9}{row['relay_msgs_per_s']:>11.0f}{'':>12}{row['relay_ratio']:>8.2f}"
              f"{'':>24}   {relay['total']:.1f} ({relay['producers']:.1f}+{relay['service']:.1f}+"
              f"{relay['consumers']:.1f})  <- the buffer's rate against a forwarding-only broker", flush=True)


if __name__ == "__main__":
    sys.exit(main())
