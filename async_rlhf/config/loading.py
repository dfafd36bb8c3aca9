"""YAML files and ``key=value`` overrides into a validated :class:`Config`."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from async_rlhf.config.checks import parse_reward_models
from async_rlhf.config.errors import ConfigError
from async_rlhf.config.roles import Config
from async_rlhf.config.rules import validate
from async_rlhf.config.secrets import fill_secrets


def _set_nested(obj: Any, dotted: str, raw: Any, origin: str) -> None:
    """Set ``a.b.c`` on nested sections, converting ``raw`` to the field's type (its rule is checked later, with
    every other field's, by ``validate``)."""
    parts = dotted.split(".")
    target = obj
    for i, part in enumerate(parts):
        known = set(type(target).model_fields)
        if part not in known:
            where = ".".join(parts[: i + 1])
            raise ConfigError(
                f"unknown config key '{where}' (from {origin}); known keys here: {', '.join(sorted(known))}"
            )
        if i == len(parts) - 1:
            hint = type(target).model_fields[part].annotation
            if typing.get_origin(hint) is typing.Literal:  # a choice: a string, checked against its values later
                hint = str
            setattr(target, part, _convert(raw, hint, dotted, origin))
        else:
            target = getattr(target, part)
            if not isinstance(target, BaseModel):
                raise ConfigError(f"config key '{dotted}' (from {origin}): '{part}' has no sub-keys")


def _convert(raw: Any, hint: Any, key: str, origin: str) -> Any:
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        raise ConfigError(f"config key '{key}' (from {origin}) is a section; set its fields, e.g. {key}.x=1")
    try:
        if hint is bool:
            if isinstance(raw, str):
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            return bool(raw)
        if hint in (int, float) and isinstance(raw, bool):
            raise ValueError(raw)  # YAML's yes/true would silently become 1
        if hint is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError(raw)
            return int(raw)
        if hint is float:
            return float(raw)
        if hint is str:
            if isinstance(raw, bool):  # YAML reads on/off (and yes/no) as booleans
                return "on" if raw else "off"
            return "" if raw is None else str(raw)
    except (TypeError, ValueError):
        wanted = {int: "an integer", float: "a number", bool: "true or false"}.get(hint, hint.__name__)
        raise ConfigError(f"config key '{key}' (from {origin}) wants {wanted}, got {raw!r}") from None
    return raw


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: ``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file, then ``key=value`` overrides; validated."""
    cfg = Config()
    if path:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}; check the path") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}".splitlines()[0]) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(data).__name__}")
        for key, value in flatten(data).items():
            _set_nested(cfg, key, value, str(p))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. train.steps=100")
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw) if raw else ""
        _set_nested(cfg, key.strip(), value, "command line")
    fill_secrets(cfg)  # what a run's config.json left out, from the environment (a resume)
    return validate(cfg)


def make_paths_absolute(cfg: Config) -> Config:
    """Resolve every path the user gave against the driver's working directory, in place: roles on other
    nodes (and Ray workers, whose working directory is their own) read the same absolute paths."""

    def absolute(path: str) -> str:
        return str(Path(path).resolve()) if path else path

    cfg.model.path = absolute(cfg.model.path)
    cfg.run.dir = absolute(cfg.run.dir)
    cfg.rewards.model_path = absolute(cfg.rewards.model_path)
    cfg.train.ppo.critic_path = absolute(cfg.train.ppo.critic_path)
    if cfg.train.ppo.reward_models:
        cfg.train.ppo.reward_models = ",".join(f"{absolute(p)}:{w:g}" for p, w in
                                               parse_reward_models(cfg.train.ppo.reward_models))
    if cfg.prompts.source == "file":
        cfg.prompts.path = absolute(cfg.prompts.path)
    return cfg
