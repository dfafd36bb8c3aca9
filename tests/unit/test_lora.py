"""LoRA (train.lora.*): config refusals, the merged weights the push sends, the adapter-off reference, the
merged Hugging Face export. The subject is learner/lora.py on the real tiny Qwen2 model and real peft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_rlhf.config import ConfigError, LoraConfig, load_config

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("overrides, words", [
    (["train.lora.r=0"], "r must be at least 1"),
    (["train.lora.alpha=0"], "alpha above 0"),
    (["train.lora.dropout=1"], "dropout in"),
    (["train.lora.target_modules=''"], "target_modules is empty"),
    (["learner.zero_stage=3"], "learner.zero_stage=3"),
    (["train.algorithm=online_dpo"], "grpo only"),
])
def test_bad_lora_settings_are_refused_naming_the_fix(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, ["train.lora.enabled=true", *overrides])
    load_config(None, overrides[:1] if "zero_stage" in overrides[0] else [])  # fine without LoRA


def test_lora_defaults_validate() -> None:
    cfg = load_config(None, ["train.lora.enabled=true", "train.lora.r=4", "learner.zero_stage=2"])
    assert cfg.train.lora.enabled and cfg.train.lora.r == 4 and cfg.train.lora.alpha == 32.0
    assert not load_config().train.lora.enabled


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from async_rlhf.tiny.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lora") / "model", seed=0)


def _model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _trained(path: Path, lora: LoraConfig):
    """The tiny model with adapters whose B is no longer zero (as after some training)."""
    from async_rlhf.learner.lora import wrap_lora

    torch.manual_seed(0)
    pm = wrap_lora(_model(path), lora)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return pm


def test_only_adapters_train_and_every_base_name_is_pushed(tiny: Path) -> None:
    from async_rlhf.learner.lora import MergedWeights, wrap_lora

    plain = _model(tiny)
    pm = wrap_lora(_model(tiny), LoraConfig(enabled=True, r=4, target_modules="q_proj,v_proj"))
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    merged = MergedWeights(pm)
    assert list(merged.tensors) == [n for n, _ in plain.named_parameters()]  # the full model's names, in order
    assert sorted(merged.adapted_names) == sorted(n for n in merged.tensors if n.endswith(("q_proj.weight",
                                                                                          "v_proj.weight")))
    # B starts at zero: version 0 is the base model the generators loaded
    for name, p in plain.named_parameters():
        assert torch.equal(merged.tensors[name], p), name


def test_merged_weights_give_the_adapted_models_logits_and_leave_the_adapters(tiny: Path) -> None:
    from async_rlhf.learner.lora import MergedWeights

    pm = _trained(tiny, LoraConfig(enabled=True, r=4, target_modules="q_proj,v_proj,down_proj"))
    adapters = {n: p.detach().clone() for n, p in pm.named_parameters() if "lora_" in n}
    merged = MergedWeights(pm)
    tensors = merged.refresh()
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    plain = _model(tiny)
    with torch.no_grad():
        before = plain(input_ids=ids).logits
        for name, p in plain.named_parameters():
            p.copy_(tensors[name])
        want = pm(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert (want - before).abs().max() > 0.05  # the adapters matter, so the match below is not the base's
    assert (got - want).abs().max() < 1e-4
    for n, p in pm.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, adapters[n]), f"{n} changed by the merge"
    # the push buffers keep their identity (the layout flattened them once); snapshot leaves them alone
    ptrs = [t.data_ptr() for t in merged.tensors.values()]
    with torch.no_grad():
        next(p for n, p in pm.named_parameters() if "lora_B" in n).add_(1.0)
    snap = merged.snapshot()
    assert [t.data_ptr() for t in merged.tensors.values()] == ptrs
    name = merged.adapted_names[0]
    assert not torch.equal(snap[name], merged.tensors[name])
    merged.refresh()
    assert torch.equal(snap[name], merged.tensors[name])


def test_reference_is_the_base_with_adapters_off(tiny: Path) -> None:
    from async_rlhf.learner.lora import AdapterOff

    pm = _trained(tiny, LoraConfig(enabled=True, r=4))
    pm.train()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = _model(tiny)(input_ids=ids).logits
    ref = AdapterOff(pm)(input_ids=ids).logits
    assert not ref.requires_grad
    assert torch.allclose(ref, base, atol=1e-6)
    assert (pm(input_ids=ids).logits - base).abs().max() > 0.05  # adapters back on afterwards


def test_export_is_the_merged_model_and_the_adapter(tiny: Path, tmp_path: Path) -> None:
    from async_rlhf.learner.lora import MergedWeights, export_merged

    pm = _trained(tiny, LoraConfig(enabled=True, r=4))
    export_merged(pm, str(tmp_path / "policy"), MergedWeights(pm))
    assert (tmp_path / "policy" / "adapter" / "adapter_config.json").is_file()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = _model(tmp_path / "policy")(input_ids=ids).logits
        want = pm(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-4


def test_a_target_that_is_not_there_is_named(tiny: Path) -> None:
    from async_rlhf.learner.lora import wrap_lora

    with pytest.raises(ValueError, match="train.lora.target_modules='nope_proj'"):
        wrap_lora(_model(tiny), LoraConfig(enabled=True, target_modules="nope_proj"))


def test_adapters_get_gradients_under_gradient_checkpointing(tiny: Path) -> None:
    """learner.gradient_checkpointing with LoRA: the frozen embeddings must not cut the adapters off the graph."""
    from async_rlhf.learner.lora import wrap_lora

    model = _model(tiny)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm = wrap_lora(model, LoraConfig(enabled=True, r=4))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    pm.train()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(4))
    pm(input_ids=ids).logits.logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().max() > 0 for g in grads.values())
    assert all(p.grad is None for p in pm.parameters() if not p.requires_grad)
