"""Real LearnerActor ranks in spawned processes (DeepSpeed over gloo; no Ray, no buffer) for the distributed tier:
each scenario builds a LearnerActor per rank, runs one ``_update`` of the rank's own input and reports every
optimizer step's full gradient (and PPO's critic's), what its no-grad policy forwards returned, the advantages it
trained on, and the metrics.

The rank processes are kept for a module's scenarios (``LearnerRanks``, one set of processes per world size):
spawning a rank and importing torch, DeepSpeed and transformers cost seconds, building its LearnerActor a
fraction of one (0.1-0.4 s after the first). So every scenario still builds its own actor (model loaded from
disk, fresh DeepSpeed engine and optimizer, ``torch.manual_seed`` in the constructor, the recording hooks put
back afterwards): what a scenario reports does not depend on which scenarios ran before it in the same
processes. They share only the default process group, whose ranks and size are the world's. A scenario that
fails or times out discards its world (its processes are killed); the next scenario spawns a new one.

A rank reports when it is built; from then on the update gets ``UPDATE_S`` to finish, so ranks out of step
(waiting on each other's collectives) fail the test instead of hanging it.
"""

from __future__ import annotations

import gc
import os
import queue
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

BUILD_S = 300.0  # spawning, importing torch and building DeepSpeed engines on 2 shared cores
UPDATE_S = 120.0  # one update of the tiny model takes seconds; out of step, it never ends


def _scenario(rank: int, world: int, port: int, model_dir: str, overrides: list[str], given: dict[str, Any],
              out: Any) -> dict[str, Any]:
    """One rank's part of a scenario: ``given`` holds ``batch`` (collated) or ``groups`` (collated by the actor,
    as its train loop does), and ``sizes`` (the group sizes; absent: ``_update`` without them)."""
    from deepspeed.utils import safe_get_full_grad

    import async_rlhf.learner.microbatch as microbatch
    from async_rlhf.config import load_config
    from async_rlhf.learner.actor import LearnerActor
    from async_rlhf.learner.ranks import max_over_ranks

    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={model_dir}", f"learners={world}", "train.batch_size=2",
                             "train.lr=1e-3", *overrides])
    actor = LearnerActor(rank, world, cfg, model_dir, "127.0.0.1", port, "")
    report: dict[str, Any] = {"grads": [], "prox": [], "advantages": None, "critic_grads": []}
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
    try:
        if actor.ppo is not None:
            prepare = actor.ppo.prepare
            critic = actor.ppo.critic.engine
            critic_step = critic.step

            def read_critic_then_step() -> None:  # the critic's full gradient too (collective, as the policy's)
                report["critic_grads"].append({name: safe_get_full_grad(p).numpy().copy()
                                               for name, p in critic.module.named_parameters()})
                critic_step()

            critic.step = read_critic_then_step

            def prepared(*args, **kwargs):
                targets = prepare(*args, **kwargs)
                report["advantages"] = targets.advantages.numpy().copy()
                return targets

            actor.ppo.prepare = prepared
        out.put((rank, "built"))
        batch = given["batch"] if "batch" in given else actor.collate(given["groups"])
        if report["advantages"] is None:
            report["advantages"] = batch.advantages.numpy().copy()
        sizes = [given["sizes"]] if "sizes" in given else []
        report["metrics"] = actor._update(batch, *sizes)
        if world > 1:
            max_over_ranks(0)  # one more collective: a rank that is out of step cannot pass it
        return report
    finally:
        microbatch.logprobs_no_grad = no_grad  # the next scenario in this process records into its own report


def _serve(rank: int, world: int, port: int, commands: Any, out: Any) -> None:
    """A kept rank process: runs each scenario it is sent, with a fresh LearnerActor, until it is sent None."""
    while (command := commands.get()) is not None:
        try:
            out.put((rank, _scenario(rank, world, port, *command, out)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test, which fails with it
            out.put((rank, {"error": repr(exc)}))
        gc.collect()  # the scenario's engine and actor go before the next one is built
    out.close()
    out.join_thread()  # the reports are flushed; leave without the slow interpreter and torch teardown
    os._exit(0)


class _World:
    """``size`` rank processes (forks of the session's fork server) in one DeepSpeed (gloo) group, fed scenarios
    one at a time."""

    def __init__(self, size: int) -> None:
        from fork_server import fork_context

        from async_rlhf.endpoints import free_port

        # torch, DeepSpeed and transformers are imported once, by the session's fork server, not by every rank
        # (seconds each on 2 shared cores); a rank is a fresh fork of it, with nothing initialised yet
        ctx = fork_context()
        self.size, self.out = size, ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(size)]
        port = free_port()
        # the ranks inherit the fork server's environment, which holds no RANK, MASTER_PORT... of this process
        self.procs = [ctx.Process(target=_serve, args=(r, size, port, self.commands[r], self.out), daemon=True)
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def close(self, grace_s: float = 5.0) -> None:
        for c in self.commands:
            c.put(None)
        for p in self.procs:
            p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class LearnerRanks:
    """The rank processes of a module's scenarios, by world size (a module-scoped fixture holds one). The worlds
    of ``sizes`` start at once (their imports overlap); any other starts at its first scenario."""

    def __init__(self, sizes: tuple[int, ...] = ()) -> None:
        self.worlds: dict[int, _World] = {size: _World(size) for size in sizes}

    def run(self, model_dir: str, overrides: list[str], inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One scenario on a world of ``len(inputs)`` ranks (entry r is rank r's input); their reports by rank."""
        size = len(inputs)
        world = self.worlds.get(size) or self.worlds.setdefault(size, _World(size))
        ok = False
        try:
            for r, given in enumerate(inputs):
                world.commands[r].put((model_dir, overrides, given))
            reports = self._collect(world)
            ok = True
            return reports
        finally:
            if not ok:  # a rank may be stuck in a collective or gone: the next scenario gets new processes
                del self.worlds[size]
                world.close(grace_s=0.5)

    @staticmethod
    def _collect(world: _World) -> list[dict[str, Any]]:
        built: set[int] = set()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + BUILD_S
        while len(results) < world.size:
            try:
                rank, res = world.out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world.size)) - set(results))
                stage = "finish the update (out of step: a hang)" if len(built) == world.size else "build their engines"
                pytest.fail(f"learner ranks {missing} did not {stage} in time")
            if res == "built":
                built.add(rank)
                if len(built) == world.size:
                    deadline = time.monotonic() + UPDATE_S
                continue
            assert "error" not in res, f"rank {rank}: {res['error']}"
            results[rank] = res
        return [results[r] for r in range(world.size)]

    def close(self) -> None:
        for world in self.worlds.values():
            world.close()
        self.worlds.clear()


def rows_of(batch: Any, rows: list[int]) -> Any:
    """The collated batch restricted to ``rows``, in that order."""
    idx = torch.tensor(rows)
    return replace(batch, input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx],
                   loss_mask=batch.loss_mask[idx], behav_logp=batch.behav_logp[idx], versions=batch.versions[idx],
                   rewards=batch.rewards[idx], advantages=batch.advantages[idx], group_ids=[])
