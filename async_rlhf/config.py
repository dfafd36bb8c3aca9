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
    """The environment: addition (the tiny verifiable task) | guess_number (multi-turn, a reward per turn) |
    reward_model (addition prompts scored by rewards.model_path) | custom (prompts.* scored by rewards.*) |
    longtail (answers of 1-40 tokens, heavy-tailed: async_rlhf/env/longtail.py)."""
    max_turns: int = 3
    """Most turns of a multi-turn episode (guess_number)."""
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
class RewardsConfig:
    sources: str = "task"
    """Reward sources summed with weights, comma-separated name[:weight]: task (the environment's own rule) |
    function (rewards.function) | model (rewards.model_path) | http (rewards.http_url); e.g. task:1,model:0.5."""
    function: str = ""
    """A Python reward function, module:name or /path/file.py:name, called as fn(prompt, completion, data)."""
    model_path: str = ""
    """Reward model: a Hugging Face sequence-classification directory (num_labels=1), served by Ray actors."""
    model_actors: int = 1
    """Ray actors serving the reward model (requests spread over them)."""
    model_batch_size: int = 64
    """Most texts one reward-model forward scores (concurrent requests are merged up to this)."""
    http_url: str = ""
    """Remote scorer: POST {prompt, completions, data} as JSON, answer {rewards: [...]} (one per completion)."""
    timeout_s: float = 30.0
    """A reward not computed within this many seconds counts as a timeout; the group is then dropped."""
    max_consecutive_failures: int = 20
    """Reward failures or timeouts in a row on one generator that stop the run with the source's error
    (0: never; each failed group is dropped and its prompt generated again)."""


@dataclass
class PromptsConfig:
    source: str = "task"
    """Where prompts come from: task (the environment's own) | file (prompts.path through the datasets
    library) | python (prompts.path names module:function returning an iterable) | redis (a Redis stream)."""
    path: str = ""
    """JSONL or Parquet file (source=file), or module:function / file.py:function (source=python)."""
    text_field: str = "prompt"
    """Field holding the prompt text; the other fields are passed to reward functions as data."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis server of source=redis."""
    stream: str = "async_rlhf:prompts"
    """Redis stream external producers XADD prompts to (field prompts.text_field, other fields are data)."""


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
class PPOConfig:
    """PPO with a critic (train.algorithm=ppo): reward models, KL shaping, GAE, the value model."""

    reward_models: str = ""
    """Reward models scoring each completion: comma-separated DIR or DIR:WEIGHT (Hugging Face sequence
    classification directories, num_labels=1, e.g. from python -m async_rlhf.offline.reward_model)."""
    generator_reward_weight: float = 0.0
    """Weight of the reward the generator attached to each sample (its rewards.sources: the task's rule, or a
    reward model served by Ray actors) added to the score of train.ppo.reward_models (scored in the learner)."""
    critic_path: str = ""
    """Causal-LM directory the critic's body starts from (--critic); empty: the policy."""
    critic_lr: float = 1e-3
    """Learning rate of the critic (AdamW)."""
    value_clip: float = 0.2
    """Value clipping range around the values the targets were computed with (0 disables)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.05
    """Per-token KL penalty to the frozen reference, in the reward (train.objective.kl_coef puts it in the loss)."""
    reward_norm: bool = True
    """Normalise scores by their running mean and std."""
    reward_clip: float = 5.0
    """Clip the (normalised) score to [-reward_clip, reward_clip] (0 disables)."""
    whiten_advantages: bool = True
    """Whiten the GAE advantages over the batch's completion tokens."""
    advantage_clip: float = 5.0
    """Clip the advantages to [-advantage_clip, advantage_clip] (0 disables)."""


