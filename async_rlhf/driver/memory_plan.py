"""Host memory a run needs, per role, as a pure function of the config and the model's size.

    generator (CPU engine)  the process + weights in the engine's dtype + its KV cache (generator.kv_cache_gib;
                            0, auto: what the engine can use, generator/engine_args.py kv_cache_plan)
    generator (GPU engine)  the process only (weights and KV cache live on the GPU)
    learner rank            the process + policy state: weights, gradients, AdamW's two fp32 moments (+ fp32
                            master weights under bf16/fp16), the parts ZeRO shards divided by the ranks; + the
                            frozen reference (KL, DPO) and PPO's critic (its own weights and optimizer); + the
                            activations of one training forward (see :func:`activation_bytes`: the tokens of one
                            micro-batch x layers x hidden x bytes x a factor, and the logits)
    fixed                   Ray's processes, the driver, the buffer actor (and the fork servers)
    each further node       its own Ray processes and fork server (a run over several nodes: ``nodes``)

The process figures are fitted to what bench/fleet_memory.py measured here (tiny model, defaults, 5-10 steps;
docs/hardware.md): the peak of the summed proportional set size (PSS: a page shared by k processes counts 1/k in
each, so what forked roles share counts once) and of the machine's used memory (MemTotal - MemAvailable; it leaves
out the ~0.47 GB of mapped library pages that PSS counts, the page cache the kernel may drop). Forked roles
(``run.fork_workers`` on a CPU run, the default) start as children of a fork server that has imported torch, vLLM
and DeepSpeed and share those pages: a generator costs ~0.27 GB of its own beside its KV cache and weights, a
learner rank ~0.15 GB beside its state, over a fixed ~1.6 GB (Ray 0.4-0.8, the fork servers 0.3-0.5, the driver
0.25, the buffer and the start-up board 0.15). Summed PSS and machine used, GB, against the plan:

    1+1 2.04 2.05 plan 2.06 | 2+2 2.62 2.15 plan 2.51 | 4+4 3.57 3.11 plan 3.42 | 8+8 5.34 4.87 plan 5.24
    16+16 8.89 8.59 plan 8.88 | 8+1 4.32 3.79 plan 4.19 | 1+8 3.15 2.87 plan 3.11

A role that imports for itself (GPU runs, ``run.fork_workers=false``) holds its own copy: ~0.9 GB a generator,
~0.6 GB a learner rank (resident, measured before the fork servers), over ~1.0 GB. A fleet whose estimate exceeds
the node's memory is refused before anything starts, naming the largest one that fits.

A run over several Ray nodes pays each further node's fixed cost (:data:`NODE_GB`), measured over network-namespace
nodes on this machine (tests/cluster/nodes.py; 4 + 4, 5 steps, every process of the nodes' namespaces summed, peaks):
1 node 4.06 GB of PSS, 3.44 machine used; 4 nodes 6.52 and 5.89: 0.82 GB more per node by both measures. Idle, a
further node's Ray is 0.30 GB (raylet 0.02, dashboard agent 0.08, runtime-env agent 0.05, log monitor 0.05, and
its ``ray start --block`` 0.13-0.14); with roles, its fork server holds its own copy of the imported libraries
(0.32 GB its own PSS) and its fewer children share them among fewer: 0.52 GB more, on the nodes that hold forked
roles (1 + 1 over 4 nodes: 2 of them; 3.99 GB of PSS, 3.59 used, plan 3.49). Without fork servers a node pays its
Ray only. The head of such a cluster also runs the dashboard (~0.4 GB, not counted: the launcher's own Ray starts
none): the 4 + 4 on one such node measured 4.06 / 3.44 against a plan of 3.49.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rlhf.config import Config, ConfigError

GB = 1e9
GENERATOR_BASE_GB = 0.9
"""A generator process that imports torch and vLLM itself (GPU runs, ``run.fork_workers=false``)."""
LEARNER_BASE_GB = 0.6
"""A learner rank that imports torch and DeepSpeed itself."""
FIXED_GB = 1.0
"""Ray, the driver and the buffer without fork servers."""
GENERATOR_FORKED_GB = 0.27
"""A forked generator's own pages (PSS) beside its weights and KV cache: vLLM's engine and the actor's heap, and
the imported pages it writes to (copied on write)."""
LEARNER_FORKED_GB = 0.15
"""A forked learner rank's own pages (PSS) beside its model state and activations."""
FORKED_FIXED_GB = 1.6
"""Ray, the driver, the buffer and the fork servers with their imported pages, with forked roles."""
NODE_RAY_GB = 0.30
"""A further Ray node's own processes: raylet, dashboard agent, runtime-env agent, log monitor, ``ray start``."""
NODE_FORK_GB = 0.52
"""A further node's fork server with its imported libraries (where forked roles run: with fewer roles than nodes,
on as many nodes as there are roles)."""
NODE_GB = NODE_RAY_GB + NODE_FORK_GB
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_parameters(path: str | Path) -> int:
    """Parameters of a Hugging Face model directory, from its weight files' sizes and stored dtype (no load)."""
    root = Path(path)
    files = list(root.glob("*.safetensors")) or list(root.glob("*.bin"))
    size = sum(f.stat().st_size for f in files)
    stored = "float32"
    cfg = root / "config.json"
    if cfg.is_file():
        conf = json.loads(cfg.read_text())
        stored = str(conf.get("torch_dtype") or conf.get("dtype") or "float32")
    return size // DTYPE_BYTES.get(stored, 4)


