"""ZeRO-3 on two GPUs (NCCL learner group, bf16): the push gathers a window at a time (learner/zero3.py). A
receiver on the host gets exactly the full model, and no rank's GPU grows by more than a few windows while
pushing, far below the model's size. Run: ``make test-gpu`` (needs 2 CUDA devices). Never run yet."""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from conftest import stop_process
from gpu_common import HOST, need_gpus

pytestmark = pytest.mark.gpu

GATHER_BYTES = 16 << 20


def rank_main(rank: int, port: int, out) -> None:
    try:
        import threading

        import deepspeed
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from async_rlhf.learner.engine import ds_config
        from async_rlhf.learner.push import full_params, push_layout
        from async_rlhf.learner.zero3 import windowed_gather
        from async_rlhf.sync.receiver import Receiver
        from async_rlhf.sync.sender import Sender

        torch.cuda.set_device(rank)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": HOST, "MASTER_PORT": str(port)})
        deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        eng, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(
            1, 1.0, zero_stage=3, dtype="bfloat16", world_size=2))
        module = eng.module
        buckets = push_layout(dict(module.named_parameters()), 64 << 20, 3)
        windows = windowed_gather(module, buckets, GATHER_BYTES, torch.device("cuda", rank))
        model_bytes = sum(b.nbytes for b in buckets)
        sender = rx = None
        got: dict[str, torch.Tensor] = {}
        if rank == 0:  # a generator's end on the host (gloo: the CUDA parameters go through the CPU slots)
            sender = Sender(buckets, HOST, 0, "gloo", timeout_s=120.0)
            rx = Receiver(buckets, "gen0", HOST, sender.port, "gloo", timeout_s=120.0)
            joined = threading.Thread(target=rx.join, daemon=True)
            joined.start()
            sender.form(["gen0"], timeout_s=120.0)
            joined.join(120)
            th = threading.Thread(target=lambda: rx.receive(lambda it: got.update((n, t.clone()) for n, t in it)),
                                  daemon=True)
            th.start()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if rank == 0:
            from async_rlhf.learner.zero3 import DONE

            try:
                sender.push(dict(module.named_parameters()), 1, windows)
            finally:
                windows.end_pass(DONE)
            th.join(120)
        else:
            windows.follow()
        grown = torch.cuda.max_memory_allocated() - base
        with full_params(eng, 3) as params:  # the reference, gathered whole once the push is measured
            equal = rank != 0 or all(torch.equal(got[n].cpu(), p.detach().cpu()) for n, p in params.items())
        out.put((rank, {"grown": grown, "model_bytes": model_bytes, "equal": equal, "windows": len(windows.windows)}))
    except Exception:
        out.put((rank, traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()


def test_zero3_push_on_two_gpus_gathers_a_window_at_a_time() -> None:
    need_gpus(2)
    from async_rlhf.endpoints import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            stop_process(p)
    for rank, res in got.items():
        assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
    assert got[0]["equal"] and got[0]["windows"] >= 4
    for res in got.values():  # the model is ~190 MB of bf16; a window is at most 16 MiB (plus DeepSpeed's buffers)
        assert res["grown"] < res["model_bytes"] / 2, res
