"""A LoRA learner rank (``LearnerActor`` with ``train.lora.enabled``, a real one-rank DeepSpeed engine, no Ray):
the optimizer holds only the adapters, training leaves the base frozen, the KL reference is the base (adapters
off), and a checkpoint resumes exactly the way the launcher does it (the new rank starts from the checkpoint's
merged ``policy/`` and loads the DeepSpeed state: base weights back to the original base, adapters, optimizer
state, step and version), after which both ranks take the same step to the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("module_process_group")]
peft = pytest.importorskip("peft")


def _actor(model_dir: str, port: int):
    from async_rlhf.config import load_config
    from async_rlhf.learner.actor import LearnerActor

    cfg = load_config(None, [f"model.path={model_dir}", "train.batch_size=1", "train.lr=5e-2",
                             "train.lora.enabled=true", "train.lora.r=4", "train.objective.kl_coef=0.1",
                             "learner.pack=true", "learner.max_tokens_per_micro_batch=20"])
    return LearnerActor(0, 1, cfg, model_dir, "127.0.0.1", port, "")


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_learner_trains_only_adapters_and_resumes_exactly(tiny_model_dir, ragged_batch, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from async_rlhf.endpoints import free_port
    from async_rlhf.learner.lora import AdapterOff

    torch.set_num_threads(1)
    port = free_port()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    actor = _actor(str(tiny_model_dir), port)
    trainable = {id(p) for p in actor.engine.module.parameters() if p.requires_grad}
    in_optimizer = [p for group in actor.engine.optimizer.param_groups for p in group["params"]]
    assert in_optimizer and {id(p) for p in in_optimizer} == trainable
    names = {id(p): n for n, p in actor.engine.module.named_parameters()}
    assert all("lora_" in names[id(p)] for p in in_optimizer)
    assert isinstance(actor.ref_model, AdapterOff)

    batch = ragged_batch(base.config.vocab_size)
    for _ in range(2):
        m = actor._update(batch)
    assert m["ppo/kl_ref"] > 0  # the adapters moved away from the reference (the base)
    ids = batch.input_ids[:3]
    assert torch.allclose(_logits(actor.ref_model, ids), _logits(base, ids), atol=1e-6)
    assert (_logits(actor.engine.module, ids) - _logits(base, ids)).abs().max() > 1e-3
    merged = {n: t.clone() for n, t in actor.merged.refresh().items()}
    for n, p in base.named_parameters():
        if n not in actor.merged.adapted_names:
            assert torch.equal(merged[n], p), f"{n} is not adapted and must stay the base's"
    assert any(not torch.equal(merged[n], dict(base.named_parameters())[n]) for n in actor.merged.adapted_names)

    actor.step, actor.version = 2, 2
    ckpt = tmp_path / "ckpt"
    actor.save_checkpoint(str(ckpt))
    exported = AutoModelForCausalLM.from_pretrained(ckpt / "policy", dtype=torch.float32)
    assert (_logits(exported, ids) - _logits(actor.engine.module, ids)).abs().max() < 1e-4  # merged by default
    assert (ckpt / "policy" / "adapter" / "adapter_config.json").is_file()

    resumed = _actor(str(ckpt / "policy"), port)  # the launcher's resume: the merged policy, then the state
    restored = resumed.load_checkpoint(str(ckpt))
    assert (restored["step"], restored["version"], restored["critic_restored"]) == (2, 2, None)  # GRPO: no critic
    before = {n: p.detach().clone() for n, p in actor.engine.module.named_parameters()}
    for n, p in resumed.engine.module.named_parameters():
        assert torch.equal(p, before[n]), f"{n} differs after resume"
    assert torch.allclose(_logits(resumed.ref_model, ids), _logits(base, ids), atol=1e-6)  # not the merged one
    for n, t in resumed.merged.refresh().items():
        assert torch.equal(t, merged[n]), n

    actor._update(batch)
    resumed._update(batch)
    after = dict(actor.engine.module.named_parameters())
    moved = 0.0
    for n, p in resumed.engine.module.named_parameters():
        torch.testing.assert_close(p, after[n], rtol=0, atol=1e-6, msg=n)  # same optimizer state, same step
        moved = max(moved, (after[n] - before[n]).abs().max().item() if "lora_" in n else 0.0)
    assert moved > 1e-4
