"""Prompts that leave no room in the context window: passed over before generation (used up with the next group,
like the prompt filter's), a group that still had none dropped with reason ``prompt_too_long``, a run where no
prompt fits stopped with the fix named; both counted for the driver, which warns once (issue 31 theme: they were
scored as "" and trained, or counted as normal groups, without a word)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from test_env_groups import drive, make_runner
from test_loop_phases import SOURCE, Client, Generator, Runner

from async_rlhf.config import load_config
from async_rlhf.env.base import Prompt, SingleTurnEnv, Turn
from async_rlhf.generator.loop_phases import LoopState
from async_rlhf.generator.prompt_fit import (
    STOP_AFTER,
    PromptFit,
    PromptsTooLong,
    context_len,
    rollout_figures,
    too_long_warning,
)
from async_rlhf.generator.rollout import EnginePolicy
from async_rlhf.generator.stream import PromptStream
from async_rlhf.rewards.base import FunctionReward

CONTEXT = 64


def long_aware(gen: Generator) -> Generator:
    """Rendered prompts starting with ``<L`` take 100 tokens (past the 64-token window), others 2."""
    gen.chat = SimpleNamespace(render=lambda p: Prompt(f"<{p.text}>"),
                               encode=lambda p: [7] * (100 if p.text.startswith("<L") else 2))
    gen._fit = PromptFit(CONTEXT)
    gen.counters["prompts_too_long"] = 0
    return gen


def stream(*texts: str, reissue: tuple[int, ...] = (), start: int = 0) -> PromptStream[Prompt]:
    return PromptStream((Prompt(t) for t in itertools.cycle(texts)), start=start, reissue=reissue)


def test_a_prompt_without_room_is_passed_over_and_used_up_with_the_next_group() -> None:
    gen, runner = long_aware(Generator()), Runner()
    gen._admit_phase(LoopState(), Client(granted=2), stream("p0", "L1", "L2", "p3"), SOURCE, runner, 1.0)
    assert [(gid, text) for gid, text, _ in runner.started] == [("g0-t-1", "<p0>"), ("g0-t-4~2", "<p3>")], \
        "positions 2 and 3 used up with the group of position 4 (keys_of_group), never generated"
    assert all(len(ids) == 2 for _, _, ids in runner.started)
    assert gen.counters["prompts_too_long"] == 2 and gen.counters["prompts_too_long_max_tokens"] == 100


def test_a_reissued_prompt_without_room_is_started_for_the_runner_to_drop() -> None:
    gen, runner = long_aware(Generator()), Runner()
    gen._fit.fitted = True
    gen._admit_phase(LoopState(), Client(granted=1), stream("L0", reissue=(1,), start=1), SOURCE, runner, 1.0)
    assert [text for _, text, _ in runner.started] == ["<L0>"] and gen.counters["prompts_too_long"] == 0


def test_a_run_where_no_prompt_fits_stops_naming_the_fix_but_one_that_fitted_goes_on() -> None:
    gen, runner = long_aware(Generator()), Runner()
    named = r"a window of 64 tokens: generator.max_model_len, else model.max_model_len.*100 tokens"
    with pytest.raises(PromptsTooLong, match=named):
        gen._admit_phase(LoopState(), Client(granted=1), stream("L0"), SOURCE, runner, 1.0)
    assert gen.counters["prompts_too_long"] == STOP_AFTER - 1 and runner.started == []
    gen2, runner2 = long_aware(Generator()), Runner()
    problems = stream("p0", *["L"] * 300)
    gen2._admit_phase(LoopState(), Client(granted=2), problems, SOURCE, runner2, 1.0)
    assert len(runner2.started) == 2, "a prompt fitted once: long runs of too-long ones are passed over, bounded"


def test_a_group_whose_every_rollout_had_no_room_is_dropped_never_put() -> None:
    runner, client, events = make_runner(SingleTurnEnv(), FunctionReward(lambda p, c, d: float(len(c))))
    runner.policy = EnginePolicy(lambda *a: None, lambda t: [1], lambda ids: "", max_new_tokens=6,
                                 max_model_len=CONTEXT)
    runner.start("g1", Prompt("x"), [1] * CONTEXT)
    drive(runner, lambda: client.released)
    assert client.puts == [], "an empty group is never trained"
    assert ("dropped", "g1", None, "prompt_too_long") in events and ("prompts_too_long", "g1", None,
                                                                    "prompt_too_long") in events
    runner.close()


def test_truncated_samples_are_counted() -> None:
    runner, client, events = make_runner(SingleTurnEnv(), FunctionReward(lambda p, c, d: 1.0))

    async def cut(context_ids):
        return Turn([53], [-1.0], [0], "length")

    runner.policy.generate = cut
    runner.start("g1", Prompt("x"), [1])
    drive(runner, lambda: client.puts)
    assert [e[0] for e in events].count("samples_truncated") == 3
    runner.close()


def test_the_driver_warns_once_naming_the_fix_and_writes_the_figures() -> None:
    quiet = [{"gen_id": 0, "prompts_too_long": 0, "samples": 8, "samples_truncated": 0}]
    assert too_long_warning(quiet, CONTEXT) is None
    stats = [{"gen_id": 0, "prompts_too_long": 3, "prompts_too_long_max_tokens": 120, "samples": 30,
              "samples_truncated": 6},
             {"gen_id": 1, "prompts_too_long": 1, "prompts_too_long_max_tokens": 90, "samples": 10,
              "samples_truncated": 2}]
    line = too_long_warning(stats, CONTEXT)
    assert line is not None and line.startswith("warning: 4 prompt(s)") and "120 tokens" in line
    assert "model.max_model_len" in line and "max_position_embeddings" in line
    assert rollout_figures(stats) == {"rollout/prompts_too_long": 4.0, "rollout/truncated": 0.2}
    assert rollout_figures([]) == {}


def test_the_context_window_is_the_engines() -> None:
    assert context_len(load_config(None, ["model.max_model_len=64"])) == 64
    assert context_len(load_config(None, ["model.max_model_len=64", "generator.max_model_len=256"])) == 256
