"""PPO with a critic, the pure parts: value loss (clipped and not), KL-shaped token rewards through GAE,
whitening, running moments, the value model, and the configuration it is refused with. Hand-worked values."""

import json
import math

import pytest
import torch

from async_rlhf.config import ConfigError, load_config, parse_reward_models
from async_rlhf.learner.advantages import gae
from async_rlhf.learner.critic import ValueModel, value_loss
from async_rlhf.learner.ppo import RunningMoments, token_rewards, whiten

torch.set_num_threads(1)

# three trained tokens and one padding column (garbage there must not count)
VALUES = [[1.0, 2.0, 3.0, float("nan")]]
OLD = [[0.9, 2.5, 2.0, 7.0]]
RETURNS = [[1.5, 1.0, 2.5, float("inf")]]
MASK = [[1.0, 1.0, 1.0, 0.0]]


def _t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def test_value_loss_unclipped_hand_values():
    # squared errors: (1 - 1.5)^2 = 0.25, (2 - 1)^2 = 1, (3 - 2.5)^2 = 0.25; 0.5 * mean = 0.5 * 1.5 / 3 = 0.25
    values = _t(VALUES, grad=True)
    loss, m = value_loss(values, _t(OLD), _t(RETURNS), _t(MASK), clip=0.0)
    assert loss.item() == pytest.approx(0.25)
    assert m["critic/clip_frac"] == 0.0
    loss.backward()
    # d/dv 0.5 * (v - R)^2 / 3 = (v - R) / 3
    assert values.grad.tolist()[0] == pytest.approx([-0.5 / 3, 1.0 / 3, 0.5 / 3, 0.0])


def test_value_loss_clipped_hand_values():
    # clip 0.2 around the old values:
    #   t0: v - old = 0.1 inside the range, v_clip = 1.0: both errors 0.25
    #   t1: v - old = -0.5 -> -0.2, v_clip = 2.3: (2.3 - 1)^2 = 1.69 > 1.0, the clipped error counts
    #   t2: v - old = 1.0 -> 0.2, v_clip = 2.2: (2.2 - 2.5)^2 = 0.09 < 0.25, the unclipped error counts
    # loss = 0.5 * (0.25 + 1.69 + 0.25) / 3 = 0.365
    values = _t(VALUES, grad=True)
    loss, m = value_loss(values, _t(OLD), _t(RETURNS), _t(MASK), clip=0.2)
    assert loss.item() == pytest.approx(0.365)
    assert m["critic/clip_frac"] == pytest.approx(1 / 3)
    assert m["critic/value_loss"] == pytest.approx(0.365)
    assert m["critic/returns_mean"] == pytest.approx((1.5 + 1.0 + 2.5) / 3)
    loss.backward()
    # t1 is on the clipped branch, whose clamp is saturated: no gradient there
    assert values.grad.tolist()[0] == pytest.approx([-0.5 / 3, 0.0, 0.5 / 3, 0.0])


def test_value_loss_explained_variance():
    returns = _t([[1.0, 2.0, 3.0]])
    mask = torch.ones(1, 3, dtype=torch.float64)
    _, perfect = value_loss(returns.clone(), returns, returns, mask, clip=0.0)
    _, constant = value_loss(_t([[2.0, 2.0, 2.0]]), returns, returns, mask, clip=0.0)
    assert perfect["critic/explained_variance"] == pytest.approx(1.0)
    assert constant["critic/explained_variance"] == pytest.approx(0.0)
    assert perfect["critic/abs_error"] == 0.0


