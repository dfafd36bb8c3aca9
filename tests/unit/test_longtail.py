from __future__ import annotations

import itertools
import statistics

import pytest

from async_rlhf.config import ConfigError, TaskConfig, load_config
from async_rlhf.env.longtail import MAX_LENGTH, LongTailTask, length_weights
from async_rlhf.env.registry import make_task


def test_problem_format_and_reward() -> None:
    task = LongTailTask()
    p = task.make(37, 5)
    assert (p.prompt, p.answer) == ("37*05=", "37373")
    assert task.reward(p, "37373") == 1.0
    assert task.reward(p, " 37373<eos>") == 1.0
    assert task.reward(p, "3737") == 0.0       # stopped early
    assert task.reward(p, "373737") == 0.0     # ran on
    assert task.make(4, 1).answer == "0"
    assert len(task.make(99, MAX_LENGTH).answer) == MAX_LENGTH


def test_lengths_are_heavy_tailed() -> None:
    lengths = [len(p.answer) for p in itertools.islice(LongTailTask().train_problems(seed=3), 20_000)]
    assert min(lengths) == 1 and max(lengths) == MAX_LENGTH
    assert 7 < statistics.mean(lengths) < 14
    assert statistics.median(lengths) <= 6
    assert 0.05 < sum(n >= 30 for n in lengths) / len(lengths) < 0.15
    assert sum(length_weights()) == pytest.approx(1.0)


def test_heldout_is_fixed_and_never_trained_on() -> None:
    a, b = LongTailTask(heldout_size=100), LongTailTask(heldout_size=100)
    assert a.heldout() == b.heldout() and len(set(a.heldout())) == 100
    train = list(itertools.islice(a.train_problems(seed=0), 5000))
    assert not any(a.is_heldout(p) for p in train)
    assert all(a.is_heldout(p) for p in a.heldout())


def test_sloppy_teacher_is_right_exactly_on_even_lengths() -> None:
    task = LongTailTask()
    assert task.sloppy_answer(task.make(12, 4)) == "1212"
    assert task.sloppy_answer(task.make(12, 3)) == "1212"
    assert task.reward(task.make(12, 3), task.sloppy_answer(task.make(12, 3))) == 0.0


def test_registry_and_config_know_the_task_and_refuse_bad_input() -> None:
    cfg = load_config(None, ["task.name=longtail"])
    assert isinstance(make_task(cfg.task), LongTailTask)
    with pytest.raises(ValueError, match="pattern 0..99 and length 1..40"):
        LongTailTask().make(5, 41)
    with pytest.raises(ValueError, match="heldout_size"):
        make_task(TaskConfig(name="longtail", heldout_size=5000))
    with pytest.raises(ConfigError, match="task.name"):
        load_config(None, ["task.name=longtails"])


def test_environment_interface_prompts_and_verifier() -> None:
    from async_rlhf.env.longtail import LongTailEnv

    env = LongTailEnv(LongTailTask(heldout_size=10))
    prompt = next(env.train_prompts(seed=0))
    assert prompt.text.endswith("=") and len(prompt.data["answer"]) == prompt.data["b"]
    assert env.verify(prompt, prompt.data["answer"]) == 1.0
    assert env.verify(prompt, prompt.data["answer"] + "0") == 0.0
    assert len(env.heldout()) == 10 and env.has_verifier
