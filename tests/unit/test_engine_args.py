"""What the generator asks of vLLM per device, and the version stamps of a lagged engine (async scheduling)."""

import random

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.generator.engine_args import VersionClock, engine_kwargs, engine_lag


def test_cpu_defaults_are_what_the_engine_always_got() -> None:
    kw = engine_kwargs(load_config())
    # the KV cache: 8 groups x 8 samples + 200 held-out prompts, one 128-token block each (64-token context),
    # + the null block; 1024 bytes a token (2 x 2 layers x 2 KV heads x head dim 32 x 4 bytes)
    assert kw == {"dtype": "float32", "enforce_eager": True, "max_model_len": load_config().model.max_model_len,
                  "gpu_memory_utilization": 0.3, "tensor_parallel_size": 1, "async_scheduling": False,
                  "num_gpu_blocks_override": 265, "kv_cache_memory_bytes": 265 * 128 * 1024,
                  "logprobs_mode": "processed_logprobs"}
    assert engine_lag(kw, on_gpu=False) == 0


def test_behaviour_logprobs_are_the_sampled_distributions_and_requests_are_salted_by_version() -> None:
    """vLLM returns log-probs after temperature (the learner divides its logits by it too) on every device, and a
    request's prefix-cache salt is the version it starts under: no prompt KV of older weights is reused."""
    from async_rlhf.generator.engine_args import prompt_inputs

    for extra in ([], ["resources.generator_gpus=1", "resources.learner_gpus=1"], ["generator.temperature=0.7"]):
        assert engine_kwargs(load_config(None, extra))["logprobs_mode"] == "processed_logprobs"
    assert prompt_inputs([5, 6], 3) == {"prompt_token_ids": [5, 6], "cache_salt": "v3"}
    assert prompt_inputs([5, 6], 3)["cache_salt"] != prompt_inputs([5, 6], 4)["cache_salt"]


def test_kv_cache_takes_fractions_of_a_gib_as_bytes_and_gpu_engines_size_their_own() -> None:
    """VLLM_CPU_KVCACHE_SPACE takes whole GiB only (vLLM int()s it): a fraction goes as kv_cache_memory_bytes."""
    from async_rlhf.generator.engine_args import engine_env

    cfg = load_config(None, ["generator.kv_cache_gib=0.05"])
    assert engine_kwargs(cfg)["kv_cache_memory_bytes"] == int(0.05 * (1 << 30))
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(cfg)  # it would override the bytes
    gpu = engine_kwargs(load_config(None, ["resources.generator_gpus=1", "resources.learner_gpus=1"]))
    assert "kv_cache_memory_bytes" not in gpu
    with pytest.raises(ConfigError):
        load_config(None, ["generator.kv_cache_gib=-1"])


def test_gpu_defaults_and_overrides() -> None:
    gpu = ["resources.generator_gpus=1", "resources.learner_gpus=1"]
    kw = engine_kwargs(load_config(None, gpu))
    assert kw["enforce_eager"] is False and kw["gpu_memory_utilization"] == pytest.approx(0.9)
    shared = engine_kwargs(load_config(None, ["resources.generator_gpus=0.5", "resources.learner_gpus=0.5"]))
    assert shared["gpu_memory_utilization"] == pytest.approx(0.45)  # a learner holds the other half
    tp = engine_kwargs(load_config(None, ["resources.tensor_parallel=2", "resources.generator_gpus=2"]))
    assert tp["tensor_parallel_size"] == 2 and tp["gpu_memory_utilization"] == pytest.approx(0.9)
    kw = engine_kwargs(load_config(None, [*gpu, "generator.enforce_eager=on", "generator.gpu_memory_utilization=0.6",
                                          "generator.max_model_len=512", "generator.dtype=bfloat16"]))
    assert (kw["enforce_eager"], kw["gpu_memory_utilization"], kw["max_model_len"], kw["dtype"]) == (
        True, 0.6, 512, "bfloat16")


def test_in_flight_updates_turn_async_scheduling_off_drain_leaves_it_to_vllm() -> None:
    gpu = ["resources.generator_gpus=1", "resources.learner_gpus=1"]
    in_flight = engine_kwargs(load_config(None, gpu))
    assert in_flight["async_scheduling"] is False and engine_lag(in_flight, on_gpu=True) == 0
    drain = engine_kwargs(load_config(None, [*gpu, "generator.update_mode=drain"]))
    assert "async_scheduling" not in drain and engine_lag(drain, on_gpu=True) == 1


@pytest.mark.parametrize("override, message", [
    ("generator.enforce_eager=maybe", "generator.enforce_eager must be one of auto, on, off"),
    ("generator.gpu_memory_utilization=1.5", "gpu_memory_utilization must lie in 0-1"),
    ("generator.dtype=int8", "generator.dtype must be one of"),
    ("resources.generator_gpus=1.5", "fractions below 1"),
    ("resources.learner_gpus=2", "one device"),
    ("sync.backend=nccl", "sync.backend=nccl moves CUDA tensors"),
])
def test_bad_engine_and_gpu_settings_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_nccl_push_needs_whole_gpus() -> None:
    with pytest.raises(ConfigError, match="whole GPUs"):
        load_config(None, ["sync.backend=nccl", "resources.generator_gpus=0.5", "resources.learner_gpus=0.5"])
    load_config(None, ["sync.backend=nccl", "resources.generator_gpus=1", "resources.learner_gpus=1"])