@dataclass
class DPOConfig:
    """Online DPO (train.algorithm=online_dpo): pairs = best and worst completion of each prompt group."""

    beta: float = 0.1
    """DPO temperature: strength of the implicit KL to the reference (the initial policy)."""
    label_smoothing: float = 0.0
    """Conservative DPO: the assumed share of flipped preferences, in [0, 0.5)."""


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
    algorithm: str = "grpo"
    """grpo (critic-free, advantages from train.advantage) | ppo (critic, reward models, GAE: train.ppo) |
    online_dpo (pairs from each prompt group: train.dpo)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    drop_zero_advantage: str = "auto"
    """Dynamic sampling (DAPO): the buffer drops prompt groups whose rewards are all equal (reason
    zero_advantage: a group baseline makes every advantage zero, so they carry no gradient) and keeps batches
    full with informative ones. on | off | auto (on for grpo with grpo/dr_grpo/rloo advantages and no KL term)."""


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
    cpus: str = "auto"
    """Cores of the generator fleet, e.g. 0-5 (split among generators), all, or auto (see async_rlhf/cpus.py)."""
    eval_every: int = 25
    """Generator 0 measures held-out greedy accuracy every this many versions (0 disables)."""
    nice: int = 0
    """Lower the generators' CPU priority by this much (0-19). With generator.cpus=all on a small host the
    generators use the learner's cores while it waits for data and yield them while it computes."""
    min_swap_interval_s: float = 0.0
    """Swap in a newly received version at most this often (versions arriving meanwhile are coalesced: only
    the newest is loaded), unless the engine lags the newest by max_staleness versions or more. 0: at the next
    engine step after it arrived."""


@dataclass
class LearnerConfig:
    zero_stage: int = 0
    """DeepSpeed ZeRO stage (0-3)."""
    threads: int = 1
    """Torch threads per learner rank."""
    cpus: str = "auto"
    """Cores of the learner fleet, e.g. 6,7 (split among ranks), all, or auto (see async_rlhf/cpus.py)."""
    backend: str = "gloo"
    """torch.distributed backend of the learner group (gloo on CPU, nccl on GPU)."""


@dataclass
class BufferConfig:
    cpus: str = "auto"
    """Cores of the buffer service actor: a core list, all, or auto (the generator fleet's cores)."""
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
    reward_deadline_s: float = 60.0
    """A group put with its rewards pending and not rewarded within this many seconds is dropped (reward_timeout)."""
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
    """Largest flat bucket of the push's layout (about 8 buckets, each at least 4 MiB, up to this size): the
    order in which receivers load tensors. What goes on the wire is cut by the sender (see sync/sender.py)."""
    timeout_s: float = 30.0
    """Timeout of every collective and handshake of the push; a peer slower than this is reported dead,
    dropped from the group and the push repeated without it."""
    receive_buffers: int = 2
    """Receive slots per generator: 2 lets version v + 1 arrive while v waits for the engine's step boundary
    (the learner never waits for a swap) at the cost of a second copy of the weights per generator; 1 makes
    the next push wait until the last one is loaded."""


