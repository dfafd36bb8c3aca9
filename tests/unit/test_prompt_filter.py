"""The pre-rollout prompt filter: which prompts it passes over, how often it still tries them, and when it is on."""

from __future__ import annotations

import pytest

from async_rlhf.config import load_config
from async_rlhf.env.base import Prompt
from async_rlhf.generator.prompt_filter import UninformativePromptFilter


def admitted_share(filt: UninformativePromptFilter, prompt: Prompt, draws: int = 4000) -> float:
    return sum(filt.admit(prompt) for _ in range(draws)) / draws


def test_a_prompt_is_tried_less_the_more_groups_in_a_row_were_uniform_down_to_the_floor() -> None:
    filt, p = UninformativePromptFilter(min_retry=0.1, seed=1), Prompt("12+34=")
    assert filt.retry_probability(p) == 1.0 and admitted_share(filt, p) == 1.0 and filt.skipped == 0
    filt.observe(p, [1.0, 1.0, 1.0])
    assert filt.retry_probability(p) == 0.5 and admitted_share(filt, p) == pytest.approx(0.5, abs=0.04)
    filt.observe(p, [0.0, 0.0, 0.0])  # all wrong teaches nothing either
    assert filt.retry_probability(p) == 0.25 and admitted_share(filt, p) == pytest.approx(0.25, abs=0.04)
    for _ in range(8):
        filt.observe(p, [1.0, 1.0, 1.0])
    assert filt.retry_probability(p) == 0.1 and admitted_share(filt, p) == pytest.approx(0.1, abs=0.03)
    assert filt.skipped > 0 and filt.remembered == 1


def test_one_informative_group_resets_the_prompt_and_others_are_untouched() -> None:
    filt, p, q = UninformativePromptFilter(min_retry=0.1, seed=0), Prompt("a"), Prompt("b")
    filt.observe(p, [1.0, 1.0])
    filt.observe(q, [1.0, 1.0])
    filt.observe(p, [1.0, 0.0])
    assert filt.retry_probability(p) == 1.0 and filt.retry_probability(q) == 0.5 and filt.remembered == 1


def test_a_single_sample_group_is_never_called_uniform() -> None:
    filt, p = UninformativePromptFilter(min_retry=0.1, seed=0), Prompt("a")
    filt.observe(p, [1.0])
    assert filt.retry_probability(p) == 1.0


def test_memory_is_bounded_and_forgets_the_least_recently_updated_first() -> None:
    filt = UninformativePromptFilter(min_retry=0.1, seed=0, capacity=2)
    for text in ("a", "b", "a", "c"):
        filt.observe(Prompt(text), [1.0, 1.0])
    assert filt.remembered == 2 and filt.retry_probability(Prompt("b")) == 1.0
    assert filt.retry_probability(Prompt("a")) == 0.25 and filt.retry_probability(Prompt("c")) == 0.5


def test_prompts_are_known_by_their_rendered_text_whatever_their_data() -> None:
    filt = UninformativePromptFilter(min_retry=0.1, seed=0)
    filt.observe(Prompt("<user>hi", {"messages": [{"role": "user", "content": "hi"}]}), [1.0, 1.0])
    assert filt.retry_probability(Prompt("<user>hi")) == 0.5 and filt.retry_probability(Prompt("<system>hi")) == 1.0


@pytest.mark.parametrize("kwargs", [{"min_retry": 0.0}, {"min_retry": 1.5}, {"min_retry": 0.1, "capacity": 0}])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="min_retry|capacity"):
        UninformativePromptFilter(seed=0, **kwargs)


@pytest.mark.parametrize(("overrides", "on"), [([], False), (["prompts.skip_uninformative=on"], True)])
def test_the_filter_is_off_unless_asked_for(overrides: list[str], on: bool) -> None:
    assert load_config(None, overrides).prompts.skip_uninformative is on


def test_the_floor_must_be_a_probability() -> None:
    from async_rlhf.config import ConfigError

    with pytest.raises(ConfigError, match="prompts.skip_min_retry"):
        load_config(None, ["prompts.skip_min_retry=0"])
