"""Environments: trajectories with observation tokens, the guess-number task, the registry and its config."""

import asyncio
from pathlib import Path

import numpy as np
import pytest

from async_rlhf.config import ConfigError, load_config, parse_reward_sources
from async_rlhf.env.arithmetic import AdditionEnv, AdditionTask, RewardModelEnv
from async_rlhf.env.base import Prompt, SingleTurnEnv, Trajectory, Turn
from async_rlhf.env.guess_number import GuessNumberEnv, first_digit, hint
from async_rlhf.env.registry import make_env
from async_rlhf.types import Sample


class ScriptedPolicy:
    """Answers each generate() with the next scripted text (the subject here is the environment)."""

    def __init__(self, replies: list[str], version: int = 7) -> None:
        self.replies = list(replies)
        self.contexts: list[list[int]] = []
        self.version = version

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    async def generate(self, context_ids: list[int]) -> Turn:
        self.contexts.append(list(context_ids))
        ids = self.encode(self.replies.pop(0))
        return Turn(ids, [-0.5] * len(ids), [3] * len(ids), "stop")


def play(env, prompt: Prompt, replies: list[str]) -> tuple[Trajectory, ScriptedPolicy]:
    policy = ScriptedPolicy(replies)
    traj = asyncio.run(env.rollout(prompt, policy.encode(prompt.text), policy))
    return traj, policy


def test_guess_number_splices_hints_as_untrained_observations_with_per_turn_rewards():
    env = GuessNumberEnv(max_turns=4, step_penalty=0.1)
    traj, policy = play(env, Prompt("guess 0-9:", {"secret": 6}), ["3", "8x", "6"])
    assert traj.turns == 3 and traj.text == "38x6"
    text = "".join(map(chr, traj.token_ids))
    assert text == "3 higher:8x lower:6"
    mask = np.asarray(traj.loss_mask)
    assert "".join(c for c, m in zip(text, mask) if m) == "38x6"  # only generated tokens are trained
    obs = mask == 0
    assert np.all(np.asarray(traj.logprobs)[obs] == 0.0) and np.all(np.asarray(traj.versions)[obs] == 7)
    # each turn's context is the whole conversation so far
    assert policy.contexts[1] == policy.encode("guess 0-9:3 higher:")
    assert policy.contexts[2] == policy.encode("guess 0-9:3 higher:8x lower:")
    rewards = np.asarray(traj.token_rewards)
    assert rewards[text.index("3")] == pytest.approx(-0.1)
    assert rewards[text.index("x")] == pytest.approx(-0.1)  # on the last token of turn 2
    assert rewards[-1] == pytest.approx(1.0) and np.count_nonzero(rewards) == 3
    sample = traj.to_sample(0.5)
    assert isinstance(sample, Sample) and sample.reward == pytest.approx(0.8 + 0.5)
    assert sample.loss_mask.dtype == np.uint8 and sample.loss_mask.tolist() == mask.tolist()
    assert sample.token_rewards.dtype == np.float32 and sample.token_rewards[-1] == pytest.approx(1.5)
    back = Sample.from_wire(sample.to_wire())
    assert back.loss_mask.tolist() == mask.tolist() and back.token_rewards.tolist() == sample.token_rewards.tolist()


def test_guess_number_stops_after_max_turns_and_answers_non_digits():
    env = GuessNumberEnv(max_turns=2)
    traj, _ = play(env, Prompt("guess 0-9:", {"secret": 0}), ["a", "9"])
    assert "".join(map(chr, traj.token_ids)) == "a digit:9"  # no hint after the last turn
    assert traj.env_return == pytest.approx(-0.2)
    assert first_digit("ab7c8") == 7 and first_digit("abc") is None
    assert (hint(3, 5), hint(7, 5), hint(None, 5)) == (" higher:", " lower:", " digit:")
    with pytest.raises(ValueError, match="max_turns"):
        GuessNumberEnv(max_turns=0)


def test_guess_number_prompts_are_deterministic_and_cover_every_secret():
    env = GuessNumberEnv()
    it = env.train_prompts(3)
    secrets = [next(it).data["secret"] for _ in range(200)]
    assert set(secrets) == set(range(10))
    again = env.train_prompts(3)
    assert [next(again).data["secret"] for _ in range(200)] == secrets


def test_single_turn_addition_env_and_its_verifier():
    env = AdditionEnv(AdditionTask(digits=2, heldout_size=20))
    prompt = next(env.train_prompts(0))
    answer = prompt.data["answer"]
    traj, _ = play(env, prompt, [answer + "</s>"])
    assert traj.turns == 1 and traj.loss_mask == [1] * len(traj.token_ids) and traj.env_return == 0
    assert env.verify(prompt, traj.text) == 1.0 and env.verify(prompt, "1") == 0.0
    assert traj.to_sample(1.0).token_rewards is None  # single turn: the reward is the sample's reward
    assert len(env.heldout()) == 20 and all(not env.task.is_heldout(env.task.make(p.data["a"], p.data["b"]))
                                            for p in [next(env.train_prompts(1)) for _ in range(100)])
    assert env.has_verifier and not RewardModelEnv(env.task).has_verifier


def test_registry_and_env_config_refuse_what_cannot_run(tmp_path: Path):
    assert isinstance(make_env(load_config(None, ["task.name=guess_number"]).task), GuessNumberEnv)
    assert isinstance(make_env(load_config(None).task), AdditionEnv)
    custom = make_env(load_config(None, ["task.name=custom", "prompts.source=python", "prompts.path=m:f",
                                         "rewards.sources=function", "rewards.function=m:g"]).task)
    assert isinstance(custom, SingleTurnEnv) and not custom.has_verifier
    with pytest.raises(ValueError, match="no prompts of its own"):
        next(custom.train_prompts(0))
    assert parse_reward_sources("task, model:0.5,http:-1") == [("task", 1.0), ("model", 0.5), ("http", -1.0)]
    bad = {
        "rewards.sources=judge": "unknown source 'judge'",
        "rewards.sources=task:x": "is not a number",
        "rewards.sources=http": "set rewards.http_url",
        "rewards.sources=model": "set rewards.model_path",
        "task.name=reward_model": "has no reward rule of its own",
        "task.max_turns=0": "task.max_turns",
        "prompts.source=file": "needs prompts.path",
        f"prompts.path={tmp_path}/none.jsonl": "no such file",
        "rewards.http_url=ftp://x": "must start with http",
        "rewards.timeout_s=0": "rewards.timeout_s",
    }
    for override, message in bad.items():
        extra = ["prompts.source=file"] if override.startswith("prompts.path") else []
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override, *extra])
    with pytest.raises(ConfigError, match=r"rewards.model_path=.*\(no config.json\)"):
        load_config(None, ["task.name=reward_model", "rewards.sources=model", f"rewards.model_path={tmp_path}"])


def test_relative_user_paths_are_pinned_to_the_launch_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_reward.py").write_text("def score(prompt, completion, data):\n    return 1.0\n")
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1="}\n')
    cfg = load_config(None, ["task.name=custom", "prompts.source=file", "prompts.path=data.jsonl",
                             "rewards.sources=function", "rewards.function=my_reward.py:score"])
    assert cfg.prompts.path == str(tmp_path / "data.jsonl")
    assert cfg.rewards.function == f"{tmp_path / 'my_reward.py'}:score"
    assert load_config(None, ["rewards.function=pkg.mod:fn"]).rewards.function == "pkg.mod:fn"  # a module
    with pytest.raises(ConfigError, match="no such file"):
        load_config(None, ["rewards.function=missing.py:score"])
