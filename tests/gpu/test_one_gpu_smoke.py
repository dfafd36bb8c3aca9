"""One GPU holds a learner and a generator (fractional GPUs): a learner step on the GPU, a gloo push of its
CUDA parameters (staged through the sender's CPU slots), vLLM's log-probs match the learner's in bf16, and
the engine serves v0 before the swap and v1 after it. Run: ``make test-gpu`` (needs 1 CUDA device)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from conftest import stop_process
from gpu_common import ENGINE_START_S, HOST, engine_process, expect, logprobs, max_diff, need_gpus

pytestmark = pytest.mark.gpu

BF16_TOL = 0.1
"""vLLM's bf16 kernels against transformers' bf16 forward of the same weights."""


def test_one_gpu_learner_step_gloo_push_and_logprobs_match(tmp_path: Path) -> None:
    need_gpus(1)
    from transformers import AutoModelForCausalLM

    from async_rlhf.config import load_config
    from async_rlhf.generator.engine_args import engine_kwargs
    from async_rlhf.learner.batch import collate, token_logprobs
    from async_rlhf.learner.device import Placer, pick_device
    from async_rlhf.learner.push import push_layout
    from async_rlhf.sync.group import free_port
    from async_rlhf.sync.layout import layout_to_wire
    from async_rlhf.sync.sender import Sender
    from async_rlhf.tiny.model import build_tiny_model
    from async_rlhf.types import Group, Sample

    cfg = load_config(None, ["resources.generator_gpus=0.5", "resources.learner_gpus=0.5", "model.dtype=bfloat16",
                             "sync.backend=gloo"])
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    placer = Placer(pick_device(["0"], torch.cuda.is_available()))
    model = placer.module(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16))
    params = dict(model.named_parameters())
    buckets = push_layout(params, 64 << 20, zero_stage=0)  # kept flat on the GPU: sent through the CPU slots
    assert next(iter(params.values())).device.type == "cuda"
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(0, model.config.vocab_size, (4, 24), generator=g).tolist()

    sender = Sender(buckets, HOST, free_port(), backend="gloo", timeout_s=120.0)
    ctx = mp.get_context("spawn")
    cmds, out = ctx.Queue(), ctx.Queue()
    engine = engine_kwargs(cfg)
    assert engine["gpu_memory_utilization"] < 0.5 and engine["async_scheduling"] is False
    proc = ctx.Process(target=engine_process, args=(str(model_dir), sender.port, layout_to_wire(buckets), engine,
                                                    cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=ENGINE_START_S)
        expect(out, "epoch", ENGINE_START_S)
        cmds.put(("score", seqs))
        v0 = logprobs(model.eval(), seqs)
        before = max_diff(expect(out, "scores"), v0)
        assert before < BF16_TOL, f"v0: vLLM and the learner differ by {before:.3g} before any push"

        # one learner step on the GPU, on a batch that went through the placer
        groups = [Group(f"g{i}", np.array(seqs[i][:8], np.int32), [
            Sample(np.array(seqs[i][8:16], np.int32), np.full(8, -1.0, np.float32), np.zeros(8, np.int32), r)
            for r in (0.0, 1.0)]) for i in range(2)]
        batch = placer.batch(collate(groups, pad_id=0, advantage="grpo"))
        assert batch.input_ids.device.type == "cuda" and batch.advantages.device.type == "cuda"
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        logp = token_logprobs(model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                              batch.input_ids)
        loss = -(logp * batch.loss_mask * batch.advantages[:, None]).sum() / batch.loss_mask.sum()
        loss.backward()
        opt.step()
        model.eval()
        v1 = logprobs(model, seqs)
        assert max_diff(v0, v1) > 5 * BF16_TOL, "the step moved the policy too little to tell versions apart"

        cmds.put(("receive", None))
        metrics = sender.push(dict(model.named_parameters()), 1)
        assert metrics["sync/pack_s"] > 0  # CUDA parameters staged into the gloo transport's CPU slots
        assert [g["version"] for g in expect(out, "received")] == [1]
        cmds.put(("score", seqs))
        after = expect(out, "scores")
        assert max_diff(after, v1) < BF16_TOL, "v1: vLLM does not serve the learner's pushed weights"
        assert max_diff(after, v0) > 2 * BF16_TOL, "the engine still serves v0 after the swap"
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
