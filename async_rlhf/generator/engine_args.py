"""What the generator asks of vLLM (pure: config in, keyword arguments of ``vllm.LLM`` out), and the version
stamp of the tokens an engine step returns.

Per-device defaults (``generator.*`` set to auto / 0 picks them)::

                          CPU (resources.generator_gpus=0)     GPU
    enforce_eager         on (compiling costs ~20 s here)      off (CUDA graphs)
    gpu_memory_utilization 0.3 (unused by the CPU backend)     0.9 on a whole GPU, 0.9 x the share when
                                                               resources.generator_gpus < 1 (a shared GPU)
    dtype                 model.dtype                          model.dtype
    max_model_len         model.max_model_len                  model.max_model_len
    tensor_parallel_size  1                                    resources.tensor_parallel
    KV cache              what the engine can use (kv_cache_plan;  by gpu_memory_utilization
                          generator.kv_cache_gib=0) or that GiB
    async_scheduling      off (in_flight) / vLLM's (drain)     same: see VersionClock
    logprobs_mode         processed_logprobs                   processed_logprobs

``logprobs_mode="processed_logprobs"``: the log-prob vLLM returns for a sampled token is that of the distribution
it was sampled from (logits / generator.temperature), not vLLM's default ``raw_logprobs`` (log_softmax of the
raw logits, whatever the temperature); the learner divides its logits by the same temperature, so both sides of
every importance ratio are pi_T. At temperature 1 the two modes give the same values.

Prefix caching stays on (vLLM's default): every request carries the version being served as its ``cache_salt``
(:func:`prompt_inputs`), so a request never reads prompt KV that older weights wrote (docs/architecture.md,
"Versions").

Async scheduling (on by default on GPU): a step returns the tokens of the step before while the next one is
already computing, so a swap between two steps would let tokens of the old weights come back after it. With
in-flight updates it is turned off; with drain updates nothing is in flight at a swap, so it may stay on.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from async_rlhf.config import Config

CPU_MEMORY_UTILIZATION = 0.3
"""What the CPU engine has always been given (its KV cache is ``kv_cache_memory_bytes`` instead)."""
GPU_MEMORY_UTILIZATION = 0.9
"""A dedicated GPU: vLLM's own default is 0.92; a little head room for the receive arena of the push."""


