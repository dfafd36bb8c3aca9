"""``model.max_model_len`` and ``generator.max_new_tokens`` for a ``--model`` of the user's own.

Their defaults (64 and 6) are the tiny model's: a user's model left at them would run with a 64-token window and
6-token completions without a word. So for a ``model.path`` that is not a build of the tiny model, a key left at
its default takes the model's own value, at config time (``validate``):

    model.max_model_len      <- config.json: the smallest of max_position_embeddings, n_positions,
                                max_sequence_length, seq_length, n_ctx (or those of its text_config),
                                as vLLM reads the model's window; at most WINDOW_CAP (a 32k or 128k window
                                filled in whole would size every learner row and the engine's KV cache for it)
    generator.max_new_tokens <- generation_config.json: max_new_tokens

and where the model names none, the run is refused naming both keys. Reads JSON only (no torch, no transformers).
A key the user set (command line, YAML, a resumed run's config.json) is never changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from async_rlhf.config.errors import ConfigError
from async_rlhf.config.roles import Config, GeneratorConfig
from async_rlhf.config.sections import ModelConfig

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Where a Hugging Face config.json states the model's context window (the names vLLM reads too)."""
WINDOW_CAP = 4096
"""The longest window a default ``model.max_model_len`` takes from a model (prompt + completion tokens of RL
rollouts); a longer one is the user's to set, with ``learner.max_tokens_per_micro_batch`` to bound the learner."""
TINY_BUILD_FILE = "tiny_info.json"
"""What a finished build of the tiny policy holds (``async_rlhf.tiny.cache.INFO_FILE``): its defaults are the
configuration's own."""


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None where it is missing or unreadable (``check_model_dir`` names a bad config.json)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_context(meta: dict[str, Any]) -> int | None:
    """The model's context window from its config.json (the smallest stated; a multimodal config's text_config
    when the top level states none), None where it states none."""
    for section in (meta, meta.get("text_config")):
        if not isinstance(section, dict):
            continue
        found = [v for k in CONTEXT_KEYS if isinstance(v := section.get(k), int) and not isinstance(v, bool)
                 and v > 0]
        if found:
            return min(found)
    return None


def generation_max_new_tokens(meta: dict[str, Any] | None) -> int | None:
    """``max_new_tokens`` of a generation_config.json, None where it has none."""
    value = (meta or {}).get("max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def is_causal_lm(meta: dict[str, Any]) -> bool:
    """Whether a config.json names a causal LM architecture (what ``check_model_dir`` asks of ``--model``)."""
    return any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in meta.get("architectures") or [])


def own_model_dir(cfg: Config) -> Path | None:
    """``model.path`` when it is a Hugging Face directory of the user's (not a tiny-model build), else None."""
    if not cfg.model.path:
        return None
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file() or (path / TINY_BUILD_FILE).is_file():
        return None
    return path


def resolve_model_limits(cfg: Config) -> Config:
    """Fill ``model.max_model_len`` and ``generator.max_new_tokens`` left at their defaults from the user's model
    (see the module docstring), in place; ConfigError naming both keys where the model gives no value."""
    path = own_model_dir(cfg)
    if path is None:
        return cfg
    meta = read_json(path / "config.json")
    if meta is None or not is_causal_lm(meta):
        return cfg  # not a causal LM's directory: check_model_dir refuses it, naming what is wrong
    missing = []
    if "max_model_len" not in cfg.model.model_fields_set:
        context = model_context(meta)
        if context is None:
            missing.append(f"model.max_model_len ({path / 'config.json'} states no {' / '.join(CONTEXT_KEYS[:2])})")
        else:
            cfg.model.max_model_len = min(context, WINDOW_CAP)
    if "max_new_tokens" not in cfg.generator.model_fields_set:
        new_tokens = generation_max_new_tokens(read_json(path / "generation_config.json"))
        if new_tokens is None:
            missing.append(f"generator.max_new_tokens ({path / 'generation_config.json'} gives no max_new_tokens)")
        else:
            cfg.generator.max_new_tokens = new_tokens
    if missing:
        raise ConfigError(
            f"--model {path}: {' and '.join(missing)}; the defaults (model.max_model_len="
            f"{ModelConfig.model_fields['max_model_len'].default}, generator.max_new_tokens="
            f"{GeneratorConfig.model_fields['max_new_tokens'].default}) are the tiny model's: set "
            "model.max_model_len (prompt + completion tokens) and generator.max_new_tokens (longest completion) "
            "for this model and task")
    return cfg


def model_limits_line(cfg: Config) -> str:
    """What the dry run prints: the window and completion length the run will use, and where they come from."""
    window = cfg.generator.max_model_len or cfg.model.max_model_len
    engine = (f", vLLM's window generator.max_model_len={cfg.generator.max_model_len}"
              if cfg.generator.max_model_len else "")
    values = (f"model.max_model_len={cfg.model.max_model_len}{engine}, "
              f"generator.max_new_tokens={cfg.generator.max_new_tokens}")
    if not cfg.model.path:
        return f"model: the tiny model: {values} (the defaults)"
    path = Path(cfg.model.path)
    if own_model_dir(cfg) is None:
        return f"model: {path} (a tiny-model build): {values}"
    meta = read_json(path / "config.json") or {}
    stated = model_context(meta)
    gen = generation_max_new_tokens(read_json(path / "generation_config.json"))
    notes = [f"its config.json: a window of {stated}" if stated else "its config.json states no window",
             f"its generation_config.json: max_new_tokens {gen}" if gen else
             "its generation_config.json gives no max_new_tokens"]
    if window > (stated or window):
        notes.append(f"the window {window} is longer than the model's {stated}")
    elif stated and stated > window:
        notes.append(f"shorter than the model's: a default window is at most {WINDOW_CAP}, set model.max_model_len "
                     "for a longer one")
    return f"model: {path.resolve()}: {values} ({'; '.join(notes)})"
