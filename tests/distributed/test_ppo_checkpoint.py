"""A PPO learner's checkpoint holds its critic (value-head weights and optimizer state) and its running reward
moments, and a resumed learner continues with them: one LearnerActor rank (real DeepSpeed engines, gloo, no Ray
or buffer) trains one step, saves, and a fresh rank loads what it saved. Before checkpoints held the critic, the
resumed rank started again from a zero value head and empty moments."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("module_process_group")]


def _learner(model_dir, run_dir, port: int):
    from async_rlhf.config import load_config
    from async_rlhf.learner.actor import LearnerActor

    cfg = load_config(None, [f"model.path={model_dir}", "learners=1", "train.batch_size=3", "train.group_size=3",
                             "train.algorithm=ppo", "train.ppo.generator_reward_weight=1", "train.ppo.kl_coef=0",
                             "train.ppo.critic_lr=1e-2", "train.lr=1e-3", f"run.dir={run_dir}"])
    return LearnerActor(0, 1, cfg, str(model_dir), "127.0.0.1", port, "")


def _head(learner) -> torch.Tensor:
    head = learner.ppo.critic.engine.module.head
    return torch.cat([head.weight.detach().flatten(), head.bias.detach().flatten()]).clone()


def test_resume_restores_the_critic_and_the_reward_moments(tiny_model_dir, ragged_batch, tmp_path):
    from async_rlhf.endpoints import free_port

    torch.set_num_threads(1)
    port = free_port()
    first = _learner(tiny_model_dir, tmp_path / "run", port)
    batch = first.placer.batch(ragged_batch(first.engine.module.config.vocab_size))
    first._update(batch, [3, 3, 3])
    first.step = first.version = 1
    m = first.ppo.moments
    trained_head, moments = _head(first), (m.count, m.mean, m.m2)
    assert trained_head.abs().max().item() > 0 and m.count == 9  # the step moved them
    ckpt = tmp_path / "ckpt"
    first.save_checkpoint(str(ckpt))

    resumed = _learner(tiny_model_dir, tmp_path / "run", port)
    assert _head(resumed).abs().max().item() == 0.0  # a new critic starts from a zero value head
    state = resumed.load_checkpoint(str(ckpt))
    torch.testing.assert_close(_head(resumed), trained_head, rtol=0, atol=0)
    m = resumed.ppo.moments
    assert (m.count, m.mean, m.m2) == moments
    assert state == {"step": 1, "version": 1, "critic_restored": True}
    torch.testing.assert_close(resumed.ppo.critic.values(batch.input_ids, batch.attention_mask),
                               first.ppo.critic.values(batch.input_ids, batch.attention_mask), rtol=0, atol=0)
    # the optimizer state came back too: one more identical step moves both critics to the same place (AdamW's
    # moments differ between a fresh optimizer and a restored one, and so would this step)
    m_first = first._update(batch, [3, 3, 3])
    m_resumed = resumed._update(batch, [3, 3, 3])
    torch.testing.assert_close(_head(resumed), _head(first), rtol=1e-5, atol=1e-7)
    assert m_resumed["ppo/score_mean"] == pytest.approx(m_first["ppo/score_mean"])  # same normalisation
    assert not torch.equal(_head(resumed), trained_head)


def test_a_checkpoint_without_a_critic_is_said_so(tiny_model_dir, ragged_batch, tmp_path):
    """A checkpoint written before checkpoints held the critic: the resume goes on, and says so
    (``critic_restored`` False; the driver prints it)."""
    import shutil

    from async_rlhf.endpoints import free_port
    from async_rlhf.learner.ppo import CRITIC_DIR

    torch.set_num_threads(1)
    learner = _learner(tiny_model_dir, tmp_path / "run", free_port())
    learner.step = learner.version = 2
    ckpt = tmp_path / "old"
    learner.save_checkpoint(str(ckpt))
    shutil.rmtree(ckpt / CRITIC_DIR)
    assert learner.load_checkpoint(str(ckpt)) == {"step": 2, "version": 2, "critic_restored": False}