def engine_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for one generator under ``cfg`` (besides model, seed, extension)."""
    gen, res = cfg.generator, cfg.resources
    on_gpu = res.generator_gpus > 0
    if gen.enforce_eager == "auto":
        eager = not on_gpu
    else:
        eager = gen.enforce_eager == "on"
    util = gen.gpu_memory_utilization
    if util == 0:
        share = res.generator_gpus / res.tensor_parallel if on_gpu else 1.0
        util = GPU_MEMORY_UTILIZATION * min(share, 1.0) if on_gpu else CPU_MEMORY_UTILIZATION
    out: dict[str, Any] = {
        "dtype": cfg.model.dtype if gen.dtype == "auto" else gen.dtype,
        "enforce_eager": eager,
        "max_model_len": gen.max_model_len or cfg.model.max_model_len,
        "gpu_memory_utilization": round(util, 4),
        "tensor_parallel_size": res.tensor_parallel,
    }
    if gen.update_mode == "in_flight":
        out["async_scheduling"] = False  # see the module docstring
    if gen.kv_block_size:
        out["block_size"] = gen.kv_block_size
    out["logprobs_mode"] = "processed_logprobs"  # the sampled distribution's log-probs (module docstring)
    if not on_gpu:  # in bytes: VLLM_CPU_KVCACHE_SPACE, which vLLM would prefer, takes whole GiB only
        if gen.kv_cache_gib == 0:  # auto
            kv = kv_cache_plan(cfg)
            out["num_gpu_blocks_override"] = kv.blocks  # the cache vLLM allocates: these blocks, its own page size
            out["kv_cache_memory_bytes"] = kv.nbytes  # skips vLLM's warm-up and share-of-the-machine sizing
        else:
            out["kv_cache_memory_bytes"] = kv_cache_bytes(gen.kv_cache_gib)
    return out


def eager_compile_stance(engine: dict[str, Any], on_gpu: bool) -> str | None:
    """The ``torch.compiler.set_stance`` an engine process takes before it builds its engine: ``"force_eager"``
    for an eager CPU engine (``engine``: :func:`engine_kwargs`), else None (vLLM's own choice).

    An eager engine still compiled: vLLM 0.32 wraps its sampler's log-prob rank count
    (``vllm.v1.sample.ops.logprobs.batched_count_greater_than``) in ``torch.compile``, so the first request that
    asks for log-probs (every rollout does) ran dynamo and inductor, a C++ build into
    ``TORCHINDUCTOR_CACHE_DIR`` (``/tmp/torchinductor_<user>``): 8 CPU-s on 2 cores in a fresh machine's first
    run, twice (static shapes, then dynamic ones), and 0.6 CPU-s of tracing in every later engine process even
    with the kernels cached. Forced eager, the count runs as plain torch ops (the same values; its inputs are
    a batch's log-probs over the vocabulary, small on CPU) and that request costs 0.03 CPU-s."""
    return "force_eager" if engine.get("enforce_eager") and not on_gpu else None


def apply_compile_stance(engine: dict[str, Any], on_gpu: bool) -> None:
    """Take :func:`eager_compile_stance` in this process (torch's stance is process-wide: every thread, every
    ``torch.compile`` here; the CPU engine runs in its generator's own process, and nothing else there compiles)."""
    stance = eager_compile_stance(engine, on_gpu)
    if stance:
        import torch

        torch.compiler.set_stance(stance)


def kv_cache_bytes(gib: float) -> int:
    return int(gib * (1 << 30))


CPU_BLOCK_TOKENS = 128
"""vLLM's KV block on the CPU backend when ``generator.kv_block_size`` is 0 (vllm/platforms/cpu.py, 0.32)."""
MIN_KV_SEQUENCES = 16
"""The automatic KV cache holds at least this many whole sequences of ``max_model_len`` (a fleet with few groups
in flight still batches the held-out evaluation and a group's retries)."""
DEFAULT_KV_BYTES_PER_TOKEN = 4096
"""Per-token KV bytes assumed when the model's ``config.json`` cannot be read (the tiny model's is 1024; this
only sizes ``kv_cache_memory_bytes``: the blocks vLLM allocates are ``num_gpu_blocks_override`` at its own page
size, whatever the model)."""


@dataclass(frozen=True)
class KvCachePlan:
    """The automatic KV cache of one CPU engine (``generator.kv_cache_gib=0``, the default)."""

    sequences: int
    """Sequences the engine may run at once: ``groups_in_flight x group_size``, + the held-out prompts when
    generator 0 evaluates (all submitted at once), at least :data:`MIN_KV_SEQUENCES`."""
    block_tokens: int
    blocks: int
    """``sequences x ceil(max_model_len / block_tokens)``, + 1: vLLM's block pool holds one null block back."""
    bytes_per_token: int
    """2 (K and V) x layers x KV heads x head dim x the engine dtype's bytes."""

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_tokens * self.bytes_per_token


def kv_bytes_per_token(model_path: str | Path | None, dtype: str) -> int:
    """K and V bytes one token takes in the cache of a Hugging Face model (``config.json``: layers, KV heads,
    head dim), or of the tiny model (``model_path`` empty: its architecture, async_rlhf/tiny/cache.py);
    :data:`DEFAULT_KV_BYTES_PER_TOKEN` when the config is unreadable."""
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    if not model_path:
        from async_rlhf.tiny.cache import HIDDEN_SIZE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS

        return 2 * NUM_LAYERS * NUM_KV_HEADS * (HIDDEN_SIZE // NUM_HEADS) * nbytes
    try:
        conf = json.loads((Path(model_path) / "config.json").read_text())
        conf = conf.get("text_config", conf)
        heads = int(conf["num_attention_heads"])
        head_dim = int(conf.get("head_dim") or int(conf["hidden_size"]) // heads)
        kv_heads = int(conf.get("num_key_value_heads") or heads)
        return 2 * int(conf["num_hidden_layers"]) * kv_heads * head_dim * nbytes
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_KV_BYTES_PER_TOKEN


def kv_cache_plan(cfg: Any) -> KvCachePlan:
    """What an engine can use of its KV cache, and no more: every sequence it may run at once at the longest
    context it accepts, rounded up to whole blocks (see :class:`KvCachePlan`). Beyond it vLLM queues requests
    (no failure); the tiny model's default: 264 sequences of one 128-token block, 33.1 MiB."""
    gen = cfg.generator
    seqs = gen.groups_in_flight * cfg.train.group_size
    if gen.eval_every:
        seqs += cfg.task.heldout_size
    seqs = max(seqs, MIN_KV_SEQUENCES)
    block = gen.kv_block_size or CPU_BLOCK_TOKENS
    context = gen.max_model_len or cfg.model.max_model_len
    blocks = seqs * -(-context // block) + 1
    dtype = cfg.model.dtype if gen.dtype == "auto" else gen.dtype
    return KvCachePlan(seqs, block, blocks, kv_bytes_per_token(cfg.model.path, dtype))


def prompt_inputs(token_ids: list[int], version: int) -> dict[str, Any]:
    """The engine input of a request started while ``version`` is served: its token ids and the version as
    vLLM's ``cache_salt``.

    vLLM's prefix cache keys a block by its tokens (and the salt, folded into the first block's hash and so into
    every later one); it knows nothing of weight swaps. Without the salt a request started after a swap reuses
    prompt KV (a shared system prompt, the earlier turns of a conversation, the same prompt drawn again) that any
    older version computed, while its tokens are stamped with the new one. ``reset_prefix_cache()`` after a swap
    is no cure in flight: it refuses while any running request holds a block (vLLM 0.32
    ``BlockPool.reset_prefix_cache``), which in the in-flight loop is nearly always, and
    ``reset_running_requests=True`` preempts and recomputes every request in flight at every swap. With the salt,
    requests of one version still share their prompt blocks (a group's samples, a common system prompt), and
    blocks of older versions are simply never hit again (evicted as the cache needs room).
    """
    return {"prompt_token_ids": token_ids, "cache_salt": f"v{version}"}


def engine_lag(kwargs: dict[str, Any], on_gpu: bool) -> int:
    """Steps between computing a token and returning it: 1 under async scheduling (vLLM's default on GPU
    when not set), else 0."""
    asynchronous = kwargs.get("async_scheduling")
    if asynchronous is None:
        asynchronous = on_gpu
    return 1 if asynchronous else 0


class VersionClock:
    """The version of the weights that computed the tokens an engine step returns.

    An engine with lag L returns at step n the tokens it computed at step n - L, with the weights live then::

        step        1    2    3    4    5        swap to v1 between steps 2 and 3
        live        v0   v0   v1   v1   v1
        L=0 stamp   v0   v0   v1   v1   v1
        L=1 stamp   v0   v0   v0   v1   v1       (step 3 returns what step 2 computed)

    A step with nothing in flight (``idle``) leaves nothing computed with older weights behind.
    """

    def __init__(self, lag: int) -> None:
        if lag < 0:
            raise ValueError(f"an engine's lag is 0 or more steps, got {lag}")
        self._recent: deque[int] = deque(maxlen=lag + 1)

    def step(self, live: int) -> int:
        """Call at every engine step with the version live now; the stamp of the tokens it returns."""
        self._recent.append(live)
        return self._recent[0]

    def idle(self) -> None:
        """Nothing is in flight in the engine."""
        self._recent.clear()


def engine_env(cfg: Config) -> dict[str, str]:
    """The environment a vLLM engine process needs (a generator actor's runtime env, or in-process for offline
    inference): vLLM's engine core in the same process, its threads from the config (the KV cache size is an
    engine argument: ``engine_kwargs``)."""
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(cfg.generator.threads),
        "VLLM_LOGGING_LEVEL": "ERROR",
        "TOKENIZERS_PARALLELISM": "false",
    }
