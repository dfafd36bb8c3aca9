"""PPO with a critic and online DPO on the real asynchronous stack (Ray, vLLM, DeepSpeed, ZeroMQ, the push).

A quick SFT warm start (so that prompt groups hold both right and wrong answers) and a reward model with a
fresh head on the policy's body are built once; then one short run of each algorithm shares one Ray session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from async_rlhf.config import TaskConfig, load_config

pytestmark = pytest.mark.integration

STEPS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import torch
    from transformers import AutoModelForSequenceClassification

    from async_rlhf.tiny.sft import prepare_tiny_policy
    from async_rlhf.tiny.tokenizer import load_tokenizer, save_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("algos")
    policy = prepare_tiny_policy(root / "cache", TaskConfig(sft_steps=200, heldout_size=50), seed=0)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    rm.config.pad_token_id = load_tokenizer(policy).pad_token_id
    rm.save_pretrained(root / "rm")
    save_tokenizer(load_tokenizer(policy), root / "rm")
    return {"policy": str(policy), "rm": str(root / "rm"), "root": str(root)}


def _run(algorithm: str, models: dict[str, str], extra: list[str]) -> dict[str, Any]:
    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train

    run_dir = Path(models["root"]) / algorithm
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [
        f"train.algorithm={algorithm}", f"train.steps={STEPS}", "train.max_staleness=1", "train.batch_size=4",
        "train.group_size=4", "generators=1", "learners=1", f"model.path={models['policy']}", f"run.dir={run_dir}",
        "generator.eval_every=0", "generator.groups_in_flight=4", "generator.kv_cache_gib=1", "task.heldout_size=50",
        *extra,
    ])
    cluster = Cluster(cfg, models["policy"])
    try:
        return train(cfg, cluster, run_dir)
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def runs(models: dict[str, str], ray_address: str) -> dict[str, dict[str, Any]]:
    return {
        "ppo": _run("ppo", models, [f"train.ppo.reward_models={models['rm']}:5",
                                    "train.ppo.generator_reward_weight=1", "train.ppo.reward_norm=false",
                                    "train.ppo.critic_lr=5e-3", "train.minibatches=2"]),
        # the task's reward plus the reward model served by its own Ray actor (generator side): continuous
        # rewards, so every prompt group yields a pair
        "online_dpo": _run("online_dpo", models, ["train.lr=5e-4", "train.dpo.beta=0.5",
                                                  "rewards.sources=task:1,model:1",
                                                  f"rewards.model_path={models['rm']}"]),
    }


@pytest.mark.parametrize("algorithm", ["ppo", "online_dpo"])
def test_versions_advance_and_staleness_is_bounded(runs: dict[str, dict[str, Any]], algorithm: str) -> None:
    records = runs[algorithm]["records"]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert max(r["staleness/max"] for r in records) <= 1
    # every push reached the generator (the last one may land after the loop was told to stop)
    assert all(s["version"] >= STEPS - 1 for s in runs[algorithm]["generator_stats"])


def test_ppo_critic_values_move_toward_returns(runs: dict[str, dict[str, Any]]) -> None:
    records = runs["ppo"]["records"]
    # values and returns of each batch as computed before that step's updates
    assert records[0]["ppo/old_values_mean"] == 0.0  # the value head starts at zero
    gaps = [abs(r["ppo/returns_mean"] - r["ppo/old_values_mean"]) for r in records]
    assert sum(gaps[-3:]) / 3 < 0.5 * gaps[0], gaps
    value_losses = [r["critic/value_loss"] for r in records]
    assert sum(value_losses[-3:]) / 3 < value_losses[0], value_losses
    assert "critic/value_loss" in records[-1] and "critic/clip_frac" in records[-1]
    assert all(r["ppo/score_raw_mean"] == r["ppo/score_raw_mean"] for r in records)  # no nan from the RM
    assert any(r["ppo/kl_behav_ref"] != 0.0 for r in records[1:])  # the reference is loaded and used


def test_ppo_logs_the_task_reward_beside_the_reward_model_score(runs: dict[str, dict[str, Any]]) -> None:
    """Both rewards of the same samples are in every record, and the score PPO optimised is their mix
    (generator_reward_weight=1 times the task reward plus reward_model_weight=1 times the RM's score)."""
    for r in runs["ppo"]["records"]:
        assert r["rollout/task_reward_mean"] == pytest.approx(r["rollout/reward_mean"])
        assert r["ppo/score_raw_mean"] == pytest.approx(r["rollout/task_reward_mean"] + r["rollout/rm_score_mean"],
                                                        abs=1e-4)
        assert -1.0 - 1e-6 <= r["ppo/rm_task_corr"] <= 1.0 + 1e-6
    assert any(r["ppo/rm_score_std"] > 0 for r in runs["ppo"]["records"])


def test_online_dpo_margin_grows(runs: dict[str, dict[str, Any]]) -> None:
    records = [r for r in runs["online_dpo"]["records"] if r.get("dpo/pairs", 0) > 0]
    assert len(records) >= STEPS // 2, "most batches should hold at least one pair"
    assert abs(records[0]["dpo/reward_margin"]) < 1e-3  # the policy is still the reference at step 1
    # each step widens the margin of the pairs it trained on
    gains = [r["dpo/margin_after_step"] - r["dpo/reward_margin"] for r in records]
    assert sum(gains) / len(gains) > 0.01 and sum(g > 0 for g in gains) >= 0.75 * len(gains), gains
