"""Healing a live generator (issue 31, defect 1): the driver re-joins a generator that lags under a new member id
(``Fleet.heal`` -> ``GeneratorActor.init_weight_sync(late=True)`` -> the worker's ``init_receiver`` and
``start_fetching``) while that generator's fetch thread is still running on its old receiver. The next version
pushed must reach the engine whole: its prompt log-probs equal a transformers forward of the pushed weights.

Before the fix the old fetch thread kept receiving on the old receiver while ``apply_update`` loaded from the new
one's never-filled slots and marked the version live (the engine kept its old weights), or the new member never
joined at all. One real fp32 vLLM engine in a process of its own; the sender is this process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import joins_noticed, stop_process
from fork_server import fork_context
from test_weight_sync_vllm import ENGINE_START_S, TIMEOUT_S, _engine, layout_of, perturbed, reference_logprobs
from vllm_engine import HOST, expect, max_diff

from async_rlhf.sync.group import free_port
from async_rlhf.sync.layout import layout_from_wire
from async_rlhf.sync.sender import Sender

pytestmark = pytest.mark.integration


def _wait_for_joiner(sender: Sender, timeout_s: float) -> None:
    """Until the sender's join watcher saw the healed receiver's join request, so that the next push admits it (a
    push before that goes to nobody: the old member id is gone)."""
    deadline = time.monotonic() + timeout_s
    while not joins_noticed(sender):
        assert time.monotonic() < deadline, "the healed receiver never asked to join the push group"
        time.sleep(0.05)


def test_healing_a_live_generator_loads_the_next_version_whole(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from async_rlhf.tiny.model import build_tiny_model

    torch.set_num_threads(1)
    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(7)
    seqs = torch.randint(0, model.config.vocab_size, (4, 24), generator=g).tolist()
    layout = layout_of(base)
    sender = Sender(layout_from_wire(layout), HOST, free_port(), timeout_s=TIMEOUT_S)
    ctx = fork_context()
    cmds, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_engine, args=(str(model_dir), sender.port, layout, cmds, out), daemon=True)
    proc.start()
    try:
        sender.form(["gen0"], timeout_s=ENGINE_START_S)
        assert expect(out, "epoch", ENGINE_START_S) == [0]
        cmds.put(("fetching", None))  # a live generator: its fetch thread receives every push in the background
        expect(out, "fetching")

        def push_apply_score(version: int) -> float:
            weights = perturbed(base, version)
            sender.push(weights, version)
            cmds.put(("apply", None))
            got = expect(out, "applied", 2 * TIMEOUT_S)
            assert isinstance(got, list) and got[0]["version"] == version, f"apply of version {version}: {got}"
            cmds.put(("score", seqs))
            diff = max_diff(expect(out, "scores"), reference_logprobs(model, weights, seqs))
            assert max_diff(reference_logprobs(model, weights, seqs), reference_logprobs(model, base, seqs)) > 1e-2
            return diff

        before = push_apply_score(1)
        assert before < 1e-4, f"max |logp diff| {before:.2e} before any heal"

        # the heal, as Fleet.heal does it: the old member id is reported gone, the generator re-joins as gen0.1
        sender.fail_members(["gen0"])
        cmds.put(("heal", "gen0.1"))
        expect(out, "healed")
        _wait_for_joiner(sender, TIMEOUT_S)
        after = push_apply_score(2)
        assert after < 1e-4, f"max |logp diff| {after:.2e} after healing a live generator (the engine kept " \
                             "other weights than the version it marked live)"
        assert sender.members == ["gen0.1"]
        again = push_apply_score(3)  # and it keeps receiving on its new receiver
        assert again < 1e-4, f"max |logp diff| {again:.2e} at the second push after the heal"
        print(f"max |logp diff|: before heal {before:.3g}, first push after {after:.3g}, second {again:.3g}")
        cmds.put(("quit", None))
        expect(out, "bye")
    finally:
        sender.close()
        proc.join(timeout=30)
        stop_process(proc, grace_s=10)
