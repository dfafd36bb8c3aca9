"""Environments and streaming rewards on the real stack (Ray, vLLM generators, a DeepSpeed learner, the
ZeroMQ buffer, the gloo push, a real redis-server, a real HTTP scorer, reward-model Ray actors).

Two short runs share one Ray session:
* guess_number (multi-turn, hints spliced as observation tokens, a reward per turn) plus a reward model
  (weighted), so rewards arrive late through the buffer;
* prompts from a Redis stream (most of them pushed while training runs) scored by an HTTP scorer that
  answers after random delays and sometimes never.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from async_rlhf.config import load_config

pytestmark = pytest.mark.integration

STEPS = 4
BATCH = 4
COMMON = [f"train.steps={STEPS}", f"train.batch_size={BATCH}", "train.group_size=4", "generators=1", "learners=1",
          "generator.eval_every=0", "generator.groups_in_flight=4", "generator.kv_cache_gib=1"]



def run_cluster(cfg: Any, model_dir: Path, run_dir: Path, during: Any = None, settle_s: float = 0.0) -> dict:
    import ray

    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train

    cluster = Cluster(cfg, str(model_dir))
    try:
        helper = threading.Thread(target=during, args=(cluster,), daemon=True) if during else None
        if helper:
            helper.start()
        figures = train(cfg, cluster, run_dir)
        time.sleep(settle_s)  # let the buffer expire what still waits for a reward
        return {"figures": figures, "ledgers": ray.get([g.ledger.remote() for g in cluster.generators]),
                "buffer": ray.get(cluster.buffer.stats.remote(True))}
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def guess_run(ray_address: str, tiny_model_dir: Path, reward_model_dir: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("guess")
    cfg = load_config(None, [*COMMON, "task.name=guess_number", "task.max_turns=3", "train.max_staleness=2",
                             "rewards.sources=task:1,model:0.1", f"rewards.model_path={reward_model_dir}",
                             f"model.path={tiny_model_dir}", f"run.dir={run_dir}"])
    return run_cluster(cfg, tiny_model_dir, run_dir)


def test_multi_turn_task_trains_with_per_turn_rewards_and_masked_observations(guess_run: dict) -> None:
    records = guess_run["figures"]["records"]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        # hints were in the trained sequences (context) but out of the loss: tokens counts generated ones only
        assert r["rollout/observation_tokens"] > 0
        assert r["rollout/tokens"] > 0
        # a return is a sum of per-turn rewards (-0.1 per wrong turn, +1 for the right one) + 0.1 * model score
        assert -0.3 - 0.5 < r["rollout/reward_mean"] < 1.0 + 0.5
    stats = guess_run["figures"]["generator_stats"][0]
    assert stats["rewards_late"] >= STEPS * BATCH  # the reward model answered through the buffer
    assert stats["reward_errors"] == 0 and stats["env_errors"] == 0
    trained = guess_run["buffer"]["ledger"]["trained"]
    assert len(trained) == STEPS * BATCH


@pytest.fixture(scope="module")
def streamed_run(ray_address: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from async_rlhf.buffer.testing import RedisServer
    from async_rlhf.env.arithmetic import AdditionEnv, AdditionTask
    from async_rlhf.prompts.redis_stream import push_prompts
    from async_rlhf.rewards.scorer_server import ScorerServer

    run_dir = tmp_path_factory.mktemp("streamed")
    redis_server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    scorer = ScorerServer(delay_s=0.2, jitter_s=1.5, drop=0.25, seed=3)
    prompts = AdditionEnv(AdditionTask()).train_prompts(5)
    stream = "test:prompts"
    first = 6  # fewer than the STEPS * BATCH groups training needs: the rest must come mid-run
    push_prompts(redis_server.url, stream, [next(prompts) for _ in range(first)])
    pushed_mid_run: list[float] = []

    def feed(cluster: Any) -> None:
        import ray

        while ray.get(cluster.generators[0].stats.remote())["groups"] < first:
            time.sleep(0.2)
        time.sleep(1.0)  # the stream ran dry; the generator waits for prompts, it does not fail
        pushed_mid_run.append(time.time())
        push_prompts(redis_server.url, stream, [next(prompts) for _ in range(40)])

    cfg = load_config(None, [*COMMON, "task.name=custom", "prompts.source=redis",
                             f"prompts.redis_url={redis_server.url}", f"prompts.stream={stream}",
                             "rewards.sources=http", f"rewards.http_url={scorer.url}",
                             "rewards.timeout_s=2.5", "buffer.reward_deadline_s=1.5", "train.max_staleness=8",
                             # the scorer is unreliable on purpose; under a loaded machine it can miss more than
                             # rewards.max_consecutive_failures deadlines in a row, which would stop the run
                             "rewards.max_consecutive_failures=0",
                             # every prompt counts here (46 for 16 trained groups, some lost to the silent
                             # scorer): uniform groups are trained, not dropped and replaced by new prompts
                             "train.drop_zero_advantage=off",
                             f"model.path={tiny_model_dir}", f"run.dir={run_dir}"])
    try:
        out = run_cluster(cfg, tiny_model_dir, run_dir, during=feed, settle_s=6.0)
    finally:
        scorer.close()
        redis_server.stop()
    return {**out, "first": first, "pushed_mid_run": pushed_mid_run, "scorer_dropped": scorer.dropped,
            "scorer_requests": scorer.requests}


def test_prompts_pushed_mid_run_get_trained(streamed_run: dict) -> None:
    assert streamed_run["pushed_mid_run"], "the feeder never saw the first prompts consumed"
    trained = streamed_run["buffer"]["ledger"]["trained"]
    assert len(trained) == STEPS * BATCH > streamed_run["first"]  # needs prompts that arrived mid-run
    assert streamed_run["figures"]["records"][-1]["time"] > streamed_run["pushed_mid_run"][0]


def test_slow_and_silent_scorer_every_group_trained_or_dropped_with_a_reason(streamed_run: dict) -> None:
    stats = streamed_run["figures"]["generator_stats"][0]
    assert streamed_run["scorer_dropped"] > 0 and stats["reward_timeouts"] > 0 and stats["rewards_late"] > 0
    ledger = streamed_run["buffer"]["ledger"]
    produced = set(streamed_run["ledgers"][0]["produced"])
    dropped = {**ledger["dropped"], **streamed_run["ledgers"][0]["dropped"]}
    assert ledger["awaiting_reward"] == [] and ledger["held"] == [] and ledger["delivered"] == []
    assert set(ledger["trained"]) | set(dropped) == produced
    assert not set(ledger["trained"]) & set(dropped)
    assert all(dropped.values()) and "reward_timeout" in set(dropped.values())
    # the generator went on generating while rewards were outstanding: several groups awaited theirs at once
    assert max(r.get("buffer/awaiting_reward", 0) for r in streamed_run["figures"]["records"]) >= 2
