"""The generator's behaviour log-probs are those of the distribution its tokens were sampled from, under the
weights it says it serves: a real GeneratorActor (its own engine arguments, request path and swap), compared
with a transformers forward of the same weights.

One GeneratorActor (no Ray: constructed directly) in a process of its own (vLLM binds threads), sampling at
temperature 0.7; the sender is this process. The tiny model's context is stretched to 512 positions so that a
prompt can span more than two KV-cache blocks (the CPU backend's default block is 128 tokens; vLLM caches only
whole blocks):

- temperature: vLLM's log-prob of every sampled token equals log_softmax(logits / 0.7) of a transformers
  forward (vLLM's default ``logprobs_mode="raw_logprobs"`` returns log_softmax(logits): off by ~0.1-1 nat);
- prefix cache: a 300-token prompt generated at v0 (its blocks enter vLLM's prefix cache), v1 pushed and
  swapped in by the actor, the same prompt generated again: its log-probs equal the forward of v1 (with the
  cache left as it was, the prompt's first 256 positions are read from v0's KV: off by ~1 nat).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
from conftest import sequence_logprobs, stop_process
from fork_server import fork_context
from vllm_engine import HOST, expect

from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import TensorSpec, layout_from_wire, layout_to_wire, plan_buckets
from async_rlhf.sync.sender import Sender
from async_rlhf.sync.tensors import dtype_name

pytestmark = pytest.mark.integration

TEMPERATURE = 0.7
CONTEXT = 512
BLOCK = 128  # vLLM's CPU KV-cache block (vllm/platforms/cpu.py: the default when none is given)
LONG_PROMPT = 300  # > 2 blocks
MAX_NEW = 8
SAMPLES = 4
START_S = 240.0
TIMEOUT_S = 60.0
BUCKET_BYTES = 256 << 10


def _generator(model_dir: str, port: int, layout: list, cmds, out) -> None:
    """A GeneratorActor driven by commands: ("generate", ids) -> its request path, stepped to the end;
    ("swap", None) -> wait for the pushed version to be staged, load it the way the loop does."""
    try:
        from async_rlhf.config import load_config
        from async_rlhf.generator.engine_args import engine_env

        cfg = load_config(None, [f"model.path={model_dir}", f"model.max_model_len={CONTEXT}",
                                 f"generator.temperature={TEMPERATURE}", f"generator.max_new_tokens={MAX_NEW}",
                                 "generator.eval_every=0", f"sync.timeout_s={TIMEOUT_S}", "generators=1"])
        os.environ.update(engine_env(cfg))
        from async_rlhf.generator.actor import GeneratorActor

        actor = GeneratorActor(0, cfg, model_dir, "tcp://127.0.0.1:9")  # the buffer is never dialled here
        actor.init_weight_sync(HOST, port, "gen0", layout)
        out.put(("ready", None))
        calls = 0
        while True:
            cmd, arg = cmds.get(timeout=START_S)
            if cmd == "quit":
                break
            if cmd == "swap":
                deadline = time.monotonic() + TIMEOUT_S
                while actor._staged() is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                actor._load_version()
                out.put(("swapped", {"version": actor.version, "failures": actor.counters["update_failures"]}))
            elif cmd == "generate":
                calls += 1
                ids, n = arg
                actor._add_turn_request(f"t{calls}", list(ids), MAX_NEW, n)
                got: dict[int, dict[str, list]] = {i: {"tokens": [], "logprobs": []} for i in range(n)}
                cached = 0  # prompt tokens vLLM took from its prefix cache
                while actor.engine.has_unfinished_requests():
                    for o in actor.engine.step():
                        c = o.outputs[0]
                        got[c.index]["tokens"] += list(c.token_ids)
                        got[c.index]["logprobs"] += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
                        cached = max(cached, o.num_cached_tokens or 0)
                out.put(("generated", ([got[i] for i in range(n)], cached)))
        out.put(("bye", None))
    except Exception:
        out.put(("crash", traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _long_context_model(tmp: Path) -> Path:
    """The tiny model with room for CONTEXT positions (rotary embeddings need no new weights)."""
    from async_rlhf.tiny.model import build_tiny_model

    model_dir = build_tiny_model(tmp / "model", seed=0)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = CONTEXT
    cfg_path.write_text(json.dumps(cfg))
    return model_dir


def tempered_logprobs(model, weights: dict[str, torch.Tensor], prompt: list[int],
                      samples: list[dict[str, list]]) -> list[list[float]]:
    """log_softmax(logits / TEMPERATURE) of each sample's tokens after ``prompt``, by transformers in fp32."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    whole = sequence_logprobs(model, [prompt + s["tokens"] for s in samples], TEMPERATURE)
    return [logp[len(prompt) - 1:] for logp in whole]


