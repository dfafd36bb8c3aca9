"""PPO through the real launcher (Ray, vLLM generator, DeepSpeed learner and critic, ZeroMQ buffer): a short
run ends with its final checkpoint, then ``--resume`` trains two more steps. The checkpoint holds the critic and
the reward moments, and the resumed learner's first step reads its values from the trained critic: before
checkpoints held it, the resumed critic restarted from a zero value head (every value of that step exactly 0)
and the score normalisation from nothing. The KL anchor (``train.ppo.kl_coef``) stays the model the run started
from: until issue 44 every resume loaded its reference from the checkpoint's policy, and the KL to it dropped to
about zero without a word."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from jobs import LAUNCH, learner_records

from async_rlhf.driver.checkpoints import list_checkpoints, read_manifest

pytestmark = pytest.mark.integration

STEPS, MORE = 4, 2
SAMPLES_PER_STEP = 4 * 4  # train.batch_size x train.group_size

REWARD = '''
def reward(prompt, completion, data):
    """Longer completions score more: rewards that differ within a group from the first step, even for a
    policy with random weights (the task's exact answers would all score 0)."""
    return len(completion) / 6.0
'''


def reference_digest(model_dir: Path) -> str:
    """The digest ``summary.json`` gives of the reference weights, of the model as loaded from its directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_rlhf.learner.weights_digest import weights_sha256

    return weights_sha256(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def _launch(args: list[str], cwd: Path, ray_address: str) -> subprocess.CompletedProcess:
    """The launcher on the session's shared Ray (it joins through RAY_ADDRESS, as under ``ray job submit``): this
    test stops and kills nothing, and its two launches need no Ray of their own."""
    done = subprocess.run([*LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_ADDRESS": ray_address})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


def test_ppo_resume_restores_the_critic_and_the_reward_moments(tiny_model_dir: Path, tmp_path: Path,
                                                               ray_address: str) -> None:
    (tmp_path / "length_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    _launch(["--generators", "1", "--learners", "1", "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
             f"train.steps={STEPS}", "train.batch_size=4", "train.group_size=4", "train.max_staleness=1",
             "generator.eval_every=0", "generator.groups_in_flight=4", "task.heldout_size=20",
             "rewards.sources=function", f"rewards.function={tmp_path / 'length_reward.py'}:reward",
             "train.algorithm=ppo", "train.ppo.generator_reward_weight=1", "train.ppo.critic_lr=1e-2",
             "train.objective.kl_coef=0.05"], tmp_path,
            ray_address)
    ckpt = list_checkpoints(run_dir)[-1]
    assert read_manifest(ckpt)["step"] == STEPS
    moments = json.loads((ckpt / "critic" / "moments-rank0.json").read_text())
    assert moments["count"] == STEPS * SAMPLES_PER_STEP and moments["m2"] > 0
    first = learner_records(run_dir)
    assert first[0]["ppo/old_values_mean"] == 0.0  # a new critic: zero value head
    assert first[-1]["ppo/old_values_mean"] != 0.0  # trained by the end

    original = reference_digest(tiny_model_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reference_sha256"] == original and summary["resumed_from"] is None
    # the KL term of the loss (k3, never negative) at the last step: the policy has left its reference
    kl_before = first[-1]["ppo/kl_ref"]
    assert first[0]["ppo/kl_ref"] < 1e-6 < kl_before, f"the KL to the reference did not grow ({kl_before})"

    second = _launch(["--resume", str(run_dir), f"train.steps={STEPS + MORE}"], tmp_path, ray_address)
    assert f"resumed from {ckpt}" in second.stdout
    assert "holds no PPO critic" not in second.stdout
    resumed = [r for r in learner_records(run_dir) if r["step"] > STEPS]
    assert [r["step"] for r in resumed] == list(range(STEPS + 1, STEPS + MORE + 1))
    assert resumed[0]["ppo/old_values_mean"] != 0.0, "the resumed critic started again from a zero value head"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reference_sha256"] == original, "the resumed learner anchored its KL to another model"
    assert summary["resumed_from"] == str(ckpt)
    # continuous across the resume: the same anchor (a reference reloaded from the checkpoint's policy gave a KL of
    # ~0 at the first resumed step, the policy being that checkpoint itself, as at the run's first step)
    kl_after = resumed[0]["ppo/kl_ref"]
    assert kl_after > 0.25 * kl_before, f"kl to the reference fell from {kl_before} to {kl_after} at the resume"
    after = json.loads((list_checkpoints(run_dir)[-1] / "critic" / "moments-rank0.json").read_text())
    assert after["count"] == (STEPS + MORE) * SAMPLES_PER_STEP  # the moments went on from the saved ones
