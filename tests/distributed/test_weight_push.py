"""The weight push over a real gloo group: one sender process and two receiver processes.

Results come back through a multiprocessing Queue as plain bytes, never through the group under test.
"""

import os
import queue
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from conftest import stop_process

from async_rlhf.sync.group import free_port, make_group
from async_rlhf.sync.layout import TensorSpec, layout_from_wire, layout_to_wire, plan_buckets
from async_rlhf.sync.receiver import acknowledge, receive_buckets
from async_rlhf.sync.sender import WeightSender, dtype_name

pytestmark = pytest.mark.distributed
torch.set_num_threads(1)

HOST = "127.0.0.1"
BUCKET_BYTES = 96
JOIN_S = 60.0


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        "embed.weight": torch.randn(6, 5, generator=g),                            # float32, 120 B
        "layer0.q": torch.randn(4, 4, generator=g),                                # float32, 64 B
        "layer0.norm": torch.randn(9, generator=g).to(torch.bfloat16),             # 18 B
        "layer0.bias": torch.randn(3, 2, generator=g).to(torch.float16),           # 12 B
        "layer1.q": torch.randn(2, 3, 2, generator=g),                             # float32, 48 B
        "layer1.norm": torch.randn(40, generator=g).to(torch.bfloat16),            # 80 B
        "position_ids": torch.arange(7, dtype=torch.int64) * 1_000_000_007,        # 56 B
        "counts": torch.randint(-2**40, 2**40, (3, 3), generator=g, dtype=torch.int64),  # 72 B
        "lm_head": torch.randn(30, generator=g).to(torch.float16),                 # 60 B
    }


def to_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    flat = t.detach().contiguous().reshape(-1)
    return dtype_name(t), tuple(t.shape), flat.view(torch.uint8).numpy().tobytes()


def layout_wire() -> list[dict]:
    specs = [TensorSpec(n, tuple(t.shape), dtype_name(t)) for n, t in make_params().items()]
    return layout_to_wire(plan_buckets(specs, BUCKET_BYTES))


def _exit(out) -> None:
    """Flush the report, then leave without the slow interpreter and torch teardown."""
    out.close()
    out.join_thread()
    os._exit(0)


def _sender(port: int, world: int, layout: list, timeout_s: float, out) -> None:
    torch.set_num_threads(1)
    try:
        pg = make_group(HOST, port, world, 0, timeout_s=timeout_s)
        sender = WeightSender(pg, layout_from_wire(layout), num_receivers=world - 1, timeout_s=timeout_s)
        t0 = time.monotonic()
        try:
            metrics = sender.push(make_params())
        except Exception as exc:  # the failure test expects this
            out.put(("sender", "error", f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
        else:
            out.put(("sender", "ok", metrics, time.monotonic() - t0))
    except Exception:
        out.put(("sender", "crash", traceback.format_exc(), 0.0))
    _exit(out)


def _receiver(port: int, world: int, rank: int, layout: list, timeout_s: float, out) -> None:
    torch.set_num_threads(1)
    try:
        pg = make_group(HOST, port, world, rank, timeout_s=timeout_s)
        try:
            named = receive_buckets(pg, layout_from_wire(layout), timeout_s)
            acknowledge(pg, timeout_s)
        except Exception as exc:
            out.put((f"receiver{rank}", "error", f"{type(exc).__name__}: {exc}", 0.0))
        else:
            out.put((f"receiver{rank}", "ok", {name: to_bytes(t) for name, t in named}, 0.0))
    except Exception:
        out.put((f"receiver{rank}", "crash", traceback.format_exc(), 0.0))
    _exit(out)


def _quitter(port: int, world: int, rank: int, timeout_s: float, out) -> None:
    """Joins the group, then dies without taking part in the broadcast."""
    torch.set_num_threads(1)
    try:
        make_group(HOST, port, world, rank, timeout_s=timeout_s)
        out.put((f"receiver{rank}", "quit", None, 0.0))
    except Exception:
        out.put((f"receiver{rank}", "crash", traceback.format_exc(), 0.0))
    _exit(out)


def run_processes(targets, expected: int, wait_s: float) -> dict[str, tuple]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, out), daemon=True) for fn, args in targets]
    results: dict[str, tuple] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + wait_s
        while len(results) < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                who, status, payload, elapsed = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and out.empty():
                    break
                continue
            results[who] = (status, payload, elapsed)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            stop_process(p)
        out.close()
    return results


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")


def test_push_reaches_every_receiver_exactly():
    layout = layout_wire()
    buckets = layout_from_wire(layout)
    assert len(buckets) >= 6  # small buckets: the push takes several broadcasts
    assert {b.dtype for b in buckets} == {"float32", "float16", "bfloat16", "int64"}
    port, world, timeout_s = free_port(), 3, 30.0
    results = run_processes(
        [(_sender, (port, world, layout, timeout_s)),
         (_receiver, (port, world, 1, layout, timeout_s)),
         (_receiver, (port, world, 2, layout, timeout_s))],
        expected=3, wait_s=JOIN_S,
    )
    assert set(results) == {"sender", "receiver1", "receiver2"}, results
    for who, (status, payload, _) in results.items():
        assert status == "ok", f"{who}: {payload}"

    params = make_params()
    expected = {name: to_bytes(t) for name, t in params.items()}
    for who in ("receiver1", "receiver2"):
        got = results[who][1]
        assert set(got) == set(expected)
        for name, (dtype, shape, data) in expected.items():
            assert got[name][0] == dtype, (who, name)
            assert got[name][1] == shape, (who, name)
            assert got[name][2] == data, (who, name)

    metrics = results["sender"][1]
    total = sum(t.numel() * t.element_size() for t in params.values())
    assert total == 120 + 64 + 18 + 12 + 48 + 80 + 56 + 72 + 60
    assert metrics["sync/bytes"] == float(total)
    assert 0.0 <= metrics["sync/broadcast_s"] <= metrics["sync/push_s"]


def test_push_fails_fast_when_a_receiver_never_joins_the_broadcast():
    layout = layout_wire()
    port, world, timeout_s = free_port(), 3, 5.0
    t0 = time.monotonic()
    results = run_processes(
        [(_sender, (port, world, layout, timeout_s)),
         (_receiver, (port, world, 1, layout, timeout_s)),
         (_quitter, (port, world, 2, timeout_s))],
        expected=3, wait_s=JOIN_S,
    )
    elapsed = time.monotonic() - t0
    assert "sender" in results, f"the sender never reported (hung?): {results}"
    status, payload, push_s = results["sender"]
    assert status == "error", f"the push did not raise: {status} {payload}"
    assert push_s < timeout_s + 5.0
    assert results["receiver2"][0] == "quit"
    # the live receiver does not hang either: it fails or (at most) completes, but reports
    assert "receiver1" in results and results["receiver1"][0] in ("error", "ok"), results.get("receiver1")
    assert elapsed < JOIN_S