def test_kl_shaped_rewards_through_gae_hand_values():
    # per token: mu - ref, reward -0.1 * (mu - ref), the score added on each row's last completion token
    behav = torch.tensor([[0.0, -1.0, -0.5, 0.0], [0.0, -0.3, 0.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -0.25, 0.0], [0.0, -0.1, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    rewards, kl = token_rewards(torch.tensor([1.0, -2.0]), behav, ref, mask, kl_coef=0.1)
    assert kl.tolist()[0] == pytest.approx([0.0, 0.5, -0.25, 0.0])
    assert rewards.tolist()[0] == pytest.approx([0.0, -0.05, 1.025, 0.0])
    assert rewards.tolist()[1] == pytest.approx([0.0, -1.98, 0.0, 0.0])
    # GAE, gamma 1, lambda 0.95:
    #   row 0: t2 delta = 1.025 - 0.4 = 0.625;  t1 delta = -0.05 + 0.4 - 0.5 = -0.15, A1 = -0.15 + 0.95 * 0.625
    #   row 1: t1 delta = -1.98 - (-1.0) = -0.98
    values = torch.tensor([[9.0, 0.5, 0.4, 9.0], [9.0, -1.0, 9.0, 9.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    assert adv.tolist()[0] == pytest.approx([0.0, 0.44375, 0.625, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.0, 0.94375, 1.025, 0.0])
    assert adv.tolist()[1] == pytest.approx([0.0, -0.98, 0.0, 0.0])
    assert ret.tolist()[1] == pytest.approx([0.0, -1.98, 0.0, 0.0])


def test_token_rewards_without_reference_or_tokens():
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    rewards, kl = token_rewards(torch.tensor([5.0, 2.0]), torch.zeros(2, 2), None, mask, kl_coef=0.1)
    assert rewards.tolist() == [[0.0, 0.0], [0.0, 2.0]]  # a row without completion tokens gets nothing
    assert kl.abs().sum().item() == 0.0


def test_whiten_and_running_moments():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    out = whiten(x, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    s = math.sqrt(2 / 3)  # population std of 1, 2, 3
    assert out.tolist()[0] == pytest.approx([-1 / s, 0.0, 1 / s, 0.0], abs=1e-5)
    moments = RunningMoments()
    moments.update(torch.tensor([1.0, 2.0]))
    moments.update(torch.tensor([3.0, 4.0, 5.0]))
    assert moments.mean == pytest.approx(3.0)
    assert moments.std == pytest.approx(math.sqrt(2.0))  # population std of 1..5


def test_value_model_starts_at_zero_and_learns_returns(tiny_model_dir):
    torch.manual_seed(0)
    model = ValueModel(str(tiny_model_dir), torch.float32)
    ids = torch.randint(3, 20, (4, 7))
    attn = torch.ones_like(ids)
    mask = torch.zeros(4, 6)
    mask[:, 2:] = 1.0
    values = model(ids, attn)[:, :-1]
    assert values.shape == (4, 6) and values.abs().max().item() == 0.0
    returns = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None].expand(4, 6)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        old = model(ids, attn)[:, :-1].detach()
        loss, _ = value_loss(model(ids, attn)[:, :-1], old, returns, mask, clip=0.2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_parse_reward_models():
    assert parse_reward_models("") == []
    assert parse_reward_models("/a/rm, /b/rm:0.5") == [("/a/rm", 1.0), ("/b/rm", 0.5)]
    with pytest.raises(ConfigError, match="not a number"):
        parse_reward_models("/a/rm:heavy")


def test_ppo_config_refusals(tmp_path):
    with pytest.raises(ConfigError, match="needs a reward"):
        load_config(None, ["train.algorithm=ppo"])
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        load_config(None, ["train.algorithm=ppo", f"train.ppo.reward_models={tmp_path / 'missing'}"])
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(ConfigError, match="not a reward model"):
        load_config(None, ["train.algorithm=ppo", f"train.ppo.reward_models={lm}"])
    rm = tmp_path / "rm"
    rm.mkdir()
    (rm / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                "id2label": {"0": "LABEL_0"}}))
    cfg = load_config(None, ["train.algorithm=ppo", f"train.ppo.reward_models={rm}:2", "train.group_size=1"])
    assert cfg.train.ppo.reward_models.endswith(":2") and cfg.train.group_size == 1
    with pytest.raises(ConfigError, match="gamma"):
        load_config(None, ["train.algorithm=ppo", "train.ppo.generator_reward_weight=1", "train.ppo.lam=1.5"])
    with pytest.raises(ConfigError, match="train.algorithm must be one of"):
        load_config(None, ["train.algorithm=a2c"])