@dataclass
class RunConfig:
    dir: str = "runs/demo"
    """Run directory: metrics, TensorBoard events, final policy, plots, summary.json."""
    log_every_s: float = 2.0
    """Seconds between progress lines."""
    num_cpus: int = 0
    """CPUs Ray may use locally (0: all of this machine's)."""
    cpus: str = ""
    """Cores the whole run may use on this host, e.g. 0-7 (empty: this process's affinity); roles are placed
    within them (generator.cpus, learner.cpus, buffer.cpus)."""
    checkpoint_every: int = 0
    """Learner steps between checkpoints in run.dir/checkpoints (0: only the final one)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    control: bool = True
    """Serve the scale endpoint (ZeroMQ REP on loopback; its address is written to run.dir/control.json)."""
    stall_timeout_s: float = 300.0
    """No learner step for this many seconds stops the run with what every role was doing and the likely
    cause (0: never)."""
    generator_max_restarts: int = 3
    """Times Ray restarts a generator whose process died (its in-flight prompts are re-issued)."""


@dataclass
class ResourcesConfig:
    generator_cpus: float = 1.0
    """CPUs reserved per generator (vLLM engine)."""
    generator_gpus: int = 0
    """GPUs per generator; 0 runs the CPU engine. With tensor_parallel > 1 it must equal tensor_parallel."""
    tensor_parallel: int = 1
    """vLLM tensor-parallel size of one generator (needs that many GPUs per generator)."""
    learner_cpus: float = 1.0
    """CPUs reserved per learner rank."""
    learner_gpus: int = 0
    """GPUs per learner rank (0: CPU DeepSpeed)."""
    buffer_cpus: float = 0.0
    """CPUs reserved for the buffer service actor."""
    placement: str = "pack"
    """Placement-group strategy per role: pack (fill a node first) or spread (one bundle per node if possible)."""


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
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
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
    "train.drop_zero_advantage": ("auto", "on", "off"),
    "train.algorithm": ("grpo", "ppo", "online_dpo"),
    "generator.update_mode": ("in_flight", "drain"),
    "buffer.store": ("memory", "redis"),
    "buffer.policy": ("fifo", "freshest", "evict_stale"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "task.name": ("addition", "guess_number", "reward_model", "custom", "longtail"),
    "prompts.source": ("task", "file", "python", "redis"),
    "sync.backend": ("gloo", "nccl"),
    "learner.backend": ("gloo", "nccl"),
    "resources.placement": ("pack", "spread"),
}

POSITIVE = (
    "generators", "learners", "train.steps", "train.batch_size", "train.group_size", "train.push_every",
    "train.minibatches",
    "generator.max_new_tokens", "generator.groups_in_flight", "generator.threads", "learner.threads",
    "sync.bucket_mb", "task.digits", "task.heldout_size", "model.max_model_len",
    "run.keep_checkpoints", "resources.tensor_parallel", "task.max_turns", "rewards.model_actors",
    "rewards.model_batch_size", "buffer.max_message_mb", "generator.kv_cache_gib",
)
ABOVE_ZERO = ("train.lr", "train.grad_clip", "sync.timeout_s", "run.log_every_s", "rewards.timeout_s",
              "buffer.request_timeout_s", "buffer.redis_retry_s", "buffer.visibility_timeout_s",
              "buffer.reward_deadline_s", "generator.temperature", "train.ppo.critic_lr", "train.dpo.beta")
"""Seconds, rates and scales for which 0 (or less) means nothing sensible."""
PORTS = ("buffer.port",)
"""TCP ports: 0 (pick a free one) to 65535."""
NON_NEGATIVE = ("rewards.max_consecutive_failures",
                "train.max_staleness", "learner.zero_stage", "task.sft_steps", "generator.eval_every",
                "run.checkpoint_every", "run.generator_max_restarts", "resources.generator_cpus",
                "resources.generator_gpus", "resources.learner_cpus", "resources.learner_gpus",
                "resources.buffer_cpus", "run.stall_timeout_s", "train.weight_decay", "train.objective.kl_coef",
                "train.ppo.kl_coef", "train.ppo.value_clip", "train.ppo.reward_clip", "train.ppo.advantage_clip",
                "run.num_cpus", "generator.min_swap_interval_s")


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
            if isinstance(raw, bool):  # YAML reads on/off (and yes/no) as booleans
                return "on" if raw else "off"
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


def drops_zero_advantage(train: TrainConfig) -> bool:
    """Whether the buffer drops groups whose rewards are all equal (``train.drop_zero_advantage``): with a
    group baseline (grpo, dr_grpo, rloo) and no KL term such a group contributes nothing to the gradient."""
    if train.drop_zero_advantage != "auto":
        return train.drop_zero_advantage == "on"
    return (train.algorithm == "grpo" and train.advantage in ("grpo", "dr_grpo", "rloo")
            and train.objective.kl_coef == 0)


def validate(cfg: Config) -> Config:
    """Check ranges and choices; raises ConfigError naming the key and what it accepts."""
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be at least 1, got {_get(cfg, key)}")
    for key in NON_NEGATIVE:
        if not _get(cfg, key) >= 0:  # (not < 0: NaN is refused too)
            raise ConfigError(f"{key} must be 0 or more, got {_get(cfg, key)}")
    for key in ABOVE_ZERO:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{key} must be above 0, got {_get(cfg, key)}")
    for key in PORTS:
        if not 0 <= _get(cfg, key) <= 65535:
            raise ConfigError(f"{key} must be a TCP port, 0-65535 (0 picks a free one), got {_get(cfg, key)}")
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {_get(cfg, key)!r}")
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
    if b.visibility_timeout_s <= 0 or b.redis_retry_s <= 0 or b.request_timeout_s <= 0:
        raise ConfigError("buffer.visibility_timeout_s, buffer.redis_retry_s and buffer.request_timeout_s "
                          "must be above 0")
    if not b.reward_deadline_s > 0:
        raise ConfigError(f"buffer.reward_deadline_s must be above 0 (seconds a group may wait for its late "
                          f"reward), got {b.reward_deadline_s}")
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
    if cfg.sync.receive_buffers not in (1, 2):
        raise ConfigError(f"sync.receive_buffers must be 1 or 2, got {cfg.sync.receive_buffers}")
    if not 0 <= cfg.generator.nice <= 19:
        raise ConfigError(f"generator.nice must lie in 0-19 (added niceness), got {cfg.generator.nice}")
    if cfg.generator.temperature <= 0:
        raise ConfigError("generator.temperature must be above 0 for training rollouts")
    _check_cpus(cfg)
    _check_algorithm(cfg)
    _check_env(cfg)
    res = cfg.resources
    if res.tensor_parallel > 1 and res.generator_gpus != res.tensor_parallel:
        raise ConfigError(f"resources.tensor_parallel={res.tensor_parallel} shards each vLLM engine over that many "
                          f"GPUs: set resources.generator_gpus={res.tensor_parallel} (got {res.generator_gpus})")
    if res.generator_cpus + res.generator_gpus == 0 or res.learner_cpus + res.learner_gpus == 0:
        raise ConfigError("every generator and learner needs at least one CPU or GPU: set "
                          "resources.generator_cpus / resources.learner_cpus above 0")
    return cfg


def _check_cpus(cfg: Config) -> None:
    from async_rlhf.cpus import CpuSpecError, check_spec

    specs = {"generator.cpus": cfg.generator.cpus, "learner.cpus": cfg.learner.cpus, "buffer.cpus": cfg.buffer.cpus,
             "run.cpus": cfg.run.cpus or "auto"}
    for key, spec in specs.items():
        try:
            check_spec(spec, key)
        except CpuSpecError as exc:
            raise ConfigError(str(exc)) from None


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


def _check_algorithm(cfg: Config) -> None:
    t = cfg.train
    if t.algorithm == "ppo":
        p = t.ppo
        models = parse_reward_models(p.reward_models)
        if not models and p.generator_reward_weight == 0:
            raise ConfigError("train.algorithm=ppo needs a reward: set train.ppo.reward_models=DIR[:WEIGHT] "
                              "and/or train.ppo.generator_reward_weight above 0")
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


def _check_env(cfg: Config) -> None:
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
        raise ConfigError(f"rewards.http_url={r.http_url!r} must start with http:// or https://")
    if r.timeout_s <= 0 or r.model_actors < 1 or r.model_batch_size < 1:
        raise ConfigError("rewards.timeout_s must be above 0, rewards.model_actors and model_batch_size at least 1")
    if cfg.task.max_turns < 1:
        raise ConfigError(f"task.max_turns must be at least 1, got {cfg.task.max_turns}")
    if cfg.task.name == "custom" and p.source == "task":
        raise ConfigError("task.name=custom has no prompts of its own: set prompts.source to file, python or redis")
    if p.source in ("file", "python") and not p.path:
        raise ConfigError(f"prompts.source={p.source} needs prompts.path")
    if p.source == "file" and not Path(p.path).exists():
        raise ConfigError(f"prompts.path={p.path}: no such file; give a JSONL or Parquet file")
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
