"""Micro-batches through a real one-rank DeepSpeed engine (ZeRO-0 and ZeRO-2, fp32): the accumulated gradient of
a token-budgeted, packed step equals the gradient of the same rows in one padded forward, read with DeepSpeed's
``safe_get_full_grad`` before the step; and one ``engine.step()`` after the micro-batches is one optimizer step."""

from __future__ import annotations

import os

import pytest
import torch

from async_rlhf.config import ObjectiveConfig
from async_rlhf.learner.microbatch import (
    ForwardOptions,
    PolicyStep,
    accumulate_policy_grads,
    engine_backward,
    logprobs_no_grad,
    plan_micro_batches,
)
from async_rlhf.learner.objectives import LossNorm

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("module_process_group")]


def _engine(model_dir, zero_stage: int):
    from transformers import AutoModelForCausalLM

    from async_rlhf.learner.engine import build_engine

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.config.use_cache = False
    return build_engine(model, lr=1e-3, micro_batch=1, zero_stage=zero_stage)


def _step_grads(engine, batch, opts: ForwardOptions):
    from deepspeed.utils import safe_get_full_grad

    n = batch.input_ids.shape[0]
    plan = plan_micro_batches(batch.attention_mask.sum(1).tolist(), opts.max_tokens, opts.pack)
    prox = logprobs_no_grad(engine, batch, torch.arange(n), ForwardOptions()) - 0.05
    adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
    obj = ObjectiveConfig(kind="decoupled_ppo", aggregation="seq_mean_token_sum_norm")
    m = accumulate_policy_grads(engine, batch, plan, PolicyStep(adv, prox, 0, 0), obj,
                                LossNorm.of(batch.loss_mask, max_tokens=12), opts, engine_backward(engine))
    grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    engine.step()
    return grads, m, len(plan)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_micro_batches_accumulate_the_one_batch_gradient(tiny_model_dir, ragged_batch, zero_stage):
    torch.set_num_threads(1)
    whole = _engine(tiny_model_dir, zero_stage)
    batch = ragged_batch(whole.module.config.vocab_size)
    want, m0, n0 = _step_grads(whole, batch, ForwardOptions())
    parts = _engine(tiny_model_dir, zero_stage)
    got, m, n = _step_grads(parts, batch, ForwardOptions(pack=True, max_tokens=20, chunk_tokens=8))
    assert n0 == 1 and n > 2
    assert max(g.abs().max().item() for g in want.values()) > 1e-4
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)
    assert m["optim/loss"] == pytest.approx(m0["optim/loss"], rel=1e-5)
    assert whole.global_steps == parts.global_steps == 1  # one optimizer step each, whatever the micro-batches
    # and the same first AdamW update (~ lr * sign(g)) where the gradient is well above the rounding noise
    for (name, a), b in zip(whole.module.named_parameters(), parts.module.parameters()):
        clear = want[name].abs() > 1e-5
        torch.testing.assert_close(b.detach()[clear], a.detach()[clear], rtol=0, atol=1e-6, msg=name)


SPAWN_S = 240.0  # spawning, importing torch and building DeepSpeed engines under load


def _learner_rank(rank: int, world: int, model_dir: str, port: int, overrides: list[str], batch, out) -> None:
    """One LearnerActor rank (no Ray, no buffer): one ``_update`` of ``batch``; reports its full gradient."""
    try:
        from deepspeed.utils import safe_get_full_grad

        from async_rlhf.config import load_config
        from async_rlhf.learner.actor import LearnerActor

        cfg = load_config(None, [f"model.path={model_dir}", f"learners={world}", "train.batch_size=2",
                                 "learner.zero_stage=2", "train.lr=1e-3", *overrides])
        actor = LearnerActor(rank, world, cfg, model_dir, "127.0.0.1", port, "")
        grads: dict[str, object] = {}  # numpy: torch tensors would go through shared memory the child takes along
        step = actor._optimizer_step

        def read_then_step() -> None:
            for name, p in actor.engine.module.named_parameters():  # collective under ZeRO-2: every rank
                grads[name] = safe_get_full_grad(p).numpy().copy()
            step()

        actor._optimizer_step = read_then_step
        metrics = actor._update(batch)
        out.put((rank, {"grads": grads, "metrics": metrics}))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, {"error": repr(exc)}))


def _rows(batch, rows: list[int]):
    from dataclasses import replace

    idx = torch.tensor(rows)
    return replace(batch, input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx],
                   loss_mask=batch.loss_mask[idx], behav_logp=batch.behav_logp[idx], versions=batch.versions[idx],
                   rewards=batch.rewards[idx], advantages=batch.advantages[idx], group_ids=[])


def _run_ranks(model_dir: str, overrides: list[str], batches: list) -> list[dict]:
    import multiprocessing as mp
    import queue

    from async_rlhf.endpoints import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                          "MASTER_PORT") if k in os.environ}
    procs = [ctx.Process(target=_learner_rank, args=(r, len(batches), model_dir, port, overrides, b, out), daemon=True)
             for r, b in enumerate(batches)]
    try:
        for p in procs:
            p.start()
        results: dict[int, dict] = {}
        while len(results) < len(procs):
            try:
                rank, res = out.get(timeout=SPAWN_S)
            except queue.Empty:
                pytest.fail(f"learner ranks {sorted(set(range(len(procs))) - set(results))} did not report")
            assert "error" not in res, f"rank {rank}: {res['error']}"
            res["grads"] = {name: torch.from_numpy(g) for name, g in res["grads"].items()}
            results[rank] = res
        return [results[r] for r in range(len(procs))]
    finally:
        os.environ.update(env)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_two_learner_ranks_micro_batched_and_packed_give_the_one_rank_gradient(tiny_model_dir, ragged_batch):
    """LearnerActor._update on two ZeRO-2 ranks, each with its own rows (unequal token counts and micro-batch
    counts), packed under a token budget, against one rank with all rows in one padded forward."""
    batch = ragged_batch(51)
    lengths = batch.attention_mask.sum(1).tolist()
    assert len(lengths) == 9
    model_dir = str(tiny_model_dir)
    (one,) = _run_ranks(model_dir, ["learner.zero_stage=2"], [batch])
    halves = [_rows(batch, [0, 2, 7]), _rows(batch, [1, 3, 4, 5, 6, 8])]  # 11 against 49 trained tokens
    two = _run_ranks(model_dir, ["learner.pack=true", "learner.max_tokens_per_micro_batch=20",
                                 "learner.logprob_chunk_tokens=8"], halves)
    assert two[0]["metrics"]["perf/micro_batches"] < two[1]["metrics"]["perf/micro_batches"]
    want = one["grads"]
    assert max(g.abs().max().item() for g in want.values()) > 1e-4
    for name in want:
        torch.testing.assert_close(two[0]["grads"][name], want[name], rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(two[1]["grads"][name], want[name], rtol=1e-4, atol=1e-7, msg=name)
