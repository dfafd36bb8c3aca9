"""Host memory a run needs, per role, as a pure function of the config and the model's size.

    generator (CPU engine)  engine ~0.9 GB (vLLM, torch, the actor)  + weights in the engine's dtype
                            + KV cache generator.kv_cache_gib
    generator (GPU engine)  ~0.9 GB on the host (weights and KV cache live on the GPU)
    learner rank            ~0.6 GB (DeepSpeed, torch, the actor)    + policy state: weights, gradients, AdamW's
                            two fp32 moments (+ fp32 master weights under bf16/fp16), the parts ZeRO shards
                            divided by the ranks; + the frozen reference (KL, DPO) and PPO's critic (its own
                            weights and optimizer)
    fixed                   ~1.0 GB: Ray's processes, the driver, the buffer actor

Measured here (tiny model, 0.3 M parameters): a CPU generator ~1.9 GB resident with 1 GiB of KV cache, a learner
rank ~0.6 GB; 8 + 8 peaked at 16.5 GB on a 24 GiB machine. The estimate errs high (the KV cache is counted whole
though its pages are touched only as it fills). A fleet whose estimate exceeds the node's memory is refused
before anything starts, naming the largest one that fits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rlhf.config import Config, ConfigError

GB = 1e9
GENERATOR_BASE_GB = 0.9
LEARNER_BASE_GB = 0.6
FIXED_GB = 1.0
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
class MemoryPlan:
    generator_gb: float
    learner_gb: float
    fixed_gb: float
    generators: int
    learners: int

    def total_gb(self, generators: int | None = None, learners: int | None = None) -> float:
        g = self.generators if generators is None else generators
        m = self.learners if learners is None else learners
        return self.fixed_gb + g * self.generator_gb + m * self.learner_gb

    def largest(self, node_gb: float) -> tuple[int, int, int]:
        """What fits in ``node_gb``: (most generators beside this many learners, most learners beside this many
        generators, the largest N of N generators + N learners); 0 where none does."""
        room = node_gb - self.fixed_gb
        g = int((room - self.learners * self.learner_gb) // self.generator_gb)
        m = int((room - self.generators * self.generator_gb) // self.learner_gb)
        n = int(room // (self.generator_gb + self.learner_gb))
        return max(g, 0), max(m, 0), max(n, 0)

    def table(self) -> str:
        return (f"memory estimate: {self.generator_gb:.2f} GB per generator, {self.learner_gb:.2f} GB per learner "
                f"rank, {self.fixed_gb:.1f} GB for Ray, the driver and the buffer: {self.total_gb():.1f} GB in all")

    def to_dict(self) -> dict[str, Any]:
        return {"generator_gb": round(self.generator_gb, 3), "learner_gb": round(self.learner_gb, 3),
                "fixed_gb": self.fixed_gb, "total_gb": round(self.total_gb(), 3)}


def estimate_memory(cfg: Config, params: int, generators: int | None = None,
                    learners: int | None = None) -> MemoryPlan:
    """The memory plan of ``cfg`` (sizes default to the config's) for a policy of ``params`` parameters."""
    g = cfg.generators if generators is None else generators
    m = cfg.learners if learners is None else learners
    gen = cfg.generator
    wbytes = DTYPE_BYTES.get(cfg.model.dtype, 4)
    if cfg.resources.generator_gpus > 0:
        generator_gb = GENERATOR_BASE_GB
    else:
        engine_dtype = cfg.model.dtype if gen.dtype == "auto" else gen.dtype
        generator_gb = (GENERATOR_BASE_GB + params * DTYPE_BYTES.get(engine_dtype, 4) / GB
                        + gen.kv_cache_gib * (1 << 30) / GB)
    learner_gb = LEARNER_BASE_GB
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
        learner_gb += (trained + ref + critic) / GB
    return MemoryPlan(generator_gb, learner_gb, FIXED_GB, g, m)


def check_memory(plan: MemoryPlan, node_gb: float, where: str = "this machine") -> None:
    """Refuse a fleet whose estimate exceeds the node's memory, naming the largest ones that fit."""
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
        f"{where} has {node_gb:.1f} GB ({plan.generator_gb:.2f} GB per generator, of which "
        f"generator.kv_cache_gib is the KV cache; {plan.learner_gb:.2f} GB per learner rank; {plan.fixed_gb:.1f} GB "
        f"for Ray, the driver and the buffer){fits}; or lower generator.kv_cache_gib (fractions of a GiB work)")


def plan_for(cfg: Config) -> MemoryPlan:
    """The memory plan for ``cfg``'s policy: ``model.path``'s size, or the tiny model's (a few MB)."""
    params = model_parameters(cfg.model.path) if cfg.model.path else 0
    return estimate_memory(cfg, params)
