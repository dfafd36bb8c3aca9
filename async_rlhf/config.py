"""Typed run configuration: one dataclass per component, YAML files plus ``key=value`` overrides.

This module imports no torch, ray or vllm: the launcher validates a configuration (and refuses bad
input with one clear line) before anything heavy starts.

    cfg = load_config("run.yaml", ["train.steps=200", "generator.temperature=0.8"])
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml


class ConfigError(ValueError):
    """A configuration the run cannot start with; the message names the problem and the fix."""


@dataclass
class ModelConfig:
    path: str = ""
    """A Hugging Face causal-LM directory on disk; empty builds the tiny model (and its SFT warm start)."""
    dtype: str = "float32"
    """Parameter dtype on the learner and in vLLM (float32 | bfloat16 | float16)."""
    max_model_len: int = 64
    """Longest prompt + completion, in tokens, that vLLM must hold."""


@dataclass
class TaskConfig:
    name: str = "addition"
    """The environment: addition (the tiny verifiable task)."""
    digits: int = 2
    """Digits per operand of the addition task."""
    heldout_size: int = 200
    """Problems kept out of training for greedy held-out accuracy."""
    sft_steps: int = 600
    """Optimizer steps of the SFT warm start of the tiny model (cached on disk)."""
    sft_forget_carry: float = 0.65
    """Share of SFT examples whose target is a sloppy teacher's carry-free sum: the warm start is then right
    on problems without a carry (~27% greedy) and samples the true sum often enough for RL to take over."""


@dataclass
class ObjectiveConfig:
    kind: str = "decoupled_ppo"
    """Policy objective: ppo | decoupled_ppo | decoupled_ppo_interp | tis_token | tis_seq | mask_token |
    mask_seq | vtrace."""
    eps_low: float = 0.2
    """Lower clip range of the PPO ratio (1 - eps_low)."""
    eps_high: float = 0.28
    """Upper clip range of the PPO ratio (1 + eps_high); asymmetric clipping when it differs from eps_low."""
    is_cap: float = 5.0
    """Truncation (or upper mask bound) of the behaviour importance weight exp(prox - mu)."""
    is_floor: float = 0.0
    """Lower mask bound of the importance weight (mask_* objectives only)."""
    truncate_mode: str = "clamp"
    """What happens above is_cap in decoupled PPO: clamp (truncate) or mask (drop the token)."""
    aggregation: str = "token_mean"
    """Loss reduction: token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference model (0 disables the reference)."""
    kl_estimator: str = "k3"
    """KL estimator: k1 | k2 | k3."""


@dataclass
class TrainConfig:
    steps: int = 300
    """Learner optimizer steps of the run."""
    batch_size: int = 16
    """Prompt groups per learner step (across all learner ranks)."""
    group_size: int = 8
    """Completions sampled per prompt (the GRPO group)."""
    max_staleness: int = 2
    """Largest version lag a trained token may have; 0 is synchronous on-policy training."""
    lr: float = 2e-4
    """Learning rate (AdamW)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    advantage: str = "grpo"
    """Advantage estimator: grpo | dr_grpo | rloo | reinforce_pp."""
    push_every: int = 1
    """Learner steps between weight pushes (one push makes one new version)."""
    minibatches: int = 1
    """Optimizer steps per learner step (the batch is split); with more than one, the proximal policy is
    recomputed at the start of the step (or interpolated, for decoupled_ppo_interp)."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)


@dataclass
class GeneratorConfig:
    max_new_tokens: int = 6
    """Longest completion, in tokens."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts."""
    groups_in_flight: int = 8
    """Prompt groups each generator keeps in flight (subject to the admission rule)."""
    update_mode: str = "in_flight"
    """How a new version is loaded: in_flight (pause between engine steps, swap, resume) or drain."""
    kv_cache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE per engine, GiB."""
    threads: int = 1
    """Torch threads per generator process."""
    eval_every: int = 25
    """Generator 0 measures held-out greedy accuracy every this many versions (0 disables)."""


@dataclass
class LearnerConfig:
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0-3)."""
    threads: int = 1
    """Torch threads per learner rank."""
    backend: str = "gloo"
    """torch.distributed backend of the learner group (gloo on CPU, nccl on GPU)."""


