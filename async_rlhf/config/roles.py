"""The role sections (generator, learner, buffer, sync, run, resources) and the whole :class:`Config`."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field

from async_rlhf.config.agent import AgentConfig
from async_rlhf.config.fields import AboveZero, AtLeastOne, Count, NonNegative, Port, Section
from async_rlhf.config.sections import ModelConfig, PromptsConfig, RewardsConfig, TaskConfig, TrainConfig


class GeneratorConfig(Section):
    max_new_tokens: AtLeastOne = 6
    """Longest completion, in tokens."""
    temperature: AboveZero = 1.0
    """Sampling temperature of training rollouts."""
    groups_in_flight: AtLeastOne = 8
    """Prompt groups each generator keeps in flight (subject to the admission rule)."""
    update_mode: Literal["in_flight", "drain"] = "in_flight"
    """How a new version is loaded: in_flight (pause between engine steps, swap, resume) or drain."""
    kv_cache_gib: NonNegative = 0.0
    """KV cache of each CPU engine, GiB (fractions too); 0: auto, what the engine can use: groups_in_flight x
    group_size sequences (+ the held-out prompts) of max_model_len in whole KV blocks (33 MiB for the tiny model;
    async_rlhf/generator/engine_args.py kv_cache_plan). The GPU engine sizes its cache by
    generator.gpu_memory_utilization instead."""
    threads: AtLeastOne = 1
    """Torch threads per generator process."""
    cpus: str = "auto"
    """Cores of the generator fleet, e.g. 0-5 (split among generators), all, or auto
    (see async_rlhf/driver/cpu_plan.py)."""
    eval_every: Count = 25
    """Generator 0 measures held-out greedy accuracy every this many versions (0 disables)."""
    nice: int = 0
    """Lower the generators' CPU priority by this much (0-19). With generator.cpus=all on a small host the
    generators use the learner's cores while it waits for data and yield them while it computes."""
    enforce_eager: Literal["auto", "on", "off"] = "auto"
    """vLLM without CUDA graphs or compilation: on | off | auto (on for the CPU engine, off on GPU)."""
    kv_block_size: Count = 0
    """Tokens per KV-cache block (vLLM's block_size); 0: vLLM's default (128 on CPU, 16 on GPU). The prefix cache
    shares whole blocks only, so a shared system prompt is reused from its first full block on."""
    gpu_memory_utilization: float = 0.0
    """Share of each GPU's memory vLLM may take (0-1); 0: auto (0.9 on a whole GPU, 0.9 x resources.generator_gpus
    on a shared one; the CPU engine ignores it)."""
    max_model_len: Count = 0
    """vLLM's context length in tokens; 0: model.max_model_len."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype of the engine: auto (model.dtype) | float32 | bfloat16 | float16."""
    min_swap_interval_s: NonNegative = 0.0
    """Swap in a newly received version at most this often (versions arriving meanwhile are coalesced: only
    the newest is loaded), unless the engine lags the newest by max_staleness versions or more. 0: at the next
    engine step after it arrived."""


class LearnerConfig(Section):
    zero_stage: Count = 0
    """DeepSpeed ZeRO stage (0-3)."""
    threads: AtLeastOne = 1
    """Torch threads per learner rank."""
    cpus: str = "auto"
    """Cores of the learner fleet, e.g. 6,7 (split among ranks), all, or auto
    (see async_rlhf/driver/cpu_plan.py)."""
    backend: Literal["gloo", "nccl"] = "gloo"
    """torch.distributed backend of the learner group (gloo on CPU, nccl on GPU)."""
    max_tokens_per_micro_batch: Count = 0
    """Token budget of one learner forward (padded: rows x longest row; packed: the sum of lengths): a step's
    rows are split into micro-batches under it and their gradients accumulated (0: the whole step at once)."""
    pack: bool = False
    """Lay a micro-batch's sequences end to end in one row (position ids restart per sequence, attention stays
    within it) instead of right-padding them to the longest: no compute on padding."""
    logprob_chunk_tokens: Count = 0
    """Compute log-probs and entropies over this many token positions at a time, never the whole
    [tokens, vocabulary] log-softmax at once (0: all at once). Same values."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of keeping them (policy and critic; the reference is
    never differentiated, so it keeps none anyway)."""
    zero3_gather_mb: AtLeastOne = 512
    """ZeRO-3: most parameter MiB gathered at once for a weight push or a saved policy (a window of layers
    at a time, never the whole model; a larger single tensor is gathered alone)."""


