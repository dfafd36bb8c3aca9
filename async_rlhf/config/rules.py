"""The checks that span keys, and :func:`validate`, which runs them after every field's own rule
(``fields.check_fields``)."""

from __future__ import annotations

from typing import Any

from async_rlhf.config.agent import apply_agent_defaults
from async_rlhf.config.checks import check_algorithm, check_env, check_lora, parse_report_to, parse_reward_sources
from async_rlhf.config.errors import ConfigError
from async_rlhf.config.fields import check_fields
from async_rlhf.config.model_limits import resolve_model_limits
from async_rlhf.config.roles import Config
from async_rlhf.config.secrets import SECRET_ENV, is_masked, mask_url, masked_error
from async_rlhf.config.sections import TrainConfig


def _get(cfg: Config, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def drops_zero_advantage(train: TrainConfig) -> bool:
    """Whether the buffer drops groups whose rewards are all equal (``train.drop_zero_advantage``): with a
    group baseline (grpo, dr_grpo, rloo) and no KL term such a group contributes nothing to the gradient."""
    if train.drop_zero_advantage != "auto":
        return train.drop_zero_advantage == "on"
    return (train.algorithm == "grpo" and train.advantage in ("grpo", "dr_grpo", "rloo")
            and train.objective.kl_coef == 0)


def validate(cfg: Config) -> Config:
    """Check ranges and choices; raises ConfigError naming the key and what it accepts."""
    cfg.prompts.chat_template = {"true": "on", "false": "off"}.get(cfg.prompts.chat_template.lower(),
                                                                  cfg.prompts.chat_template.lower())
    check_fields(cfg)  # each key against the rule on its field (fields.py, sections.py, roles.py)
    resolve_model_limits(cfg)  # a --model of the user's own: its window and completion length, not the tiny's
    apply_agent_defaults(cfg)  # agent.task=calculator: its agent, tool parser and completion length
    if cfg.train.batch_size % cfg.learners:
        raise ConfigError(
            f"train.batch_size ({cfg.train.batch_size}) must be a multiple of --learners ({cfg.learners}) "
            "so every rank gets the same number of prompt groups"
        )
    if cfg.train.group_size < 2 and cfg.train.algorithm == "grpo" and cfg.train.advantage in ("grpo", "dr_grpo",
                                                                                               "rloo"):
        raise ConfigError(f"train.advantage={cfg.train.advantage} compares samples of a group: "
                          "set train.group_size to 2 or more")
    b = cfg.buffer
    if b.capacity < 0 or (b.capacity and b.capacity < cfg.train.batch_size * 2):
        raise ConfigError(f"buffer.capacity ({b.capacity}) must be 0 (unbounded) or at least twice "
                          f"train.batch_size ({cfg.train.batch_size}), or learners could never fill a batch")
    if b.curve and not all((b.curve_secret_key, b.curve_public_key, b.curve_client_keys,
                            b.curve_client_secret_key, b.curve_client_public_key)):
        raise ConfigError("buffer.curve=true needs curve_secret_key, curve_public_key, curve_client_keys, "
                          "curve_client_secret_key and curve_client_public_key (make them with "
                          "python -m async_rlhf.buffer keygen); a run's config.json never holds the two secret "
                          f"keys: on --resume give them again, or set {SECRET_ENV['buffer.curve_secret_key']} and "
                          f"{SECRET_ENV['buffer.curve_client_secret_key']}")
    _check_masked(cfg)
    if b.store == "redis":
        _check_redis_url(b.redis_url)
    if cfg.learner.zero_stage > 3:
        raise ConfigError(f"learner.zero_stage must be 0, 1, 2 or 3, got {cfg.learner.zero_stage}")
    obj = cfg.train.objective
    if not (0 < obj.eps_low < 1 and obj.eps_high > 0):
        raise ConfigError("train.objective.eps_low must be in (0, 1) and eps_high above 0")
    if obj.is_cap <= 1.0 or obj.is_floor < 0 or obj.is_floor >= 1.0:
        raise ConfigError("train.objective.is_cap must exceed 1 and is_floor lie in [0, 1)")
    if not 0.0 <= cfg.task.sft_forget_carry <= 1.0:
        raise ConfigError(f"task.sft_forget_carry must lie in [0, 1], got {cfg.task.sft_forget_carry}")
    if cfg.sync.receive_buffers not in (1, 2):
        raise ConfigError(f"sync.receive_buffers must be 1 or 2, got {cfg.sync.receive_buffers}")
    if not 0 <= cfg.generator.nice <= 19:
        raise ConfigError(f"generator.nice must lie in 0-19 (added niceness), got {cfg.generator.nice}")
    _check_cpus(cfg)
    parse_report_to(cfg.run.report_to)
    check_algorithm(cfg)
    check_lora(cfg)
    check_env(cfg)
    res = cfg.resources
    for key in ("generator_custom", "learner_custom", "buffer_custom"):
        parse_custom_resources(getattr(res, key), f"resources.{key}")
    if res.tensor_parallel > 1 and res.generator_gpus != res.tensor_parallel:
        raise ConfigError(f"resources.tensor_parallel={res.tensor_parallel} shards each vLLM engine over that many "
                          f"GPUs: set resources.generator_gpus={res.tensor_parallel} (got {res.generator_gpus})")
    _check_gpus(cfg)
    if res.generator_cpus + res.generator_gpus == 0 or res.learner_cpus + res.learner_gpus == 0:
        raise ConfigError("every generator and learner needs at least one CPU or GPU: set "
                          "resources.generator_cpus / resources.learner_cpus above 0")
    return cfg


def parse_custom_resources(spec: str, key: str) -> dict[str, float]:
    """``"name:amount,name:amount"`` -> {name: amount}; ConfigError naming the bad entry."""
    out: dict[str, float] = {}
    for raw in (s.strip() for s in spec.split(",")):
        if not raw:
            continue
        name, _, amount = raw.partition(":")
        try:
            value = float(amount or "1")
        except ValueError:
            value = -1.0
        if not name or name in ("CPU", "GPU", "memory") or not value > 0:
            raise ConfigError(f"{key}: entry {raw!r} must be name:amount with a custom resource name (not CPU, GPU "
                              "or memory) and an amount above 0, e.g. gen_node:1")
        out[name] = value
    return out


def _check_redis_url(url: str) -> None:
    """A Redis beyond loopback must ask for a password (the store holds every rollout and the ledger)."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"buffer.redis_url={mask_url(url)!r}: expected redis://[:password@]host:port/db, "
                          "rediss://... or unix://path")
    if parsed.scheme != "unix" and parsed.hostname not in ("127.0.0.1", "localhost", "::1") and not parsed.password:
        raise ConfigError(f"buffer.redis_url points at {parsed.hostname}, beyond this machine, without a password: "
                          "use redis://:PASSWORD@host:port/db (and requirepass on the server)")


def _check_masked(cfg: Config) -> None:
    """A URL the run uses whose password is still config.json's ``***`` (a resume given neither the URL nor its
    password): refused, saying where to give it."""
    in_use = {"buffer.redis_url": cfg.buffer.store == "redis", "prompts.redis_url": cfg.prompts.source == "redis",
              "rewards.http_url": "http" in {n for n, _ in parse_reward_sources(cfg.rewards.sources)}}
    for key, used in in_use.items():
        if used and is_masked(_get(cfg, key)):
            raise ConfigError(masked_error(key))


def push_min_gbps(cfg: Config) -> float:
    """``sync.min_gbps`` with its per-device default: 1 GB/s per receiver with GPU learners, none on CPU."""
    return cfg.sync.min_gbps or (1.0 if cfg.resources.learner_gpus > 0 else 0.0)


def _check_gpus(cfg: Config) -> None:
    res, gen = cfg.resources, cfg.generator
    for key, n in (("resources.generator_gpus", res.generator_gpus), ("resources.learner_gpus", res.learner_gpus)):
        if n > 1 and not float(n).is_integer():
            raise ConfigError(f"{key}={n:g}: Ray shares a GPU only in fractions below 1; use e.g. 0.5, 1 or 2")
    if res.learner_gpus > 1:
        raise ConfigError(f"resources.learner_gpus={res.learner_gpus:g}: a learner rank computes on one device; "
                          "add ranks with --learners instead")
    if not 0 <= gen.gpu_memory_utilization <= 1:
        raise ConfigError("generator.gpu_memory_utilization must lie in 0-1 (0: auto), "
                          f"got {gen.gpu_memory_utilization}")
    for key in ("learner.backend", "sync.backend"):
        if _get(cfg, key) == "nccl" and res.learner_gpus == 0:
            raise ConfigError(f"{key}=nccl moves CUDA tensors: set resources.learner_gpus above 0 or use gloo")
    if cfg.sync.backend == "nccl" and (res.generator_gpus < 1 or res.learner_gpus < 1):
        raise ConfigError("sync.backend=nccl needs whole GPUs (resources.generator_gpus and learner_gpus of 1 or "
                          "more): NCCL refuses two members of its group on one GPU and generator_gpus=0 is the CPU "
                          "engine; use sync.backend=gloo")


def _check_cpus(cfg: Config) -> None:
    from async_rlhf.cpu_spec import CpuSpecError, check_spec

    specs = {"generator.cpus": cfg.generator.cpus, "learner.cpus": cfg.learner.cpus, "buffer.cpus": cfg.buffer.cpus,
             "run.cpus": cfg.run.cpus or "auto"}
    for key, spec in specs.items():
        try:
            check_spec(spec, key)
        except CpuSpecError as exc:
            raise ConfigError(str(exc)) from None