@dataclass
class BufferConfig:
    store: str = "memory"
    """Where rollouts are kept: memory (embedded default) or redis."""
    host: str = "127.0.0.1"
    """Address the buffer service binds (loopback by default)."""
    port: int = 0
    """Port of the buffer service; 0 picks a free one."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (password and TLS in the URL) when store is redis."""
    max_message_mb: int = 64
    """Largest message the service accepts."""
    request_timeout_s: float = 30.0
    """How long a client waits for the service before it reports the service as unreachable."""
    redis_prefix: str = "async_rlhf:buffer"
    """Prefix of every Redis key of this buffer (one buffer service per prefix)."""
    redis_retry_s: float = 30.0
    """How long the service waits for an unreachable Redis (restarting, loading its AOF) before failing a request."""
    capacity: int = 1024
    """Most groups held or delivered-unacked at once (0: unbounded); admission and put push back beyond it."""
    policy: str = "fifo"
    """Sampling policy: fifo | freshest (highest min version first) | evict_stale (full: evict the oldest version)."""
    visibility_timeout_s: float = 600.0
    """A delivered group not acknowledged within this many seconds is delivered again (its learner is presumed dead)."""
    curve: bool = False
    """Authenticate with ZeroMQ CURVE (required to bind a non-loopback host)."""
    curve_secret_key: str = ""
    """Server CURVE secret key (z85, 40 characters)."""
    curve_public_key: str = ""
    """Server CURVE public key (z85); clients need it too."""
    curve_client_keys: str = ""
    """Comma-separated z85 public keys of the clients the service accepts."""
    curve_client_secret_key: str = ""
    """Secret key generators and learners present (z85); its public key must be in curve_client_keys."""
    curve_client_public_key: str = ""
    """Public key generators and learners present (z85)."""


@dataclass
class SyncConfig:
    backend: str = "gloo"
    """Backend of the weight-push group (gloo on CPU, nccl on GPU)."""
    bucket_mb: int = 64
    """Size of one flat broadcast bucket."""
    timeout_s: float = 30.0
    """Timeout of every collective and handshake of the push; a peer slower than this is reported dead,
    dropped from the group and the push repeated without it."""


@dataclass
class RunConfig:
    dir: str = "runs/demo"
    """Run directory: metrics, TensorBoard events, final policy, plots, summary.json."""
    log_every_s: float = 2.0
    """Seconds between progress lines."""
    num_cpus: int = 0
    """CPUs Ray may use locally (0: all of this machine's)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    run: RunConfig = field(default_factory=RunConfig)
    generators: int = 2
    """Generator actors (one vLLM engine each)."""
    learners: int = 1
    """Learner ranks (one DeepSpeed engine each)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


CHOICES: dict[str, tuple[str, ...]] = {
    "train.objective.kind": (
        "ppo", "decoupled_ppo", "decoupled_ppo_interp", "tis_token", "tis_seq", "mask_token", "mask_seq",
        "vtrace",
    ),
    "train.objective.truncate_mode": ("clamp", "mask"),
    "train.objective.aggregation": ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
    "train.objective.kl_estimator": ("k1", "k2", "k3"),
    "train.advantage": ("grpo", "dr_grpo", "rloo", "reinforce_pp"),
    "generator.update_mode": ("in_flight", "drain"),
    "buffer.store": ("memory", "redis"),
    "buffer.policy": ("fifo", "freshest", "evict_stale"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "task.name": ("addition",),
    "sync.backend": ("gloo", "nccl"),
    "learner.backend": ("gloo", "nccl"),
}

POSITIVE = (
    "generators", "learners", "train.steps", "train.batch_size", "train.group_size", "train.push_every",
    "train.minibatches",
    "generator.max_new_tokens", "generator.groups_in_flight", "generator.threads", "learner.threads",
    "sync.bucket_mb", "task.digits", "task.heldout_size", "model.max_model_len",
)
NON_NEGATIVE = ("train.max_staleness", "learner.zero_stage", "task.sft_steps", "generator.eval_every")


def _set_nested(obj: Any, dotted: str, raw: Any, origin: str) -> None:
    """Set ``a.b.c`` on nested dataclasses, converting ``raw`` to the field's type."""
    parts = dotted.split(".")
    target = obj
    for i, part in enumerate(parts):
        known = {f.name for f in dataclasses.fields(target)}
        if part not in known:
            where = ".".join(parts[: i + 1])
            raise ConfigError(
                f"unknown config key '{where}' (from {origin}); known keys here: {', '.join(sorted(known))}"
            )
        if i == len(parts) - 1:
            hint = get_type_hints(type(target))[part]
            setattr(target, part, _convert(raw, hint, dotted, origin))
        else:
            target = getattr(target, part)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"config key '{dotted}' (from {origin}): '{part}' has no sub-keys")


