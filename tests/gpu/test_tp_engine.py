"""A tensor-parallel engine (TP=2, two GPUs) receives a push: each TP worker joins the push group as a member
of its own (gen0.tp0, gen0.tp1, through collective_rpc), all load the same version, and the engine's log-probs
match a transformers forward of the pushed weights. Run: ``make test-gpu`` (needs 2 CUDA devices)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import stop_process
from gpu_common import ENGINE_START_S, HOST, engine_process, expect, logprobs, max_diff, need_gpus

pytestmark = pytest.mark.gpu

FP32_TOL = 1e-3
"""fp32 engine against fp32 transformers; TP's split reductions add a little to the single-GPU difference."""


def test_tp2_engine_receives_a_push(tmp_path: Path) -> None:
    need_gpus(2)
    from transformers import AutoModelForCausalLM

    from async_rlhf.config import load_config
    from async_rlhf.generator.engine_args import engine_kwargs
    from async_rlhf.sync.group import free_port
    from async_rlhf.sync.layout import TensorSpec, layout_to_wire, plan_buckets
    from async_rlhf.sync.protocol import tp_member_ids
    from async_rlhf.sync.sender import Sender
    from async_rlhf.sync.tensors import dtype_name
    from async_rlhf.tiny.model import build_tiny_model

    cfg = load_config(None, ["resources.tensor_parallel=2", "resources.generator_gpus=2",
                             "resources.learner_gpus=1", "model.dtype=float32"])
    engine = engine_kwargs(cfg)
    assert engine["tensor_parallel_size"] == 2
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # the learner, on CPU
    g = torch.Generator().manual_seed(5)
    pushed = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    buckets = plan_buckets([TensorSpec(n, tuple(t.shape), dtype_name(t)) for n, t in pushed.items()], 256 << 10)
    seqs = torch.randint(0, model.config.vocab_size, (4, 24), generator=g).tolist()

    sender = Sender(buckets, HOST, free_port(), backend="gloo", timeout_s=120.0)
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine_process, args=(str(model_dir), sender.port, layout_to_wire(buckets), engine,
                                                    cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(tp_member_ids("gen0", 2), timeout_s=ENGINE_START_S)  # both TP workers, or this times out
        assert sender.members == ["gen0.tp0", "gen0.tp1"]
        assert expect(out, "epoch", ENGINE_START_S) == [0, 0]
        cmds.put(("receive", None))
        sender.push(pushed, 1)
        assert [g["version"] for g in expect(out, "received")] == [1, 1]  # every worker loaded version 1
        cmds.put(("score", seqs))
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(pushed[name])
        diff = max_diff(expect(out, "scores"), logprobs(model, seqs))
        assert diff < FP32_TOL, f"the TP=2 engine serves other weights than pushed (max |logp diff| {diff:.3g})"
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
