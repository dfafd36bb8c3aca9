"""Real LearnerActor ranks in spawned processes (DeepSpeed over gloo; no Ray, no buffer) for the distributed tier:
each rank runs one ``_update`` of its own input and reports every optimizer step's full gradient, what its
no-grad policy forwards returned, the advantages it trained on, and the metrics.

A rank reports when it is built; from then on the update gets ``update_s`` to finish, so ranks out of step
(waiting on each other's collectives) fail the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

BUILD_S = 300.0  # spawning, importing torch and building DeepSpeed engines on 2 shared cores
UPDATE_S = 120.0  # one update of the tiny model takes seconds; out of step, it never ends


def _rank_main(rank: int, world: int, model_dir: str, port: int, overrides: list[str], given: dict[str, Any],
               out: Any) -> None:
    """One rank: ``given`` holds ``batch`` (collated) or ``groups`` (collated by the actor, as its train loop
    does), and ``sizes`` (the group sizes)."""
    try:
        from deepspeed.utils import safe_get_full_grad

        import async_rlhf.learner.microbatch as microbatch
        from async_rlhf.config import load_config
        from async_rlhf.learner.actor import LearnerActor
        from async_rlhf.learner.ranks import max_over_ranks

        torch.set_num_threads(1)
        cfg = load_config(None, [f"model.path={model_dir}", f"learners={world}", "train.batch_size=2",
                                 "train.lr=1e-3", *overrides])
        actor = LearnerActor(rank, world, cfg, model_dir, "127.0.0.1", port, "")
        report: dict[str, Any] = {"grads": [], "prox": [], "advantages": None}
        step = actor._optimizer_step
        no_grad = microbatch.logprobs_no_grad

        def read_then_step() -> None:  # numpy: torch tensors would go through shared memory the child takes along
            report["grads"].append({name: safe_get_full_grad(p).numpy().copy()  # collective: every rank, in order
                                    for name, p in actor.engine.module.named_parameters()})
            step()

        def recording(model, *args, **kwargs):
            logp = no_grad(model, *args, **kwargs)
            if model is actor.engine:
                report["prox"].append(logp.numpy().copy())
            return logp

        actor._optimizer_step = read_then_step
        microbatch.logprobs_no_grad = recording  # the actor imports it at each _update
        if actor.ppo is not None:
            prepare = actor.ppo.prepare

            def prepared(*args, **kwargs):
                targets = prepare(*args, **kwargs)
                report["advantages"] = targets.advantages.numpy().copy()
                return targets

            actor.ppo.prepare = prepared
        out.put((rank, "built"))
        batch = given["batch"] if "batch" in given else actor.collate(given["groups"])
        if report["advantages"] is None:
            report["advantages"] = batch.advantages.numpy().copy()
        report["metrics"] = actor._update(batch, given["sizes"])
        if world > 1:
            max_over_ranks(0)  # one more collective: a rank that is out of step cannot pass it
        out.put((rank, report))
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails with it
        out.put((rank, {"error": repr(exc)}))


def run_learner_ranks(model_dir: str, overrides: list[str], inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One process per entry of ``inputs`` (its rank), all in one DeepSpeed group; their reports by rank."""
    from async_rlhf.endpoints import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                          "MASTER_PORT") if k in os.environ}
    world = len(inputs)
    procs = [ctx.Process(target=_rank_main, args=(r, world, model_dir, port, overrides, given, out), daemon=True)
             for r, given in enumerate(inputs)]
    try:
        for p in procs:
            p.start()
        built: set[int] = set()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + BUILD_S
        while len(results) < world:
            try:
                rank, res = out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world)) - set(results))
                stage = "finish the update (out of step: a hang)" if len(built) == world else "build their engines"
                pytest.fail(f"learner ranks {missing} did not {stage} in time")
            if res == "built":
                built.add(rank)
                if len(built) == world:
                    deadline = time.monotonic() + UPDATE_S
                continue
            assert "error" not in res, f"rank {rank}: {res['error']}"
            results[rank] = res
        return [results[r] for r in range(world)]
    finally:
        os.environ.update(env)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def rows_of(batch: Any, rows: list[int]) -> Any:
    """The collated batch restricted to ``rows``, in that order."""
    idx = torch.tensor(rows)
    return replace(batch, input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx],
                   loss_mask=batch.loss_mask[idx], behav_logp=batch.behav_logp[idx], versions=batch.versions[idx],
                   rewards=batch.rewards[idx], advantages=batch.advantages[idx], group_ids=[])