def worst(samples: list[dict[str, list]], want: list[list[float]]) -> float:
    return max(abs(a - b) for s, w in zip(samples, want) for a, b in zip(s["logprobs"], w))


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model_dir = _long_context_model(tmp_path_factory.mktemp("agreement"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    layout = layout_to_wire(plan_buckets([TensorSpec(n, tuple(t.shape), dtype_name(t)) for n, t in base.items()],
                                         BUCKET_BYTES))
    sender = Sender(layout_from_wire(layout), HOST, free_port(), timeout_s=TIMEOUT_S)
    ctx = fork_context()
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_generator, args=(str(model_dir), sender.port, layout, cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=START_S)
        expect(out, "ready", START_S)

        def generate(prompt: list[int], n: int = SAMPLES) -> tuple[list[dict[str, list]], int]:
            """n samples after ``prompt`` through the actor's request path, and the prompt tokens read from
            vLLM's prefix cache."""
            cmds.put(("generate", (prompt, n)))
            samples, cached = expect(out, "generated", TIMEOUT_S)
            assert all(s["tokens"] for s in samples)
            return samples, cached

        def push(weights: dict[str, torch.Tensor], version: int) -> None:
            sender.push(weights, version)
            cmds.put(("swap", None))
            assert expect(out, "swapped", TIMEOUT_S) == {"version": version, "failures": 0}

        yield {"model": model, "base": base, "vocab": model.config.vocab_size, "generate": generate, "push": push,
               "eos": model.config.eos_token_id}
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)


def _prompt(vocab: int, length: int, seed: int, avoid: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (length,), generator=g)
    return [int(t) for t in ids if int(t) != avoid]


def test_behaviour_logprobs_are_those_of_the_tempered_distribution(generator: dict) -> None:
    prompt = _prompt(generator["vocab"], 12, seed=1, avoid=generator["eos"])
    samples, _ = generator["generate"](prompt)
    diff = worst(samples, tempered_logprobs(generator["model"], generator["base"], prompt, samples))
    print(f"max |vLLM - log_softmax(logits/{TEMPERATURE})| {diff:.2e} over {sum(len(s['tokens']) for s in samples)}"
          " sampled tokens")
    assert diff < 1e-4, f"vLLM's behaviour log-probs are not those of temperature {TEMPERATURE} (max diff {diff:.3g})"


def test_a_swap_leaves_no_prompt_kv_of_the_old_weights_in_the_prefix_cache(generator: dict) -> None:
    prompt = _prompt(generator["vocab"], LONG_PROMPT + 20, seed=2, avoid=generator["eos"])[:LONG_PROMPT]
    assert len(prompt) == LONG_PROMPT
    whole_blocks = LONG_PROMPT // BLOCK * BLOCK
    _, cached = generator["generate"](prompt)  # v0 computes the prompt's blocks; vLLM keeps them in its cache
    _, cached = generator["generate"](prompt, 1)
    assert cached == whole_blocks, "the prompt's whole blocks are shared within a version"
    g = torch.Generator().manual_seed(5)
    v1 = {n: t + 0.02 * torch.randn(t.shape, generator=g) for n, t in generator["base"].items()}
    generator["push"](v1, 1)
    first, cached_after_swap = generator["generate"](prompt, 1)
    again, cached_again = generator["generate"](prompt)  # reads the blocks v1 computed just before
    diff = max(worst(s, tempered_logprobs(generator["model"], v1, prompt, s)) for s in (first, again))
    print(f"after the swap: max |vLLM - transformers(v1)| {diff:.2e} on a {LONG_PROMPT}-token prompt seen at v0; "
          f"prompt tokens from the prefix cache: {cached_after_swap} at the first v1 request, {cached_again} after")
    assert cached_after_swap == 0, f"the first request after the swap read {cached_after_swap} tokens of v0's KV"
    assert diff < 1e-4, f"tokens stamped v1 were computed from v0's cached prompt KV (max diff {diff:.3g})"
    assert cached_again == whole_blocks, "v1's own blocks are shared again"
