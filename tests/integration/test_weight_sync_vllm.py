"""A real vLLM engine receives pushed weights through the worker extension; its prompt log-probs must
match a transformers forward of the sender's weights (tied embeddings included).

One fp32 engine, in a process of its own (vLLM binds threads; none of that should leak into pytest). The
sender is this process. Versions pushed, in order:

    v1  fp32, perturbed, loaded WITHOUT the tied lm_head refresh  -> logits stay stale: large difference
        (proves the comparison catches a stale tied lm_head, whose parameter checksums all match)
    v2  fp32, perturbed again, with the refresh                   -> max |logp difference| < 1e-4
    v3  bf16 tensors on the wire (a bf16 learner), loaded into the fp32 engine, compared with the fp32
        forward of the same bf16 values                           -> max |logp difference| < 1e-4
    v4  fp16 tensors on the wire (an fp16 learner), likewise      -> max |logp difference| < 1e-4

bf16 and fp16 travel into an fp32 engine here: bf16/fp16 -> fp32 is exact, so the tight fp32 tolerance
still detects a single wrong byte on the wire, and the conversion in vLLM's weight loaders (``copy_``) is
exercised too. Engines that compute in bf16 and fp16 are in test_weight_sync_dtypes.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import stop_process
from fork_server import fork_context
from vllm_engine import CPU_ENV, HOST, engine_process, expect, max_diff

from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import TensorSpec, layout_from_wire, layout_to_wire, plan_buckets
from async_rlhf.sync.sender import Sender
from async_rlhf.sync.tensors import dtype_name

pytestmark = pytest.mark.integration

ENGINE_START_S = 240.0
TIMEOUT_S = 60.0
BUCKET_BYTES = 256 << 10  # several buckets for a ~0.5 M-parameter model


def _engine(model_dir: str, port: int, layout: list, cmds, out, dtype: str = "float32") -> None:
    """The CPU engine of these tests (see tests/vllm_engine.py for its commands)."""
    engine_process(model_dir, port, layout, {"dtype": dtype, "enforce_eager": True, "max_model_len": 64}, cmds,
                   out, timeout_s=TIMEOUT_S, start_s=ENGINE_START_S, env=CPU_ENV)


def reference_logprobs(model, weights: dict[str, torch.Tensor], seqs: list[list[int]]) -> list[list[float]]:
    """transformers' log-prob of every token after the first, with ``weights`` loaded (in fp32)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name].to(torch.float32))
        ids = torch.tensor(seqs)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
        return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).tolist()


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.02 * torch.randn(t.shape, generator=g) for n, t in base.items()}


def layout_of(weights: dict[str, torch.Tensor]) -> list:
    specs = [TensorSpec(n, tuple(t.shape), dtype_name(t)) for n, t in weights.items()]
    return layout_to_wire(plan_buckets(specs, BUCKET_BYTES))


def test_vllm_receives_pushed_weights_fp32_and_bf16_with_tied_lm_head(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and "lm_head.weight" not in dict(model.named_parameters())
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    seqs = torch.randint(0, model.config.vocab_size, (4, 24), generator=g).tolist()

    fp32_layout = layout_of(base)
    assert len(fp32_layout) > 1
    sender = Sender(layout_from_wire(fp32_layout), HOST, free_port(), timeout_s=TIMEOUT_S)
    ctx = fork_context()
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine, args=(str(model_dir), sender.port, fp32_layout, cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=ENGINE_START_S)
        assert expect(out, "epoch", ENGINE_START_S) == [0]

        timings: list[dict] = []

        def push(weights: dict[str, torch.Tensor], version: int, refresh: bool) -> list[list[float]]:
            cmds.put(("receive", refresh))
            sender.push(weights, version)
            (got,) = expect(out, "received")
            assert got["version"] == version and got["sync/pause_s"] > 0
            timings.append(got)
            cmds.put(("score", seqs))
            return expect(out, "scores")

        cmds.put(("score", seqs))
        assert max_diff(expect(out, "scores"), reference_logprobs(model, base, seqs)) < 1e-4

        # v1 without the tied lm_head refresh: parameters are in, logits are not
        v1 = perturbed(base, 1)
        stale = max_diff(push(v1, 1, refresh=False), reference_logprobs(model, v1, seqs))
        assert stale > 0.05, f"skipping the lm_head refresh went unnoticed (max diff {stale:.2e})"

        # v2 with the refresh: exact up to fp32 kernel differences
        v2 = perturbed(base, 2)
        fresh = max_diff(push(v2, 2, refresh=True), reference_logprobs(model, v2, seqs))
        assert fresh < 1e-4, f"max |logp diff| {fresh:.2e} after a refreshed push (stale was {stale:.2e})"

        # v3: bf16 on the wire into the fp32 engine
        v3 = {n: t.to(torch.bfloat16) for n, t in perturbed(base, 3).items()}
        bf16_layout = layout_of(v3)
        assert {b["dtype"] for b in bf16_layout} == {"bfloat16"}
        sender.use_layout(layout_from_wire(bf16_layout))
        cmds.put(("layout", bf16_layout))
        expect(out, "layout")
        ref = reference_logprobs(model, v3, seqs)
        bf16 = max_diff(push(v3, 3, refresh=True), ref)
        assert bf16 < 1e-4, f"max |logp diff| {bf16:.2e} after a bf16 push"
        assert max_diff(ref, reference_logprobs(model, v2, seqs)) > 1e-2  # so the match is v3, not v2 kept

        # v4: fp16 on the wire into the fp32 engine
        v4 = {n: t.to(torch.float16) for n, t in perturbed(base, 4).items()}
        fp16_layout = layout_of(v4)
        assert {b["dtype"] for b in fp16_layout} == {"float16"}
        sender.use_layout(layout_from_wire(fp16_layout))
        cmds.put(("layout", fp16_layout))
        expect(out, "layout")
        ref = reference_logprobs(model, v4, seqs)
        fp16 = max_diff(push(v4, 4, refresh=True), ref)
        assert fp16 < 1e-4, f"max |logp diff| {fp16:.2e} after an fp16 push"
        assert max_diff(ref, reference_logprobs(model, v3, seqs)) > 1e-2

        print(f"max |logp diff|: no refresh {stale:.3g}, fp32 {fresh:.3g}, bf16 {bf16:.3g}, fp16 {fp16:.3g}; "
              "receiver timings (ms): "
              + "; ".join(", ".join(f"{k.removeprefix('sync/')} {v * 1e3:.1f}" for k, v in t.items() if "_s" in k)
                          for t in timings))
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