@dataclass(frozen=True)
class ModelShape:
    """What a model's activations scale with, from its ``config.json``."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int


def model_shape(path: str | Path) -> ModelShape | None:
    """The shape of a Hugging Face model directory (None without a readable ``config.json`` saying it)."""
    cfg = Path(path) / "config.json"
    try:
        conf = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    conf = conf.get("text_config", conf)  # a multimodal config keeps its language model's shape there
    try:
        hidden = int(conf["hidden_size"])
        return ModelShape(int(conf["num_hidden_layers"]), hidden, int(conf.get("intermediate_size") or 4 * hidden),
                          int(conf["vocab_size"]))
    except (KeyError, TypeError, ValueError):
        return None


def layer_factor(shape: ModelShape) -> float:
    """Values a decoder layer keeps for backward per token, in units of ``hidden`` (Llama/Qwen layers: RMSNorm,
    attention, a SwiGLU MLP).

    Counting the tensors autograd saves per token: the two RMSNorms' inputs and outputs (4 h; the residual
    stream between them is the next norm's input), q, k and v (at most 3 h; fewer with grouped KV heads), q and
    k after the rotary embedding (2 h), and the attention output (h: sdpa keeps its inputs, its output and a
    logsumexp per head, never the [s, s] scores): 10 h. The MLP keeps its gate and up projections, SiLU(gate)
    and that times up (4 x intermediate). So ``10 + 4 * intermediate / hidden``: 20.8 for Llama-2-7B
    (intermediate 2.69 h), 31.7 for Qwen2-0.5B (5.43 h), 26 for a 4 h MLP. For comparison, Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models") count 34 bytes per hidden unit per
    token for a GPT layer in 16-bit with a GeLU MLP of 4 h and dropout, about 17 values (plus 5 a s / h for
    materialised attention scores, which sdpa does not keep); a SwiGLU MLP keeps two more intermediate-sized
    tensors, and the rotary embedding two more. It errs high where tensors share storage, as this plan does
    everywhere (an eager RMSNorm in 16-bit keeps float32 copies, which errs the other way).
    """
    return 10.0 + 4.0 * shape.intermediate / shape.hidden


def forward_tokens(cfg: Config, learners: int) -> int:
    """The most tokens one learner forward holds: ``learner.max_tokens_per_micro_batch`` (a row longer than it
    gets a forward of its own: at least ``model.max_model_len``), or without a budget one minibatch of the rank's
    rows (``train.batch_size / learners`` groups of ``train.group_size``, in ``train.minibatches``), each as long
    as ``model.max_model_len`` at most; never more than that minibatch."""
    rows = cfg.train.batch_size // max(learners, 1) * cfg.train.group_size
    whole = math.ceil(rows / max(cfg.train.minibatches, 1)) * cfg.model.max_model_len
    budget = cfg.learner.max_tokens_per_micro_batch
    return whole if budget <= 0 else min(whole, max(budget, cfg.model.max_model_len))


def activation_bytes(cfg: Config, shape: ModelShape, learners: int) -> float:
    """Bytes of the activations of one training forward and its backward (the learner's peak beside its state).

    Per token: ``layers x hidden x dtype bytes x`` :func:`layer_factor` for the decoder layers (with
    ``learner.gradient_checkpointing``: each layer's input only, plus one layer recomputed in full during
    backward), and the logits: ``vocab x`` (2 x dtype bytes: the logits and their gradient, + 8 without
    ``learner.logprob_chunk_tokens``: the float32 copy and its log-softmax, built whole). The forwards run one
    after another (policy, then the critic, whose body is no larger, and the no-grad reference and reward
    models, which keep nothing), so the peak is one of them: the policy's, with its logits.
    """
    tokens = forward_tokens(cfg, learners)
    nbytes = DTYPE_BYTES.get(cfg.model.dtype, 4)
    per_layer = shape.hidden * nbytes * layer_factor(shape)
    if cfg.learner.gradient_checkpointing:
        layers = shape.layers * shape.hidden * nbytes + per_layer
    else:
        layers = shape.layers * per_layer
    logits = shape.vocab * (2 * nbytes + (0 if cfg.learner.logprob_chunk_tokens > 0 else 8))
    return tokens * (layers + logits)


@dataclass(frozen=True)
class MemoryPlan:
    generator_gb: float
    learner_gb: float
    fixed_gb: float
    generators: int
    learners: int
    activation_gb: float = 0.0
    """Of ``learner_gb``: one training forward's activations (:func:`activation_bytes`)."""
    kv_gb: float = 0.0
    """Of ``generator_gb``: the KV cache of a CPU engine."""
    kv_auto: bool = True
    """The KV cache is sized to what the engine can use (``generator.kv_cache_gib=0``), not set."""
    nodes: int = 1
    """The Ray nodes the run spans: each beyond the first adds ``node_ray_gb``, and ``node_fork_gb`` where roles
    run (as many nodes as there are generators and learner ranks, at most)."""
    node_ray_gb: float = NODE_RAY_GB
    node_fork_gb: float = NODE_FORK_GB
    """0 without fork servers (each role imports for itself, counted per role)."""

    @property
    def base_gb(self) -> float:
        """What the fleet costs beside its roles: ``fixed_gb`` and the further nodes' Ray and fork servers."""
        fork_nodes = min(self.nodes, self.generators + self.learners)
        return self.fixed_gb + (self.nodes - 1) * self.node_ray_gb + (fork_nodes - 1) * self.node_fork_gb

    def total_gb(self, generators: int | None = None, learners: int | None = None) -> float:
        g = self.generators if generators is None else generators
        m = self.learners if learners is None else learners
        return self.base_gb + g * self.generator_gb + m * self.learner_gb

    def largest(self, node_gb: float) -> tuple[int, int, int]:
        """What fits in ``node_gb``: (most generators beside this many learners, most learners beside this many
        generators, the largest N of N generators + N learners); 0 where none does."""
        room = node_gb - self.base_gb
        g = int((room - self.learners * self.learner_gb) // self.generator_gb)
        m = int((room - self.generators * self.generator_gb) // self.learner_gb)
        n = int(room // (self.generator_gb + self.learner_gb))
        return max(g, 0), max(m, 0), max(n, 0)

    def fixed_words(self) -> str:
        """``1.60 GB for Ray, ...`` and, over several nodes, what the further nodes add."""
        words = f"{self.fixed_gb:.2f} GB for Ray, the driver, the buffer and the fork servers"
        if self.nodes > 1:
            words += (f", {self.base_gb - self.fixed_gb:.2f} GB for {self.nodes - 1} further node(s)' Ray "
                      f"({self.node_ray_gb:.2f} each) and fork servers ({self.node_fork_gb:.2f} each)")
        return words

    def table(self) -> str:
        return (f"memory estimate: {self.generator_gb:.2f} GB per generator, {self.learner_gb:.2f} GB per learner "
                f"rank, {self.fixed_words()}: {self.total_gb():.1f} GB in all")

    def to_dict(self) -> dict[str, Any]:
        return {"generator_gb": round(self.generator_gb, 3), "learner_gb": round(self.learner_gb, 3),
                "fixed_gb": self.fixed_gb, "nodes": self.nodes, "nodes_gb": round(self.base_gb - self.fixed_gb, 3),
                "total_gb": round(self.total_gb(), 3)}


def kv_cache_gb(cfg: Config) -> float:
    """One CPU engine's KV cache, GB: ``generator.kv_cache_gib``, or with 0 (auto) its :func:`kv_cache_plan`."""
    from async_rlhf.generator.engine_args import kv_cache_plan

    if cfg.generator.kv_cache_gib == 0:  # auto
        return kv_cache_plan(cfg).nbytes / GB
    return float(cfg.generator.kv_cache_gib) * (1 << 30) / GB


def estimate_memory(cfg: Config, params: int, generators: int | None = None,
                    learners: int | None = None, shape: ModelShape | None = None, nodes: int = 1) -> MemoryPlan:
    """The memory plan of ``cfg`` (sizes default to the config's) for a policy of ``params`` parameters and, when
    known, ``shape`` (its activations: :func:`activation_bytes`; without it they are not counted), over ``nodes``
    Ray nodes (1: the launcher's own Ray on this host; a cluster joined: its nodes, each paying its own Ray)."""
    g = cfg.generators if generators is None else generators
    m = cfg.learners if learners is None else learners
    gen, res = cfg.generator, cfg.resources
    wbytes = DTYPE_BYTES.get(cfg.model.dtype, 4)
    forked = cfg.run.fork_workers and res.generator_gpus == 0 and res.learner_gpus == 0  # as the driver decides
    generator_gb = GENERATOR_FORKED_GB if forked else GENERATOR_BASE_GB
    kv_gb = kv_cache_gb(cfg) if res.generator_gpus == 0 else 0.0
    if res.generator_gpus == 0:
        engine_dtype = cfg.model.dtype if gen.dtype == "auto" else gen.dtype
        generator_gb += params * DTYPE_BYTES.get(engine_dtype, 4) / GB + kv_gb
    learner_gb = LEARNER_FORKED_GB if forked else LEARNER_BASE_GB
    activations = 0.0
    if cfg.resources.learner_gpus == 0:  # on a GPU the state lives there
        stage = cfg.learner.zero_stage
        optim = 8 + (4 if wbytes < 4 else 0)  # AdamW's two fp32 moments (+ fp32 master weights)
        per_param = (wbytes / (m if stage >= 3 else 1) + wbytes / (m if stage >= 2 else 1)
                     + optim / (m if stage >= 1 else 1))
        trained = params * per_param
        if cfg.train.lora.enabled:  # the adapters alone train: the base is frozen weights only
            trained = params * wbytes
        ref = params * wbytes if (cfg.train.objective.kl_coef > 0 or cfg.train.algorithm == "online_dpo"
                                  or (cfg.train.algorithm == "ppo" and cfg.train.ppo.kl_coef > 0)) else 0
        critic = params * per_param if cfg.train.algorithm == "ppo" else 0
        activations = activation_bytes(cfg, shape, m) if shape is not None else 0
        learner_gb += (trained + ref + critic + activations) / GB
    return MemoryPlan(generator_gb, learner_gb, FORKED_FIXED_GB if forked else FIXED_GB, g, m, activations / GB, kv_gb,
                      gen.kv_cache_gib == 0, max(nodes, 1), NODE_RAY_GB, NODE_FORK_GB if forked else 0.0)


def check_memory(plan: MemoryPlan, node_gb: float, where: str = "this machine") -> None:
    """Refuse a fleet whose estimate exceeds the node's memory, naming the largest ones that fit (and, when the
    config sets ``generator.kv_cache_gib``, that lowering it helps). With ``plan.nodes`` > 1 the whole estimate is
    held against ``node_gb``: right for nodes that share one machine (namespace nodes), cautious across hosts."""
    need = plan.total_gb()
    if need <= node_gb:
        return
    g, m, n = plan.largest(node_gb)
    options = []
    if g >= 1:
        options.append(f"--generators {g} --learners {plan.learners}")
    if m >= 1:
        options.append(f"--generators {plan.generators} --learners {m}")
    if n >= 1 and (n, n) not in ((g, plan.learners), (plan.generators, m)):
        options.append(f"--generators {n} --learners {n}")
    fits = ("; the largest that fit: " + " or ".join(options)) if options else "; not even 1 + 1 fits"
    raise ConfigError(
        f"{plan.generators} generator(s) and {plan.learners} learner rank(s) need about {need:.1f} GB of memory and "
        f"{where} has {node_gb:.1f} GB ({plan.generator_gb:.2f} GB per generator, of which {plan.kv_gb:.2f} GB "
        f"is its KV cache; {plan.learner_gb:.2f} GB per learner rank; {plan.fixed_words()}){fits}"
        + ("" if plan.kv_auto else "; or lower generator.kv_cache_gib (fractions of a GiB work; 0: what the engines "
           "can use)")
        + (f"; a learner rank's activations are {plan.activation_gb:.1f} GB of it: bound them with "
           "learner.max_tokens_per_micro_batch (and model.max_model_len)" if plan.activation_gb > 1.0 else ""))


def plan_for(cfg: Config, nodes: int = 1) -> MemoryPlan:
    """The memory plan for ``cfg``'s policy over ``nodes`` Ray nodes: ``model.path``'s size and shape, or the tiny
    model's (a few MB)."""
    if not cfg.model.path:
        return estimate_memory(cfg, 0, nodes=nodes)
    return estimate_memory(cfg, model_parameters(cfg.model.path), shape=model_shape(cfg.model.path), nodes=nodes)