class BufferConfig(Section):
    cpus: str = "auto"
    """Cores of the buffer service actor: a core list, all, or auto (the generator fleet's cores)."""
    store: Literal["memory", "redis"] = "memory"
    """Where rollouts are kept: memory (embedded default) or redis."""
    host: str = "127.0.0.1"
    """Address the buffer service binds (loopback by default)."""
    port: Port = 0
    """Port of the buffer service; 0 picks a free one."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL (password and TLS in the URL) when store is redis."""
    max_message_mb: AtLeastOne = 64
    """Largest message the service accepts."""
    request_timeout_s: AboveZero = 30.0
    """How long a client waits for the service before it reports the service as unreachable."""
    redis_prefix: str = "async_rlhf:buffer"
    """Prefix of every Redis key of this buffer (one buffer service per prefix)."""
    redis_retry_s: AboveZero = 30.0
    """How long the service waits for an unreachable Redis (restarting, loading its AOF) before failing a request."""
    capacity: int = 1024
    """Most groups held or delivered-unacked at once (0: unbounded); admission and put push back beyond it."""
    policy: Literal["fifo", "freshest", "evict_stale"] = "fifo"
    """Sampling policy: fifo | freshest (highest min version first) | evict_stale (full: evict the oldest version)."""
    visibility_timeout_s: AboveZero = 600.0
    """A delivered group not acknowledged within this many seconds is delivered again (its learner is presumed dead)."""
    reward_deadline_s: AboveZero = 60.0
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


class SyncConfig(Section):
    backend: Literal["gloo", "nccl"] = "gloo"
    """Backend of the weight-push group (gloo on CPU, nccl on GPU)."""
    bucket_mb: AtLeastOne = 64
    """Largest flat bucket of the push's layout (about 8 buckets, each at least 4 MiB, up to this size): the
    order in which receivers load tensors. What goes on the wire is cut by the sender (see sync/sender.py)."""
    timeout_s: AboveZero = 30.0
    """Timeout of every collective and handshake of the push; a peer slower than this is reported dead,
    dropped from the group and the push repeated without it."""
    min_gbps: NonNegative = 0.0
    """Slowest transfer a push may take, in GB/s per receiver: each push's deadline is timeout_s plus its bytes x
    receivers at this rate (multi-GB models, many generators); 0: auto (1 with GPU learners, none on CPU)."""
    receive_buffers: int = 2
    """Receive slots per generator: 2 lets version v + 1 arrive while v waits for the engine's step boundary
    (the learner never waits for a swap) at the cost of a second copy of the weights per generator; 1 makes
    the next push wait until the last one is loaded."""