class LaggedEngine:
    """Returns at step n the tokens computed at step n - lag, with the weights live then (async scheduling)."""

    def __init__(self, lag: int) -> None:
        self.lag, self.pipeline, self.weights = lag, [], 0

    def step(self, busy: bool) -> list[int]:
        """One step; the true versions of the tokens it returns."""
        if not busy:  # nothing in flight: whatever was computed came back already
            out, self.pipeline = self.pipeline, []
            return out
        self.pipeline.append(self.weights)
        if len(self.pipeline) > self.lag:
            return [self.pipeline.pop(0)]
        return []


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_stamps_are_exact_under_a_lagged_engine(lag: int) -> None:
    rng = random.Random(lag)
    engine, clock, live = LaggedEngine(lag), VersionClock(lag), 0
    naive_wrong = 0
    for _ in range(500):
        if rng.random() < 0.2:  # a swap between two steps
            live += 1
            engine.weights = live
        busy = rng.random() > 0.05
        if not busy:
            engine.step(busy=False)
            clock.idle()
            continue
        returned = engine.step(busy=True)
        stamp = clock.step(live)
        for true_version in returned:
            assert stamp == true_version
            naive_wrong += true_version != live
    assert (naive_wrong > 0) == (lag > 0)  # stamping with the live version is wrong exactly when the engine lags


def test_kv_block_size_is_vllms_default_unless_set() -> None:
    assert "block_size" not in engine_kwargs(load_config(None, []))
    assert engine_kwargs(load_config(None, ["generator.kv_block_size=32"]))["block_size"] == 32


def test_an_eager_cpu_engine_runs_vllms_compiled_helpers_eagerly_too() -> None:
    """vLLM compiles its sampler's log-prob rank count with inductor even in an eager engine; a CPU generator
    forces it eager (nothing built at run time), a GPU engine or one asked to compile keeps vLLM's choice."""
    from async_rlhf.generator.engine_args import eager_compile_stance

    cpu = engine_kwargs(load_config())
    assert eager_compile_stance(cpu, on_gpu=False) == "force_eager"
    gpu_cfg = load_config(None, ["resources.generator_gpus=1", "resources.learner_gpus=1"])
    assert eager_compile_stance(engine_kwargs(gpu_cfg), on_gpu=True) is None
    compiled = engine_kwargs(load_config(None, ["generator.enforce_eager=off"]))
    assert eager_compile_stance(compiled, on_gpu=False) is None


def test_the_automatic_kv_cache_holds_what_the_engine_can_run_in_whole_blocks(tmp_path) -> None:
    """generator.kv_cache_gib=auto: sequences in flight x blocks per max_model_len sequence + vLLM's null block,
    at the model's per-token K and V bytes; a floor of MIN_KV_SEQUENCES sequences; a number keeps its GiB."""
    import json

    from async_rlhf.generator.engine_args import MIN_KV_SEQUENCES, kv_bytes_per_token, kv_cache_plan

    no_eval = ["generator.eval_every=0"]
    kv = kv_cache_plan(load_config(None, [*no_eval, "generator.groups_in_flight=4", "train.group_size=4"]))
    assert (kv.sequences, kv.block_tokens, kv.blocks, kv.bytes_per_token) == (16, 128, 17, 1024)
    # a context of 300 tokens takes 3 blocks of 128 (rounded up), or 19 of 16
    long = kv_cache_plan(load_config(None, [*no_eval, "model.max_model_len=300", "generator.max_new_tokens=8"]))
    assert (long.sequences, long.blocks) == (64, 64 * 3 + 1)
    small_blocks = kv_cache_plan(load_config(None, [*no_eval, "model.max_model_len=300", "generator.max_new_tokens=8",
                                                    "generator.kv_block_size=16"]))
    assert small_blocks.blocks == 64 * 19 + 1 and small_blocks.nbytes == (64 * 19 + 1) * 16 * 1024
    floor = kv_cache_plan(load_config(None, [*no_eval, "generator.groups_in_flight=1", "train.group_size=2"]))
    assert floor.sequences == MIN_KV_SEQUENCES
    with_eval = kv_cache_plan(load_config(None, ["task.heldout_size=50"]))
    assert with_eval.sequences == 8 * 8 + 50
    # a Hugging Face model's per-token bytes: Llama-2-7B in bf16 (32 layers, 32 KV heads of 128) = 512 KiB
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096,
                                                      "num_attention_heads": 32, "vocab_size": 32000}))
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 2 * 32 * 32 * 128 * 2
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 24, "hidden_size": 896, "head_dim": 64,
                                                      "num_attention_heads": 14, "num_key_value_heads": 2}))
    assert kv_bytes_per_token(tmp_path, "float32") == 2 * 24 * 2 * 64 * 4  # grouped KV heads (Qwen2-0.5B)
    assert kv_bytes_per_token(tmp_path / "absent", "float32") > 0
    fixed = engine_kwargs(load_config(None, ["generator.kv_cache_gib=0.25"]))
    assert fixed["kv_cache_memory_bytes"] == 1 << 28 and "num_gpu_blocks_override" not in fixed
