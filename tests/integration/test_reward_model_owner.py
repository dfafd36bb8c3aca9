"""The reward model's Ray actors outlive the generators that score on them (issue 44, defect 2).

Ray ends a non-detached actor when the process that created it ends. The actors used to be created by the first
generator to ask (``get_if_exists`` from its ``run()``): killing that generator ended them, and every other
generator's rewards failed until the run stopped. Now the driver creates them (``Cluster`` at start-up,
``start_reward_models``) and the generators look them up by name (``make_rewards``, the path ``GeneratorActor.run``
takes). Here two stand-in generators (Ray actors of their own running ``make_rewards``; no vLLM) score on the
actors of the shared Ray, the first is SIGKILLed, and the second's next rewards still come back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from async_rlhf.config import load_config

pytestmark = pytest.mark.integration


def stand_in_generator() -> type:
    """The class of a stand-in generator, defined here so that Ray ships it by value (the test module is not
    importable in a worker)."""

    class StandInGenerator:
        """What a generator does with rewards: ``make_rewards`` once as its loop starts, then score its groups."""

        def __init__(self, cfg: Any) -> None:
            self.cfg = cfg
            self.rewards: Any = None

        def pid(self) -> int:
            return os.getpid()

        def start(self) -> str:
            from async_rlhf.env.registry import make_env
            from async_rlhf.rewards.build import make_rewards

            try:
                self.rewards = make_rewards(self.cfg, make_env(self.cfg.task))
            except Exception as exc:  # noqa: BLE001 - the test reads the error
                return f"{type(exc).__name__}: {exc}"
            return "ok"

        def score(self, completions: list[str]) -> list[float]:
            from async_rlhf.env.base import Prompt

            return asyncio.run(self.rewards.score(Prompt(text="12+30="), completions))

    return StandInGenerator



def test_rewards_come_back_after_the_first_generator_to_score_is_killed(ray_address: str, reward_model_dir: Path,
                                                                        tmp_path: Path) -> None:
    import ray

    from async_rlhf.rewards.model import actor_names, start_reward_models

    cfg = load_config(None, ["task.name=reward_model", "rewards.sources=model", "rewards.model_actors=2",
                             f"rewards.model_path={reward_model_dir}", f"run.dir={tmp_path / 'run'}"])
    owned = start_reward_models(cfg)  # as Cluster does, in the driver, before any generator starts
    assert owned is not None
    gen_cls = ray.remote(stand_in_generator()).options(num_cpus=0)
    first, second = gen_cls.remote(cfg), gen_cls.remote(cfg)
    try:
        assert ray.get(first.start.remote(), timeout=120) == "ok"  # the first to ask: it created them, before
        assert ray.get(second.start.remote(), timeout=120) == "ok"
        completions = ["42", "41", "x"]
        before = ray.get(second.score.remote(completions), timeout=120)
        assert len(before) == 3 and all(isinstance(v, float) for v in before)
        assert ray.get(first.score.remote(completions), timeout=120) == before  # both actors, round robin
        os.kill(ray.get(first.pid.remote()), signal.SIGKILL)  # the generator crashes (or is scaled down)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(first.pid.remote(), timeout=60)
        time.sleep(2.0)  # long enough for Ray to end what the dead process owned
        for _ in range(2):  # the second generator's next groups, on each of the two actors
            assert ray.get(second.score.remote(completions), timeout=60) == pytest.approx(before)
        names = actor_names(cfg)
        assert all(ray.get_actor(name) for name in names), "the actors stay up, found by name"
        # a generator restarted now finds them too
        third = gen_cls.remote(cfg)
        assert ray.get(third.start.remote(), timeout=120) == "ok"
        assert ray.get(third.score.remote(completions), timeout=60) == pytest.approx(before)
        ray.kill(third)
    finally:
        ray.kill(second)
        owned.close()
    for name in actor_names(cfg):  # Cluster.close ends them, and frees their names for a next run
        with pytest.raises(ValueError):
            ray.get_actor(name)
    # a role never creates them: one that asks after the driver ended them is told so, instead of owning new ones
    late = gen_cls.remote(cfg)
    try:
        answer = ray.get(late.start.remote(), timeout=120)
    finally:
        ray.kill(late)
    assert answer.startswith("RewardModelsMissing") and "the driver starts them" in answer
