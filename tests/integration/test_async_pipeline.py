"""The whole stack for real: Ray, two vLLM generators, a DeepSpeed learner, the ZeroMQ buffer, the push.

One short run is shared by the assertions below (starting the stack is what costs time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import sequence_logprobs

from async_rlhf.config import load_config

pytestmark = pytest.mark.integration

STEPS = 6
MAX_STALENESS = 1


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                 ray_address: str) -> dict[str, Any]:
    import ray

    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train

    run_dir = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [
        f"train.steps={STEPS}", f"train.max_staleness={MAX_STALENESS}", "train.batch_size=4", "train.group_size=4",
        "generators=2", "learners=1", f"model.path={tiny_model_dir}", f"run.dir={run_dir}",
        "generator.eval_every=0", "generator.groups_in_flight=4",
    ])
    cluster = Cluster(cfg, str(tiny_model_dir))
    try:
        figures = train(cfg, cluster, run_dir)
        policy = cluster.save_policy(run_dir / "policy")
        gen_ledgers = ray.get([g.ledger.remote() for g in cluster.generators])
        buffer = ray.get(cluster.buffer.stats.remote(True))
        # fixed sequences, scored by the generators' engines after the last push (loops are stopped)
        sequences = [[5, 9, 17, 8, 3, 20, 11, 4, 2], [12, 3, 3, 17, 6, 7, 20, 9, 10, 3], [1, 4, 20, 4, 2]]
        vllm_logprobs = ray.get([g.score.remote(sequences) for g in cluster.generators])
        yield {"cfg": cfg, "figures": figures, "policy": policy, "gen_ledgers": gen_ledgers, "buffer": buffer,
               "sequences": sequences, "vllm_logprobs": vllm_logprobs, "run_dir": run_dir}
    finally:
        cluster.close()


def test_version_advances_once_per_step(finished_run: dict[str, Any]) -> None:
    records = finished_run["figures"]["records"]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert all(s["version"] == STEPS for s in finished_run["figures"]["generator_stats"])
    # every version reached every generator: loaded, or skipped because a newer one came first (coalesced)
    assert all(s["updates"] + s.get("sync/coalesced", 0) == STEPS for s in finished_run["figures"]["generator_stats"])


def test_pushed_weights_match_learner_in_vllm(finished_run: dict[str, Any]) -> None:
    """vLLM's log-probs after the last push equal a transformers forward of the learner's weights.

    Parameter checksums would miss the tied-lm_head trap; log-probs do not.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(finished_run["policy"], dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    wanted = sequence_logprobs(model, finished_run["sequences"])  # the learner's weights, once for every generator
    for gen_logprobs in finished_run["vllm_logprobs"]:
        for seq, got, want in zip(finished_run["sequences"], gen_logprobs, wanted):
            diff = max(abs(a - b) for a, b in zip(got, want))
            assert diff < 1e-4, f"vLLM and the learner disagree by {diff} on {seq}"


def test_the_agreement_monitor_reads_fp32_kernel_noise_on_same_version_tokens(finished_run: dict[str, Any]) -> None:
    """Every step's record has the training/inference agreement monitor (learner/agreement.py); on tokens of the
    learner's own version, the learner's log-probs equal the generators' to fp32 kernel noise."""
    records = finished_run["figures"]["records"]
    for r in records:
        assert r["rollout/logp_mismatch_mean"] < 1e-3 and r["rollout/logp_mismatch_max"] < 1e-3, r
        assert 0 <= r["rollout/same_version_tokens"] <= r["rollout/tokens"]
        assert r["rollout/sampled_logp_mean"] < 0 and r["rollout/is_ratio_mean"] > 0
    same = sum(r["rollout/same_version_tokens"] for r in records)
    assert same > 0, "no step trained on tokens of its own version"
    print(f"same-version tokens {same} of {sum(r['rollout/tokens'] for r in records)}; mismatch mean "
          f"{max(r['rollout/logp_mismatch_mean'] for r in records):.2e} (worst step), max "
          f"{max(r['rollout/logp_mismatch_max'] for r in records):.2e}")


def test_trained_samples_respect_max_staleness(finished_run: dict[str, Any]) -> None:
    records = finished_run["figures"]["records"]
    assert max(r["staleness/max"] for r in records) <= MAX_STALENESS
    hist = {int(k): v for k, v in finished_run["buffer"]["staleness/hist"].items()}
    assert sum(hist.values()) == STEPS * finished_run["cfg"].train.batch_size
    assert max(hist) <= MAX_STALENESS


def test_every_group_trained_or_dropped_exactly_once(finished_run: dict[str, Any]) -> None:
    produced = [gid for led in finished_run["gen_ledgers"] for gid in led["produced"]]
    assert len(produced) == len(set(produced)), "a group id was produced twice"
    ledger = finished_run["buffer"]["ledger"]
    trained, dropped = ledger["trained"], dict(ledger["dropped"])
    for led in finished_run["gen_ledgers"]:
        dropped.update(led["dropped"])
    assert len(trained) == STEPS * finished_run["cfg"].train.batch_size
    assert not set(trained) & set(dropped)
    assert ledger["held"] == [] and ledger["delivered"] == []
    assert set(trained) | set(dropped) == set(produced)
    assert all(reason for reason in dropped.values())
