"""A LoRA learner's merged push into a real vLLM engine: the engine's log-probs must equal the learner's,
which come from the peft model itself (base layer + scaled B(A(x)), never merged on the learner side).

The learner's side is what ``LearnerActor`` does with ``train.lora.enabled``: ``wrap_lora``, ``MergedWeights``,
the push layout of its tensors (kept flat, as at ZeRO-0), ``refresh()`` before each push. Versions pushed:

    v1  adapters after 3 AdamW steps on a loss that moves them     -> max |logp difference| < 1e-4, and far
                                                                     from the base (so the match is not v0's)
    v2  3 more steps                                               -> < 1e-4 again, and far from v1
Between pushes the adapters are checked unchanged by the merge and the frozen base untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import stop_process
from fork_server import fork_context
from test_weight_sync_vllm import ENGINE_START_S, TIMEOUT_S, _engine
from vllm_engine import HOST, expect, max_diff

from async_rlhf.config import LoraConfig
from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import layout_to_wire

pytestmark = pytest.mark.integration


def learner_logprobs(model, seqs: list[list[int]]) -> list[list[float]]:
    """The learner's log-probs (``token_logprobs`` of the peft model's logits), every token after the first."""
    from async_rlhf.learner.batch import token_logprobs

    with torch.no_grad():
        ids = torch.tensor(seqs)
        return token_logprobs(model(input_ids=ids).logits, ids).tolist()


def train_adapters(model, optimizer, seqs: list[list[int]], steps: int) -> None:
    """A few optimizer steps that push the adapters somewhere (maximise the log-prob of ``seqs``)."""
    from async_rlhf.learner.batch import token_logprobs

    ids = torch.tensor(seqs)
    for _ in range(steps):
        loss = -token_logprobs(model(input_ids=ids).logits, ids).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_vllm_serves_the_lora_learners_merged_weights(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from async_rlhf.learner.lora import MergedWeights, wrap_lora
    from async_rlhf.learner.push import push_layout
    from async_rlhf.sync.sender import Sender
    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    policy = wrap_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       LoraConfig(enabled=True, r=8, alpha=16.0, target_modules="q_proj,v_proj,up_proj,down_proj"))
    policy.train()
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-2)
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    merged = MergedWeights(policy)
    buckets = push_layout(merged.tensors, 256 << 10, zero_stage=0)  # moves them into one flat buffer
    assert len(buckets) > 1
    layout = layout_to_wire(buckets)
    g = torch.Generator().manual_seed(7)
    seqs = torch.randint(0, policy.config.vocab_size, (4, 24), generator=g).tolist()
    target = torch.randint(0, policy.config.vocab_size, (4, 24), generator=g).tolist()

    sender = Sender(buckets, HOST, free_port(), timeout_s=TIMEOUT_S)
    ctx = fork_context()
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine, args=(str(model_dir), sender.port, layout, cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=ENGINE_START_S)
        assert expect(out, "epoch", ENGINE_START_S) == [0]

        def push_and_score(version: int) -> tuple[list[list[float]], dict]:
            adapters = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
            cmds.put(("receive", True))
            metrics = sender.push(merged.refresh(), version)
            (got,) = expect(out, "received")
            assert got["version"] == version
            for n, p in policy.named_parameters():
                if "lora_" in n:
                    assert torch.equal(p, adapters[n]), f"the merge changed the adapter {n}"
                else:
                    assert torch.equal(p, frozen[n]), f"the frozen base {n} changed"
            cmds.put(("score", seqs))
            return expect(out, "scores"), metrics

        policy.eval()
        base = learner_logprobs(policy, seqs)
        cmds.put(("score", seqs))
        assert max_diff(expect(out, "scores"), base) < 1e-4  # v0: B = 0, the base model

        diffs = []
        previous = base
        for version in (1, 2):
            policy.train()
            train_adapters(policy, optimizer, target, steps=3)
            policy.eval()
            want = learner_logprobs(policy, seqs)
            assert max_diff(want, previous) > 1e-2, "the adapters did not move: the check below would be vacuous"
            got, metrics = push_and_score(version)
            diffs.append(max_diff(got, want))
            assert diffs[-1] < 1e-4, f"v{version}: vLLM's log-probs differ from the learner's by {diffs[-1]:.2e}"
            # every base weight goes out, as with full fine-tuning (fp32: 4 bytes each)
            assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in merged.tensors.values())
            previous = want
        print(f"LoRA merged push: max |logp diff| v1 {diffs[0]:.3g}, v2 {diffs[1]:.3g}")
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
