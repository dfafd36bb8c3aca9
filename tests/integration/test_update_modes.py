"""Both update modes on a real vLLM engine, with a real push arriving while requests are generating.

One fp32 engine in a process of its own, driven step by step like the generator loop (``LLMEngine.step``,
every new token stamped with the version being served); the sender is this process. Version 1 is built
so that it makes one token X overwhelmingly likely whatever the context (see ``forcing_weights``), so
"this token came from the new weights" is visible in the token itself:

    in_flight   wave 1 (4 requests) -- 5 steps at v0 -- v1 announced: received on the worker's thread while
                the engine keeps stepping at v0 -- swapped in between two steps -- rest at v1
                wave 2 admitted after the swap                                 -- all at v1
    drain       wave 1 -- v2 announced: admit nothing, finish wave 1 at v1 -- swap -- wave 2 at v2

Asserted: per-token versions never decrease and change exactly once, at the swap, in every in-flight
trajectory; every token stamped v1 is X (and its vLLM log-prob is ~0) while v0 tokens are not all X;
in drain mode no trajectory mixes versions. v2 is the base model again, so drain's wave 2 is not all X.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
from conftest import poll_joiners, stop_process
from fork_server import fork_context
from vllm_engine import EXTENSION, expect

from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import TensorSpec, layout_from_wire, layout_to_wire, plan_buckets
from async_rlhf.sync.sender import PushError, Sender
from async_rlhf.sync.tensors import dtype_name

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
ENGINE_START_S = 240.0
TIMEOUT_S = 60.0
SWAP_AFTER_STEPS = 5
MAX_TOKENS = 32
FORCED = 7  # token X: an ordinary character of the tiny vocabulary


def _engine(model_dir: str, port: int, layout: list, member_id: str, late: bool, cmds, out) -> None:
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                       "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR"})
    try:
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
                  worker_extension_cls=EXTENSION)
        llm.collective_rpc("init_receiver", args=(HOST, port, member_id, layout, "gloo", TIMEOUT_S))
        served = [0]  # the version the engine serves (it starts from the checkpoint: v0)
        if late:  # like GeneratorActor.init_weight_sync(late=True): take the next version before serving
            served[0] = llm.collective_rpc("receive_update", kwargs={"timeout_s": ENGINE_START_S})[0]["version"]
            out.put(("joined", served[0]))
        else:
            out.put(("joined", llm.collective_rpc("join_push_group", args=(ENGINE_START_S,))[0]))
        engine = llm.llm_engine
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        while True:
            cmd, arg = cmds.get(timeout=ENGINE_START_S)
            if cmd == "quit":
                break
            if cmd == "receive":
                try:
                    got = llm.collective_rpc("receive_update", kwargs={"timeout_s": TIMEOUT_S})[0]
                    served[0] = got["version"]
                    out.put(("received", got))
                except Exception as exc:
                    out.put(("receive_failed", f"{type(exc).__name__}: {exc}"))
                continue
            run = _generate(llm, engine, params, cmd, arg, served[0])
            served[0] = run["version"]
            out.put(("trajectories", run))
        out.put(("bye", None))
    except Exception:
        out.put(("crash", traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def _generate(llm, engine, params, mode: str, prompts: list[list[int]], version: int) -> dict:
    """The generator loop's step 1 in miniature: an update requested after SWAP_AFTER_STEPS steps is loaded
    between two steps (in_flight) or once nothing is in flight (drain, admitting nothing meanwhile)."""
    traj: dict[str, dict] = {}

    def admit(wave: int) -> None:
        for i, ids in enumerate(prompts):
            rid = f"w{wave}-{i}-{mode}"
            traj[rid] = {"wave": wave, "tokens": [], "logprobs": [], "versions": []}
            engine.add_request(rid, {"prompt_token_ids": ids}, params)

    admit(1)
    steps, pending, swapped_at, pause_s, staging_steps = 0, False, None, 0.0, 0
    if mode == "serve":  # no update: just generate
        swapped_at = {}
    while engine.has_unfinished_requests() or swapped_at is None:
        if steps == SWAP_AFTER_STEPS and swapped_at is None and not pending:
            pending = True  # the learner announced a version: receive it while generating
        if pending:
            staged = llm.collective_rpc("stage_update", kwargs={"timeout_s": TIMEOUT_S})[0]
            tokens_left = min(MAX_TOKENS - len(t["tokens"]) for t in traj.values())
            if not staged and (tokens_left <= 2 or not engine.has_unfinished_requests()):
                time.sleep(0.005)  # keep the swap mid-generation (in_flight) / nothing to step (drain)
                continue
            if staged and (mode == "in_flight" or not engine.has_unfinished_requests()):
                got = llm.collective_rpc("apply_update")[0]
                version, pause_s, pending = int(got["version"]), float(got["sync/pause_s"]), False
                swapped_at = {rid: len(t["tokens"]) for rid, t in traj.items()}
                admit(2)
                continue
            staging_steps += 1
        for o in engine.step():
            c = o.outputs[0]
            t = traj[o.request_id]
            t["tokens"] += list(c.token_ids)
            t["logprobs"] += [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs or [])]
            t["versions"] += [version] * len(c.token_ids)
        steps += 1
    return {"traj": traj, "swapped_at": swapped_at, "pause_s": pause_s, "version": version,
            "staging_steps": staging_steps}


@torch.no_grad()
def forcing_weights(model, forced: int) -> dict[str, torch.Tensor]:
    """Weights under which token ``forced`` follows any context, even one whose KV cache the old weights wrote.

    In the last layer the queries are zero (uniform attention) and the values a huge constant (v_proj: zero
    weight, large bias), so the attention output is the same huge vector for every position as soon as the
    current position's own value is in the mix; the MLP is silenced. The final hidden state then points one
    way, ``g``, and the tied embedding row of ``forced`` is set along ``g`` so that its logit is ~40 above
    every other one.
    """
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    last = f"model.layers.{model.config.num_hidden_layers - 1}."
    for name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.v_proj.weight",
                 "mlp.down_proj.weight"):
        w[last + name].zero_()
    g = torch.Generator().manual_seed(11)
    w[last + "self_attn.v_proj.bias"] = 1e3 * torch.randn(w[last + "self_attn.v_proj.bias"].shape, generator=g)
    for name, p in model.named_parameters():
        p.copy_(w[name])
    probe = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    hidden = model.model(input_ids=probe).last_hidden_state[0, -1]  # after the final norm
    row = w["model.embed_tokens.weight"][forced]
    row.copy_(hidden * (40.0 / hidden.dot(hidden)))
    return w


def next_token_probs(model, weights: dict[str, torch.Tensor], seqs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
        return torch.softmax(model(input_ids=seqs).logits.float(), dim=-1)


class Engine:
    """One vLLM engine process (fork_context: a fork of a server that imported vLLM) and its command queues."""

    def __init__(self, model_dir: Path, port: int, layout: list, member_id: str, late: bool = False) -> None:
        ctx = fork_context()
        self.cmds, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_engine, args=(str(model_dir), port, layout, member_id, late, self.cmds,
                                                      self.out), daemon=True)
        self.proc.start()

    def ask(self, cmd: str, arg=None) -> None:
        self.cmds.put((cmd, arg))

    def expect(self, kind: str, timeout_s: float = TIMEOUT_S):
        return expect(self.out, kind, timeout_s)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.ask("quit")
        stop_process(self.proc, grace_s=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model, its forcing variant, a sender and engine gen0 (shared by both tests; either runs alone)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("modes") / "model", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    forced = forcing_weights(model, FORCED)
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(0, model.config.vocab_size, (4, 20), generator=g)
    seqs[:, ::3] = FORCED  # contexts that contain X itself, too
    assert next_token_probs(model, forced, seqs)[..., FORCED].min() > 0.999  # the construction works
    assert next_token_probs(model, base, seqs)[..., FORCED].max() < 0.5

    specs = [TensorSpec(n, tuple(t.shape), dtype_name(t)) for n, t in base.items()]
    layout = layout_to_wire(plan_buckets(specs, 256 << 10))
    sender = Sender(layout_from_wire(layout), HOST, free_port(), timeout_s=TIMEOUT_S)
    engines = {"gen0": Engine(model_dir, sender.port, layout, "gen0")}
    try:
        sender.form(["gen0"], timeout_s=ENGINE_START_S)
        assert engines["gen0"].expect("joined", ENGINE_START_S) == 0
        prompts = torch.randint(0, model.config.vocab_size, (4, 6), generator=g).tolist()
        yield {"sender": sender, "engines": engines, "base": base, "forced": forced, "prompts": prompts,
               "model_dir": model_dir, "layout": layout}
    finally:
        sender.close()
        for e in engines.values():
            e.stop()


def test_in_flight_swaps_between_steps_and_drain_never_mixes_versions(stack) -> None:
    sender, gen0, prompts = stack["sender"], stack["engines"]["gen0"], stack["prompts"]

    # in_flight: v1 (forcing) arrives while wave 1 is mid-generation
    gen0.ask("in_flight", prompts)
    sender.push(stack["forced"], 1)
    run = gen0.expect("trajectories")
    assert run["version"] == 1 and run["pause_s"] > 0
    print(f"in_flight: engine paused {run['pause_s'] * 1e3:.1f} ms for the swap, stepped {run['staging_steps']} "
          "times while v1 was on the wire")
    for rid, t in run["traj"].items():
        versions, tokens, logps = t["versions"], t["tokens"], t["logprobs"]
        assert len(tokens) == MAX_TOKENS and len(versions) == len(tokens) == len(logps), rid
        assert versions == sorted(versions), f"{rid}: versions decrease: {versions}"
        if t["wave"] == 2:
            assert set(versions) == {1}, f"{rid} was admitted after the swap but carries {versions}"
            cut = 0
        else:
            cut = run["swapped_at"][rid]
            assert 0 < cut < MAX_TOKENS, f"{rid}: the swap was not mid-generation ({cut} tokens before)"
            assert versions == [0] * cut + [1] * (MAX_TOKENS - cut), f"{rid}: {versions}, swap after {cut}"
            assert tokens[:cut].count(FORCED) < cut / 2, f"{rid}: v0 tokens already look forced: {tokens}"
        assert tokens[cut:] == [FORCED] * (MAX_TOKENS - cut), f"{rid}: tokens after the swap {tokens[cut:]}"
        assert min(logps[cut:]) > -0.01, f"{rid}: post-swap log-probs {logps[cut:]}"

    # drain: v2 (the base weights again) waits until wave 1 has finished
    gen0.ask("drain", prompts)
    sender.push(stack["base"], 2)
    run = gen0.expect("trajectories")
    assert run["version"] == 2
    for rid, t in run["traj"].items():
        assert len(set(t["versions"])) == 1, f"{rid} mixes versions in drain mode: {t['versions']}"
        assert t["versions"][0] == (1 if t["wave"] == 1 else 2), rid
        assert len(t["tokens"]) == MAX_TOKENS, rid
        if t["wave"] == 1:
            assert run["swapped_at"][rid] == MAX_TOKENS, f"{rid} swapped before it finished"
            assert t["tokens"] == [FORCED] * MAX_TOKENS, rid
    wave2 = [tok for t in run["traj"].values() if t["wave"] == 2 for tok in t["tokens"]]
    assert wave2.count(FORCED) < len(wave2) / 2, "wave 2 still looks generated by the forcing weights"


def test_late_joiner_serves_the_current_version_first_and_a_killed_engine_is_dropped(stack) -> None:
    sender, gen0, prompts = stack["sender"], stack["engines"]["gen0"], stack["prompts"]
    v = (sender.version or 0) + 1  # whether or not the update-mode test ran first: gen0 serves the base weights

    # gen1 starts late: it asks to join and blocks in receive before serving anything
    gen1 = stack["engines"]["gen1"] = Engine(stack["model_dir"], sender.port, stack["layout"], "gen1", late=True)
    deadline = time.monotonic() + ENGINE_START_S
    while not poll_joiners(sender):
        assert gen1.proc.is_alive() and time.monotonic() < deadline, "gen1 never asked to join"
        time.sleep(0.1)
    gen0.ask("receive")
    metrics = sender.push(stack["forced"], v)  # the version boundary that admits gen1
    assert sender.members == ["gen0", "gen1"] and metrics["sync/members"] == 2 and metrics["sync/rebuild_s"] > 0
    assert gen1.expect("joined") == v and gen0.expect("received")["version"] == v
    gen1.ask("serve", prompts)
    first = gen1.expect("trajectories")
    assert all(t["tokens"] == [FORCED] * MAX_TOKENS for t in first["traj"].values()), f"gen1 served before v{v}"

    # gen0 is killed with its receives for v+1 posted (its fetch thread never stops), so v+1 goes out to a dead
    # member that never acknowledges: named, dropped, gen1 carries on
    gen1.ask("receive")
    sender.timeout_s = 10.0
    failure: list[BaseException] = []
    pushing = threading.Thread(target=lambda: _push_expecting_failure(sender, stack["base"], v + 1, failure))
    t0 = time.monotonic()
    os.kill(gen0.proc.pid, signal.SIGKILL)
    gen0.proc.join(timeout=10)
    pushing.start()
    pushing.join(timeout=30)
    assert not pushing.is_alive(), "the push hung on a killed receiver"
    assert time.monotonic() - t0 < sender.timeout_s + 5
    assert len(failure) == 1 and isinstance(failure[0], PushError), failure
    err = failure[0]
    assert err.failed_members == ["gen0"] and "gen0" in str(err) and f"version {v + 1}" in str(err), str(err)
    assert "gen1" not in err.failed_members  # it saw the abort and said so: a victim, not to blame
    sender.drop(err.failed_members)
    metrics = sender.push(stack["base"], v + 1)  # the receive asked above gets it, in the rebuilt group
    assert sender.members == ["gen1"] and metrics["sync/epoch"] == 2
    assert gen1.expect("received")["version"] == v + 1
    gen1.ask("serve", prompts)
    tokens = [tok for t in gen1.expect("trajectories")["traj"].values() for tok in t["tokens"]]
    assert tokens.count(FORCED) < len(tokens) / 2, f"gen1 still serves v{v} after v{v + 1} went live"


def _push_expecting_failure(sender: Sender, weights: dict, version: int, failure: list) -> None:
    try:
        sender.push(weights, version)
    except BaseException as exc:  # reported to the test thread
        failure.append(exc)