def _convert(raw: Any, hint: Any, key: str, origin: str) -> Any:
    if dataclasses.is_dataclass(hint):
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
            return "" if raw is None else str(raw)
    except (TypeError, ValueError):
        wanted = {int: "an integer", float: "a number", bool: "true or false"}.get(hint, hint.__name__)
        raise ConfigError(f"config key '{key}' (from {origin}) wants {wanted}, got {raw!r}") from None
    return raw


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def validate(cfg: Config) -> Config:
    """Check ranges and choices; raises ConfigError naming the key and what it accepts."""
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be at least 1, got {_get(cfg, key)}")
    for key in NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be 0 or more, got {_get(cfg, key)}")
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {_get(cfg, key)!r}")
    if cfg.train.batch_size % cfg.learners:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}) must be a multiple of --learners ({cfg.learners}) "
            "so every rank gets the same number of prompt groups"
        )
    if cfg.train.group_size < 2 and cfg.train.advantage in ("grpo", "dr_grpo", "rloo"):
        raise ConfigError(f"train.advantage={cfg.train.advantage} compares samples of a group: "
                          "set train.group_size to 2 or more")
    b = cfg.buffer
    if b.capacity < 0 or (b.capacity and b.capacity < cfg.train.batch_size * 2):
        raise ConfigError(f"buffer.capacity ({b.capacity}) must be 0 (unbounded) or at least twice "
                          f"train.batch_size ({cfg.train.batch_size}), or learners could never fill a batch")
    if b.visibility_timeout_s <= 0 or b.redis_retry_s <= 0 or b.request_timeout_s <= 0:
        raise ConfigError("buffer.visibility_timeout_s, buffer.redis_retry_s and buffer.request_timeout_s "
                          "must be above 0")
    if b.curve and not all((b.curve_secret_key, b.curve_public_key, b.curve_client_keys,
                            b.curve_client_secret_key, b.curve_client_public_key)):
        raise ConfigError("buffer.curve=true needs curve_secret_key, curve_public_key, curve_client_keys, "
                          "curve_client_secret_key and curve_client_public_key (make them with "
                          "python -m async_rlhf.buffer keygen)")
    if cfg.learner.zero_stage > 3:
        raise ConfigError(f"learner.zero_stage must be 0, 1, 2 or 3, got {cfg.learner.zero_stage}")
    obj = cfg.train.objective
    if not (0 < obj.eps_low < 1 and obj.eps_high > 0):
        raise ConfigError("train.objective.eps_low must be in (0, 1) and eps_high above 0")
    if obj.is_cap <= 1.0 or obj.is_floor < 0 or obj.is_floor >= 1.0:
        raise ConfigError("train.objective.is_cap must exceed 1 and is_floor lie in [0, 1)")
    if not 0.0 <= cfg.task.sft_forget_carry <= 1.0:
        raise ConfigError(f"task.sft_forget_carry must lie in [0, 1], got {cfg.task.sft_forget_carry}")
    if cfg.generator.temperature <= 0:
        raise ConfigError("generator.temperature must be above 0 for training rollouts")
    return cfg


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
        for key, value in _flatten(data).items():
            _set_nested(cfg, key, value, str(p))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. train.steps=100")
        key, _, raw = item.partition("=")
        value = yaml.safe_load(raw) if raw else ""
        _set_nested(cfg, key.strip(), value, "command line")
    return validate(cfg)


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
