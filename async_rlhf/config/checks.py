"""Checks of the reward, algorithm and environment keys (specs parsed, files looked at)."""

from __future__ import annotations

import json
from pathlib import Path

from async_rlhf.config.errors import ConfigError
from async_rlhf.config.roles import Config
from async_rlhf.config.secrets import mask_url


def parse_reward_models(spec: str) -> list[tuple[str, float]]:
    """``"DIR[:WEIGHT],DIR[:WEIGHT]"`` -> [(dir, weight)] (weight 1 when left out); ConfigError on a bad entry."""
    out: list[tuple[str, float]] = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        path, sep, weight = raw.rpartition(":")
        if not sep or "/" in weight:  # no weight given (the colon, if any, belongs to the path)
            path, weight = raw, "1"
        try:
            w = float(weight)
        except ValueError:
            raise ConfigError(f"train.ppo.reward_models entry {raw!r}: weight {weight!r} is not a number; "
                              "write DIR or DIR:WEIGHT") from None
        if not path or w != w or w in (float("inf"), float("-inf")):
            raise ConfigError(f"train.ppo.reward_models entry {raw!r} needs a directory and a finite weight")
        out.append((path, w))
    return out


def check_reward_model_dir(path: str) -> None:
    """Refuse a reward model that is not a one-label sequence-classification directory, naming the fix."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"train.ppo.reward_models: {path} is not a Hugging Face model directory (no config.json); "
                          "train one with python -m async_rlhf.offline.reward_model")
    try:
        meta = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"train.ppo.reward_models: {cfg_file} is unreadable ({exc})") from None
    archs = meta.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"train.ppo.reward_models: {path} is not a reward model (architectures: {archs or 'none'});"
                          " it must be a *ForSequenceClassification checkpoint with num_labels=1")
    labels = len(meta.get("id2label") or {}) or meta.get("num_labels", 1)
    if labels != 1:
        raise ConfigError(f"train.ppo.reward_models: {path} has {labels} labels; a reward model gives one score "
                          "(num_labels=1)")


def check_lora(cfg: Config) -> None:
    lora = cfg.train.lora
    if not lora.enabled:
        return
    if lora.r < 1 or not lora.alpha > 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(f"train.lora: r must be at least 1, alpha above 0 and dropout in [0, 1); got r={lora.r}, "
                          f"alpha={lora.alpha}, dropout={lora.dropout}")
    if not [m for m in lora.target_modules.split(",") if m.strip()]:
        raise ConfigError("train.lora.target_modules is empty: name the linear layers to adapt, e.g. q_proj,v_proj")
    if cfg.learner.zero_stage == 3:
        raise ConfigError("train.lora.enabled=true does not run under learner.zero_stage=3 (the merged push reads "
                          "whole base weights): use learner.zero_stage 0-2, or train.lora.enabled=false")
    if cfg.train.algorithm != "grpo":
        raise ConfigError(f"train.lora.enabled=true supports train.algorithm=grpo only (not tested with "
                          f"{cfg.train.algorithm}): set train.algorithm=grpo or train.lora.enabled=false")


def check_algorithm(cfg: Config) -> None:
    t = cfg.train
    if t.algorithm == "ppo":
        p = t.ppo
        models = parse_reward_models(p.reward_models)
        if not (models and p.reward_model_weight) and p.generator_reward_weight == 0:
            raise ConfigError("train.algorithm=ppo needs a reward: set train.ppo.reward_models=DIR[:WEIGHT] "
                              "(with train.ppo.reward_model_weight above 0) and/or train.ppo.generator_reward_weight "
                              "above 0")
        for path, _ in models:
            check_reward_model_dir(path)
        if p.critic_path:
            check_model_dir(p.critic_path)
        if not (0 <= p.gamma <= 1 and 0 <= p.lam <= 1):
            raise ConfigError("train.ppo.gamma and train.ppo.lam must lie in [0, 1]")
        if p.critic_lr <= 0 or min(p.value_clip, p.kl_coef, p.reward_clip, p.advantage_clip) < 0:
            raise ConfigError("train.ppo.critic_lr must be above 0 and value_clip, kl_coef, reward_clip, "
                              "advantage_clip 0 or more")
    if t.algorithm == "online_dpo":
        lc = cfg.learner
        if lc.max_tokens_per_micro_batch or lc.pack:
            raise ConfigError("learner.max_tokens_per_micro_batch and learner.pack apply to the policy-gradient "
                              "update (grpo, ppo); with train.algorithm=online_dpo set them to 0 and false")
        if t.group_size < 2:
            raise ConfigError("train.algorithm=online_dpo pairs the best and worst completion of a prompt: "
                              "set train.group_size to 2 or more")
        if t.dpo.beta <= 0 or not 0 <= t.dpo.label_smoothing < 0.5:
            raise ConfigError("train.dpo.beta must be above 0 and train.dpo.label_smoothing lie in [0, 0.5)")


def parse_reward_sources(spec: str) -> list[tuple[str, float]]:
    """``"task:1,model:0.5"`` -> [("task", 1.0), ("model", 0.5)]; ConfigError on an unknown name or weight."""
    out: list[tuple[str, float]] = []
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        name, _, weight = raw.partition(":")
        if name not in REWARD_SOURCES:
            raise ConfigError(f"rewards.sources entry {raw!r}: unknown source {name!r}; use "
                              f"{' | '.join(REWARD_SOURCES)} with an optional :weight")
        try:
            w = float(weight or 1.0)
        except ValueError:
            raise ConfigError(f"rewards.sources entry {raw!r}: weight {weight!r} is not a number") from None
        out.append((name, w))
    if not out:
        raise ConfigError("rewards.sources is empty: name at least one of " + ", ".join(REWARD_SOURCES))
    return out


REWARD_SOURCES = ("task", "function", "model", "http")


REPORT_TARGETS = ("tensorboard", "wandb", "mlflow", "none")
"""What ``run.report_to`` may name (none: metrics.jsonl only)."""


def parse_report_to(spec: str) -> list[str]:
    """``"tensorboard,wandb"`` -> ["tensorboard", "wandb"] (in order, each once; ``none`` -> []); ConfigError naming
    an unknown entry and the accepted ones."""
    names = [s.strip().lower() for s in spec.split(",")]
    accepted = ", ".join(REPORT_TARGETS)
    for name in names:
        if name not in REPORT_TARGETS:
            what = "an empty entry" if not name else f"unknown tracker {name!r}"
            raise ConfigError(f"run.report_to={spec!r}: {what}; use a comma-separated list of {accepted} "
                              "(e.g. run.report_to=tensorboard,wandb; none: only run.dir/metrics.jsonl)")
    if "none" in names and len(set(names)) > 1:
        raise ConfigError(f"run.report_to={spec!r}: none means no tracker, so it stands alone; use a "
                          f"comma-separated list of {accepted} (e.g. run.report_to=tensorboard,wandb)")
    return [] if "none" in names else list(dict.fromkeys(names))


def check_env(cfg: Config) -> None:
    r, p = cfg.rewards, cfg.prompts
    names = [n for n, _ in parse_reward_sources(r.sources)]
    if cfg.task.name in ("reward_model", "custom") and "task" in names:
        raise ConfigError(f"task.name={cfg.task.name} has no reward rule of its own: set rewards.sources to "
                          "model, function and/or http (e.g. rewards.sources=model)")
    if cfg.task.name == "reward_model" and "model" not in names:
        raise ConfigError("task.name=reward_model needs rewards.sources=model and rewards.model_path=DIR")
    needs = {"function": ("rewards.function", r.function), "model": ("rewards.model_path", r.model_path),
             "http": ("rewards.http_url", r.http_url)}
    for name in names:
        if name in needs and not needs[name][1]:
            raise ConfigError(f"rewards.sources names {name}: set {needs[name][0]} too")
    if r.model_path and "model" in names and not (Path(r.model_path) / "config.json").is_file():
        raise ConfigError(f"rewards.model_path={r.model_path} is not a Hugging Face model directory (no config.json);"
                          " train one with python -m async_rlhf.offline.reward_model")
    if r.http_url and not r.http_url.startswith(("http://", "https://")):
        raise ConfigError(f"rewards.http_url={mask_url(r.http_url)!r} must start with http:// or https://")
    if cfg.task.name == "custom" and p.source == "task":
        raise ConfigError("task.name=custom has no prompts of its own: set prompts.source to file, python or redis")
    if p.source in ("file", "python") and not p.path:
        raise ConfigError(f"prompts.source={p.source} needs prompts.path")
    if p.source == "file" and not Path(p.path).exists():
        raise ConfigError(f"prompts.path={p.path}: no such file; give a JSONL or Parquet file")
    if p.eval_path:
        if not Path(p.eval_path).is_file():
            raise ConfigError(f"prompts.eval_path={p.eval_path}: no such file; give a JSONL or Parquet file of "
                              "held-out prompts")
        if Path(p.eval_path).suffix.lower() not in (".jsonl", ".json", ".parquet"):
            raise ConfigError(f"prompts.eval_path={p.eval_path}: unknown format; use a .jsonl or .parquet file")
        p.eval_path = str(Path(p.eval_path).resolve())
    # actors may run in another working directory: pin relative paths to the launcher's
    if p.source == "file":
        p.path = str(Path(p.path).resolve())
    if r.model_path:
        r.model_path = str(Path(r.model_path).resolve())
    for attr, spec in (("function", r.function), ("path", p.path if p.source == "python" else "")):
        target, sep, name = spec.rpartition(":")
        if sep and target.endswith(".py"):
            if not Path(target).is_file():
                raise ConfigError(f"{'rewards.function' if attr == 'function' else 'prompts.path'}={spec}: "
                                  f"no such file {target}")
            setattr(r if attr == "function" else p, attr, f"{Path(target).resolve()}:{name}")


def check_model_dir(path: str) -> None:
    """Refuse a ``--model`` that is not a Hugging Face causal-LM directory, naming what is wrong."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--model {path}: no such directory; pass a Hugging Face causal-LM directory "
                          "or leave --model out to build the tiny model")
    if not p.is_dir():
        raise ConfigError(f"--model {path} is a file; pass the directory that holds config.json")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"--model {path} has no config.json: it is not a Hugging Face model directory")
    try:
        meta = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--model {path}: config.json is unreadable ({exc})") from None
    archs = meta.get("architectures") or []
    if not any(str(a).endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ConfigError(f"--model {path} is not a causal language model (architectures: {archs or 'none'}); "
                          "RL here needs a *ForCausalLM checkpoint")
