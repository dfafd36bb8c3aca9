"""The agent side of a generator (async_rlhf/agent/environment.py, serving.py, policy_engine.py, build.py): the user's
agent plays a group's episodes through a real uvicorn endpoint with the stock openai SDK, and the ledger becomes the
trained samples.

Unit tier: the subject is the wiring between the generator's event loop, the endpoint's thread and the agents'
thread, so the engine behind the generator's policy is a scripted stand-in (answers a chosen text + eos, log-prob
-0.25, the version it is told); the real vLLM engine runs in the integration test (tests/integration/test_agent_run.py).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from async_rlhf.agent.build import serve_agents
from async_rlhf.config import Config
from async_rlhf.env.base import DropGroup, Prompt, Turn
from async_rlhf.env.registry import make_env
from async_rlhf.tiny.tokenizer import EOS, build_tokenizer

pytestmark = pytest.mark.unit


class ScriptedPolicy:
    """``EnginePolicy``'s ``generate`` on the generator loop: answers ``reply(context text)`` + eos."""

    def __init__(self, tokenizer, reply, version: int = 3) -> None:
        self.tok, self.reply, self.version = tokenizer, reply, version
        self.max_model_len, self.max_new_tokens = 64, 8
        self.contexts: list[list[int]] = []

    async def generate(self, context_ids: list[int], max_tokens: int | None = None) -> Turn:
        self.contexts.append(list(context_ids))
        await asyncio.sleep(0.001)
        text = self.reply(self.tok.decode(context_ids))
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.convert_tokens_to_ids(EOS)]
        if max_tokens is not None:
            ids = ids[:max_tokens]
        return Turn(ids, [-0.25] * len(ids), [self.version] * len(ids), "stop")


@pytest.fixture
def generator_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def agent_env(tmp_path: Path, agent_code: str, reply, **agent: object):
    path = tmp_path / "my_agent.py"
    path.write_text(agent_code)
    cfg = Config.model_validate({"task": {"name": "agent"}, "train": {"group_size": 4},
                                 "agent": {"entry": f"{path}:run", **agent}})
    tok = build_tokenizer()
    policy = ScriptedPolicy(tok, reply)
    env = serve_agents(make_env(cfg.task), cfg, tok, [tok.convert_tokens_to_ids(EOS)], policy, "tiny")
    return env, tok, policy


def play(env, loop, gid: str, prompt: Prompt, n: int = 4):
    return asyncio.run_coroutine_threadsafe(env.rollout_group(gid, prompt, [], n, None), loop).result(60)


ADDITION = Prompt("12+34=", {"a": 12, "b": 34, "answer": "046"})


def test_default_agent_trains_what_was_sampled(generator_loop) -> None:
    cfg = Config.model_validate({"task": {"name": "agent"}, "train": {"group_size": 4}})
    tok = build_tokenizer()
    answers = iter(["046", "045", "046", "146"])
    policy = ScriptedPolicy(tok, lambda ctx: next(answers))
    env = serve_agents(make_env(cfg.task), cfg, tok, [tok.convert_tokens_to_ids(EOS)], policy, "tiny")
    try:
        prompt_ids, trajs = play(env, generator_loop, "g0", ADDITION)
    finally:
        env.close()
    # the plain template renders the task's own prompt: the group's prompt is its text's ids
    assert prompt_ids == tok.encode("12+34=", add_special_tokens=False)
    assert all(c == prompt_ids for c in policy.contexts)
    eos = tok.convert_tokens_to_ids(EOS)
    assert sorted(tok.decode(t.token_ids[:-1]) for t in trajs) == ["045", "046", "046", "146"]
    for t in trajs:
        assert t.token_ids[-1] == eos and t.loss_mask == [1] * 4
        assert t.logprobs == [-0.25] * 4 and t.versions == [3] * 4
    assert sorted(t.env_return for t in trajs) == [0.0, 0.0, 1.0, 1.0]
    c = env.counters
    assert (c["agent_episodes"], c["agent_turns"], c["agent_token_mismatch"], c["agent_errors"]) == (4, 4, 0, 0)


MULTI_TURN = '''
async def run(task, client):
    first = await client.chat.completions.create(model="m", messages=task["messages"])
    history = task["messages"] + [{"role": "assistant", "content": first.choices[0].message.content},
                                  {"role": "user", "content": " again:"}]
    second = await client.chat.completions.create(model="m", messages=history)
    return {"reward": 1.0, "turn_rewards": [0.5, -0.25]}
'''


