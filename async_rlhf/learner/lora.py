"""LoRA on the policy (``train.lora.*``, through peft), and what generators get from it: merged weights.

    learner                                              generators (vLLM, no LoRA support needed)
    -------                                              ----------
    peft model: base W frozen, adapters A, B trained
    after each optimizer step, on the training thread:
      merged[name] = W + scaling * B @ A   (own buffers,   push: every base name, as with full fine-tuning;
      the trained adapter is left as it is)        --->  the untargeted tensors straight from the frozen base

The pushed tensors keep the base model's names (``model.layers.0.self_attn.q_proj.weight``), so the layout,
the receivers and vLLM's ``reload_weights`` are those of full fine-tuning; vLLM's log-probs equal the
learner's (its forward adds the adapter's output to the base layer's, the engine multiplies by the merged
weight: the same up to float rounding). The Hugging Face export is the merged model too (``export_merged``).

The reference policy (KL to it) is the same module with the adapters switched off (:class:`AdapterOff`):
the frozen base, with no second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

ADAPTER = "default"
"""peft's name of the one adapter this learner trains."""


def wrap_lora(model: nn.Module, lora: Any) -> nn.Module:
    """``model`` (a causal LM) with LoRA adapters on ``lora.target_modules`` (``train.lora``); only the
    adapters are trainable. Raises ValueError naming the fix when a target is not a linear layer."""
    from peft import LoraConfig, get_peft_model

    targets = [m.strip() for m in lora.target_modules.split(",") if m.strip()]
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"train.lora.target_modules={lora.target_modules!r}: {exc}; name linear layers of this "
                         "model (e.g. q_proj,v_proj)") from None
    for name, module in lora_layers(peft_model):
        if not isinstance(module.base_layer, nn.Linear):
            raise ValueError(f"train.lora.target_modules: {name} is a {type(module.base_layer).__name__}, the "
                             "merged push handles linear layers only; leave it out of train.lora.target_modules")
    return peft_model


def lora_layers(peft_model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(base name, module) of every LoRA-wrapped layer, the base name as in the model without peft."""
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def base_name(peft_name: str) -> str:
    """The Hugging Face name of a base parameter, from its name inside the peft model's base model."""
    return peft_name.replace(".base_layer.", ".")


class MergedWeights:
    """The tensors a LoRA learner pushes, by base name: frozen base tensors as they are, and for every
    adapted linear layer a buffer of its own that :meth:`refresh` sets to ``W + scaling * B @ A``.

    The dict (:attr:`tensors`) is built once and its tensors keep their identity, so the push layout can
    move them into one flat buffer (``flatten_params``) and every push sends straight from it.
    """

    def __init__(self, peft_model: nn.Module) -> None:
        self.model = peft_model
        base = peft_model.get_base_model()
        self._merged: list[tuple[Any, Tensor]] = []
        adapted = {}
        for name, module in lora_layers(peft_model):
            w = module.base_layer.weight
            buf = torch.empty_like(w, requires_grad=False)
            adapted[f"{name}.weight"] = buf
            self._merged.append((module, buf))
        self.tensors: dict[str, Tensor] = {}
        for name, p in base.named_parameters():
            if "lora_" in name:
                continue
            clean = base_name(name)
            self.tensors[clean] = adapted.get(clean, p)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> dict[str, Tensor]:
        """Recompute every merged weight from the current adapters (the adapters are not changed)."""
        for module, buf in self._merged:
            a = module.lora_A[ADAPTER].weight
            b = module.lora_B[ADAPTER].weight
            w = module.base_layer.weight
            torch.addmm(w, b.to(w.dtype), a.to(w.dtype), alpha=module.scaling[ADAPTER], out=buf)
        return self.tensors

    @torch.no_grad()
    def snapshot(self) -> dict[str, Tensor]:
        """A copy of the merged weights from the current adapters, into new tensors: the push buffers (which a
        push in flight may be reading) are left alone."""
        out = {n: t.detach().clone() for n, t in self.tensors.items()}
        for (module, buf), name in zip(self._merged, self.adapted_names):
            w = module.base_layer.weight
            out[name] = torch.addmm(w, module.lora_B[ADAPTER].weight.to(w.dtype),
                                    module.lora_A[ADAPTER].weight.to(w.dtype), alpha=module.scaling[ADAPTER])
        return out

    @property
    def adapted_names(self) -> list[str]:
        """Base names of the merged (adapted) weights."""
        names = {id(t): n for n, t in self.tensors.items()}
        return [names[id(buf)] for _, buf in self._merged]


class AdapterOff:
    """The reference policy of a LoRA learner: the policy's own module with its adapters switched off,
    without gradient (the frozen base). Called like a model: ``ref(input_ids=..., ...)``."""

    def __init__(self, peft_model: nn.Module) -> None:
        self.model = peft_model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), self.model.disable_adapter():
            return self.model(*args, **kwargs)


def export_merged(peft_model: nn.Module, out_dir: str, merged: MergedWeights) -> None:
    """Write the merged policy as a plain Hugging Face model directory (what vLLM and ``from_pretrained``
    load), and the adapter alone (peft format) under ``out_dir/adapter``."""
    base = peft_model.get_base_model()
    plain = _plain_copy(base, merged.snapshot())
    plain.save_pretrained(out_dir)
    peft_model.save_pretrained(f"{out_dir}/adapter")


def _plain_copy(base: nn.Module, state: dict[str, Tensor]) -> nn.Module:
    """A model of the base's class and config without LoRA layers, holding ``state``."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
    plain.load_state_dict(state, strict=False, assign=True)
    plain.tie_weights()
    missing = [n for n, p in plain.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"the merged export has no tensor for {missing[:3]}")
    return plain