class RunConfig(Section):
    dir: str = "runs/demo"
    """Run directory: metrics, TensorBoard events, final policy, plots, summary.json."""
    log_every_s: AboveZero = 2.0
    """Seconds between progress lines."""
    num_cpus: Count = 0
    """CPUs Ray may use locally (0: all of this machine's)."""
    cpus: str = ""
    """Cores the whole run may use on this host, e.g. 0-7 (empty: this process's affinity); roles are placed
    within them (generator.cpus, learner.cpus, buffer.cpus)."""
    pin: Literal["auto", "always"] = "auto"
    """auto: the roles are pinned to the CPU plan's cores unless another run on this host has pinned its roles to
    some of them (then this run's roles use every core: two runs split the same cores put both runs' generators
    on one side); always: pinned regardless. Explicit generator/learner/buffer.cpus always pin."""
    checkpoint_every: Count = 0
    """Learner steps between checkpoints in run.dir/checkpoints (0: only the final one)."""
    checkpoint_every_s: NonNegative = 0.0
    """Seconds between checkpoints (0: off), counted from the previous checkpoint of any kind; with
    run.checkpoint_every too, whichever comes first writes one."""
    keep_checkpoints: AtLeastOne = 2
    """Most recent checkpoints kept on disk; older ones are deleted once a newer one is complete."""
    control: bool = True
    """Serve the scale endpoint (ZeroMQ REP on loopback; its address is written to run.dir/control.json)."""
    stall_timeout_s: NonNegative = 300.0
    """No learner step for this many seconds stops the run with what every role was doing and the likely
    cause (0: never)."""
    max_logp_mismatch: NonNegative = 0.1
    """Stop the run when a step's mean |log p_learner - log p_generator| over tokens of the learner's own version
    exceeds this many nats (rollout/logp_mismatch_mean; ~1e-6 in fp32; 0: never)."""
    generator_max_restarts: Count = 3
    """Times Ray restarts a generator whose process died (its in-flight prompts are re-issued)."""
    network: Literal["auto", "loopback", "node"] = "auto"
    """Addresses the roles listen on: loopback (one host), node (each node's own IP, the buffer under per-run
    CURVE keys) or auto (node when the Ray cluster has more than one node)."""
    rendezvous_timeout_s: AboveZero = 120.0
    """Seconds the learner ranks have to get through DeepSpeed's rendezvous, counted from the moment the last of
    them reached it (and every node to answer the start-up checks), before the run stops with the node and
    address that failed."""
    startup_phase_s: AboveZero = 120.0
    """Budget of each start-up phase of a rank (process start, imports, op build, model load, engine build, first
    push): past it the rank is reported slow and given another budget while it or another starting rank makes
    progress (uses CPU); when nothing does, the run stops naming the phase (see async_rlhf/startup/phases.py)."""
    startup_silent_s: AboveZero = 90.0
    """A starting rank whose heartbeat stops for this long stops the run (its process died or hangs)."""
    overwrite: bool = False
    """Start afresh in a run.dir that holds a previous run (its files are deleted first); without it a
    non-empty run.dir is refused unless --resume continues it."""
    verbose: bool = False
    """Show on the console what the roles and their libraries print (vLLM, DeepSpeed, Ray, warnings), as well as
    writing it to run.dir/logs/; off, the console shows only the launcher's own lines (ASYNC_RLHF_VERBOSE=1 in the
    launcher's environment does the same as true)."""
    report_to: str = "tensorboard"
    """Where the metrics go besides run.dir/metrics.jsonl (always written), comma-separated: tensorboard
    (run.dir/tensorboard), wandb (offline into run.dir/wandb unless WANDB_MODE is set; project WANDB_PROJECT or
    async_rlhf), mlflow (a file store in run.dir/mlruns unless MLFLOW_TRACKING_URI is set; experiment
    MLFLOW_EXPERIMENT_NAME or async_rlhf), or none. A tracker that cannot start or log warns once and is left
    out; the run goes on (async_rlhf/driver/trackers.py)."""
    fork_workers: bool = True
    """Start the generators' and learner ranks' Ray workers as children of a process per node that has
    already imported PyTorch, transformers, vLLM and DeepSpeed (async_rlhf/startup/forkserver.py): a role
    starts in ~1 s instead of ~8-20 s of imports. Only on CPU runs (off whenever a role asks for GPUs); the
    nodes must have this run's Python at the driver's path (as they need the run's packages anyway)."""
    buffer_max_restarts: Count = 3
    """Times Ray restarts the buffer actor when buffer.store=redis (it recovers its state from Redis on the same
    port); with the memory store a dead buffer stops the run."""
    id: str = ""
    """Set by the driver, not by hand (issue 44, defect 4): a fresh run takes a new id, ``--resume`` the run's own
    (async_rlhf/buffer/run_scope.py). A Redis buffer keeps its keys under ``buffer.redis_prefix:<id>`` and a Redis
    prompt stream its positions per run, so a new run on a Redis used before starts clean."""


class ResourcesConfig(Section):
    generator_cpus: NonNegative = 1.0
    """CPUs reserved per generator (vLLM engine)."""
    generator_gpus: NonNegative = 0.0
    """GPUs per generator; 0 runs the CPU engine, below 1 shares a GPU (0.5: a generator and a learner on one
    GPU). With tensor_parallel > 1 it must equal tensor_parallel."""
    tensor_parallel: AtLeastOne = 1
    """vLLM tensor-parallel size of one generator (needs that many GPUs per generator)."""
    learner_cpus: NonNegative = 1.0
    """CPUs reserved per learner rank."""
    learner_gpus: NonNegative = 0.0
    """GPUs per learner rank (0: CPU DeepSpeed; at most 1, below 1 shares a GPU)."""
    buffer_cpus: NonNegative = 0.0
    """CPUs reserved for the buffer service actor."""
    placement: Literal["pack", "spread"] = "pack"
    """Placement-group strategy per role: pack (fill a node first) or spread (one bundle per node if possible)."""
    generator_custom: str = ""
    """Custom Ray resources each generator asks for, name:amount,... (e.g. gen_node:1 keeps generators on the
    nodes started with --resources '{"gen_node": N}')."""
    learner_custom: str = ""
    """Custom Ray resources each learner rank asks for, name:amount,..."""
    buffer_custom: str = ""
    """Custom Ray resources the buffer asks for, name:amount,..."""


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    generators: AtLeastOne = 2
    """Generator actors (one vLLM engine each)."""
    learners: AtLeastOne = 1
    """Learner ranks (one DeepSpeed engine each)."""

    def to_json(self) -> str:
        """The configuration as ``run.dir/config.json`` holds it: without secrets (``secrets.public_dict``: URL
        passwords masked, CURVE secret keys left out; a resume gets them from the command line or environment)."""
        from async_rlhf.config.secrets import public_dict

        return json.dumps(public_dict(self.to_dict()), indent=2, sort_keys=True)
