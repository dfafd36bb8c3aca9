"""A vLLM engine computing in bf16 or fp16 receives weights pushed in its own dtype (a learner with
``model.dtype`` bf16 or fp16) and then matches a transformers forward of exactly those values.

An engine that computes in 16 bits differs from the fp32 reference by its own rounding, so the bound is
calibrated in the same run: before any push, the fresh engine is compared with the reference of its
checkpoint (``baseline``); after the push it must match the reference of the pushed weights about as well
(at most 2x baseline + 0.01), and clearly better than the reference of the weights it held before (5x),
so that keeping the old weights, or loading the new ones wrongly, fails. The fp32 engine, with the exact
tolerance and the tied lm_head trap, is in test_weight_sync_vllm.py (it also carries bf16 and fp16 on the
wire into fp32); byte-exact round trips of every dtype are in tests/distributed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import stop_process
from fork_server import fork_context
from test_weight_sync_vllm import ENGINE_START_S, TIMEOUT_S, _engine, layout_of, perturbed, reference_logprobs
from vllm_engine import HOST, expect, max_diff

from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import layout_from_wire
from async_rlhf.sync.sender import Sender

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_engine_receives_weights_in_its_dtype(tmp_path: Path, dtype: str) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    wire = getattr(torch, dtype)
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    v0 = {n: p.detach().to(wire) for n, p in model.named_parameters()}  # what the engine loads at start
    v1 = {n: t.to(wire) for n, t in perturbed({n: t.float() for n, t in v0.items()}, 1).items()}
    g = torch.Generator().manual_seed(7)
    seqs = torch.randint(0, model.config.vocab_size, (4, 24), generator=g).tolist()

    layout = layout_of(v1)
    assert {b["dtype"] for b in layout} == {dtype} and len(layout) > 1
    sender = Sender(layout_from_wire(layout), HOST, free_port(), timeout_s=TIMEOUT_S)
    ctx = fork_context()
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine, args=(str(model_dir), sender.port, layout, cmds, out, dtype), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=ENGINE_START_S)
        assert expect(out, "epoch", ENGINE_START_S) == [0]
        ref0, ref1 = reference_logprobs(model, v0, seqs), reference_logprobs(model, v1, seqs)
        cmds.put(("score", seqs))
        baseline = max_diff(expect(out, "scores"), ref0)

        cmds.put(("receive", True))
        sender.push(v1, 1)
        assert [g["version"] for g in expect(out, "received")] == [1]
        cmds.put(("score", seqs))
        scores = expect(out, "scores")
        new, old = max_diff(scores, ref1), max_diff(scores, ref0)
        print(f"{dtype} engine, max |logp diff|: fresh engine vs its checkpoint {baseline:.3g}; after the push "
              f"vs the pushed weights {new:.3g}, vs the previous weights {old:.3g}")
        assert new <= 2 * baseline + 0.01, f"{dtype}: {new:.3g} vs the pushed weights (baseline {baseline:.3g})"
        assert old >= 5 * new, f"{dtype}: the engine is as close to the old weights ({old:.3g}) as to the new"
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
