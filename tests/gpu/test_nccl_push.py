"""NCCL push of 2 GiB from a learner GPU to a generator GPU through vLLM's PyNcclCommunicator, then the
generator killed mid-push: the push stops within its deadline with one error naming that member (the NCCL
contract in async_rlhf/sync/transport.py). Run: ``make test-gpu`` (needs 2 CUDA devices)."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from conftest import stop_process
from gpu_common import HOST, expect, need_gpus

pytestmark = pytest.mark.gpu

GIB = 1 << 30
TENSORS = 8  # 8 x 256 MiB of bf16


def specs():
    from async_rlhf.sync.layout import TensorSpec

    return [TensorSpec(f"layer{i}.weight", (GIB // TENSORS // 2,), "bfloat16") for i in range(TENSORS)]


def member(port: int, cmds, out) -> None:
    """A generator's receiving end on GPU 1 (what its vLLM worker runs), without the engine."""
    try:
        from async_rlhf.sync.layout import plan_buckets
        from async_rlhf.sync.receiver import Receiver
        from async_rlhf.sync.transport import make_transport

        torch.cuda.set_device(1)
        rx = Receiver(plan_buckets(specs(), 256 << 20), "gen0", HOST, port,
                      make_transport("nccl", "cuda:1", host_arena=True),  # as a generator: host arena
                      timeout_s=120.0, min_gbps=1.0)
        rx.join()
        out.put(("joined", os.getpid()))
        while cmds.get() == "receive":
            sums: list[float] = []
            got = rx.receive(lambda it, sums=sums: sums.extend(float(t.float().sum()) for _, t in it))
            out.put(("received", (got.version, sums, got.metrics["sync/transfer_s"],
                                  torch.cuda.max_memory_allocated(1))))
    except Exception:
        out.put(("crash", traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()


def test_nccl_push_of_2gib_then_a_member_killed_mid_push_is_named() -> None:
    need_gpus(2)
    from async_rlhf.sync.layout import plan_buckets
    from async_rlhf.sync.sender import PushError, Sender
    from async_rlhf.sync.transport import make_transport

    torch.cuda.set_device(0)
    buckets = plan_buckets(specs(), 256 << 20)
    assert sum(b.nbytes for b in buckets) >= 2 * GIB
    params = {s.name: torch.full(s.shape, float(i + 1), dtype=torch.bfloat16, device="cuda:0")
              for i, s in enumerate(specs())}
    sender = Sender(buckets, HOST, 0, make_transport("nccl", "cuda:0"), timeout_s=30.0, min_gbps=1.0)
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=member, args=(sender.port, cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=300.0)
        pid = expect(out, "joined", 300.0)
        cmds.put("receive")
        metrics = sender.push(params, 1)
        version, sums, transfer_s, gpu_peak = expect(out, "received")
        assert version == 1
        assert gpu_peak < 256 << 20, f"the member held {gpu_peak / GIB:.2f} GiB on its GPU: not streamed"
        assert sums == [float(i + 1) * (GIB // TENSORS // 2) for i in range(TENSORS)]
        print(f"NCCL push of {metrics['sync/bytes'] / GIB:.2f} GiB: {metrics['sync/push_s']:.2f} s "
              f"({metrics['sync/gbps']:.1f} GB/s), receiver transfer {transfer_s:.2f} s")

        cmds.put("receive")
        killer_at = time.monotonic() + 0.05  # mid-push: a 2 GiB transfer takes far longer than 50 ms

        def kill_soon() -> None:
            time.sleep(max(0.0, killer_at - time.monotonic()))
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
        t0 = time.monotonic()
        with pytest.raises(PushError) as err:
            sender.push(params, 2)
        assert err.value.failed_members == ["gen0"], str(err.value)
        assert time.monotonic() - t0 < 30.0 + 2 * GIB * 1 / 1e9 + 30, "the push outlived its deadline"
    finally:
        sender.close()  # destroys the communicator (ncclCommAbort): the stuck broadcast ends with it
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