def test_multi_turn_episode_masks_observations_and_places_turn_rewards(tmp_path, generator_loop) -> None:
    env, tok, policy = agent_env(tmp_path, MULTI_TURN, lambda ctx: "7")
    try:
        prompt_ids, trajs = play(env, generator_loop, "g1", ADDITION, n=2)
    finally:
        env.close()
    eos = tok.convert_tokens_to_ids(EOS)
    obs = tok.encode(" again:", add_special_tokens=False)
    seven = tok.encode("7", add_special_tokens=False)
    for t in trajs:
        assert t.token_ids == seven + [eos] + obs + seven + [eos]
        assert t.loss_mask == [1, 1] + [0] * len(obs) + [1, 1]
        # the second turn's context is the first's plus what was sampled plus the observation: an extension
        assert t.token_rewards[1] == 0.5 and t.token_rewards[-1] == pytest.approx(-0.25 + 1.0)
        assert t.env_return == pytest.approx(1.25)
    assert policy.contexts[-1] == prompt_ids + seven + [eos] + obs
    assert env.counters["agent_turns"] == 4 and env.counters["agent_token_mismatch"] == 0


def test_token_check_counts_a_trained_id_that_is_not_the_engines(tmp_path, generator_loop) -> None:
    env, tok, policy = agent_env(tmp_path, MULTI_TURN, lambda ctx: "7")
    real_take = env.server.engine.take_outputs
    env.server.engine.take_outputs = lambda eid: [[i + 1 for i in out] for out in real_take(eid)]
    try:
        play(env, generator_loop, "g2", ADDITION, n=1)
    finally:
        env.close()
    assert env.counters["agent_token_mismatch"] == 4  # two turns of two ids, each off by one


def test_failing_agent_fails_its_group_with_its_error(tmp_path, generator_loop) -> None:
    code = "async def run(task, client):\n    raise KeyError('no such tool')\n"
    env, _, _ = agent_env(tmp_path, code, lambda ctx: "1")
    try:
        with pytest.raises(RuntimeError, match="no such tool"):
            play(env, generator_loop, "g3", ADDITION, n=2)
    finally:
        env.close()
    assert env.counters["agent_errors"] == 2


def test_agent_that_never_calls_the_model_is_named(tmp_path, generator_loop) -> None:
    env, _, _ = agent_env(tmp_path, "async def run(task, client):\n    return 1.0\n", lambda ctx: "1")
    try:
        with pytest.raises(RuntimeError, match="without calling the model"):
            play(env, generator_loop, "g4", ADDITION, n=1)
    finally:
        env.close()


SLOW = '''
import asyncio
async def run(task, client):
    await client.chat.completions.create(model="m", messages=task["messages"])
    await asyncio.sleep(1.5)
    await client.chat.completions.create(model="m", messages=task["messages"] + [
        {"role": "assistant", "content": "1"}, {"role": "user", "content": "?"}])
    return 1.0
'''


@pytest.mark.parametrize("rule", ["train", "drop_group"])
def test_episode_deadline_follows_the_timeout_rule(tmp_path, generator_loop, rule) -> None:
    env, _, _ = agent_env(tmp_path, SLOW, lambda ctx: "1", timeout_s=1.0, on_timeout=rule, timeout_reward=-1.0)
    try:
        if rule == "drop_group":
            with pytest.raises(DropGroup) as info:
                play(env, generator_loop, "g5", ADDITION, n=2)
            assert info.value.reason == "agent_timeout"
        else:
            _, trajs = play(env, generator_loop, "g5", ADDITION, n=2)
            # the agent got a 408 on its second call and raised: its first turn is trained with timeout_reward
            assert [t.env_return for t in trajs] == [-1.0, -1.0] and all(sum(t.loss_mask) == 2 for t in trajs)
    finally:
        env.close()
    assert env.counters["agent_timeouts"] == 2 and env.counters["agent_errors"] == 0


def test_entry_must_be_a_coroutine_function(tmp_path) -> None:
    with pytest.raises(ValueError, match="must be a coroutine function"):
        agent_env(tmp_path, "def run(task, client):\n    return 1.0\n", lambda ctx: "1")


def test_calculator_task_brings_its_agent_parser_and_turn_length_unless_set() -> None:
    from async_rlhf.config import load_config

    cfg = load_config(None, ["task.name=agent", "agent.task=calculator"])
    assert (cfg.agent.entry, cfg.agent.tool_parser, cfg.generator.max_new_tokens) == (
        "async_rlhf.agent.examples.calculator:run", "tiny_calculator", 10)
    cfg = load_config(None, ["task.name=agent", "agent.task=calculator", "generator.max_new_tokens=12",
                             "agent.entry=my.py:run"])
    assert (cfg.agent.entry, cfg.generator.max_new_tokens) == ("my.py:run", 12)
    plain = load_config(None, ["task.name=agent"])
    assert (plain.agent.tool_parser, plain.generator.max_new_tokens) == ("hermes", 6)
