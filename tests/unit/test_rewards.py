"""Reward sources: functions, weighted sums, a real reward model."""

import asyncio
from pathlib import Path

import pytest

from async_rlhf.env.base import Prompt
from async_rlhf.rewards.base import FunctionReward, RewardError, WeightedRewards, check_rewards, load_callable
from async_rlhf.rewards.http import HttpScorer

PROMPT = Prompt("12+30=", {"answer": "042"})


def length_reward(prompt: str, completion: str, data: dict) -> float:
    return float(len(completion))


def test_function_and_weighted_sources():
    exact = FunctionReward(lambda p, c, d: float(c == d["answer"]), name="exact")
    length = FunctionReward(length_reward, name="length", immediate=False)
    assert exact.immediate and exact.score_now(PROMPT, ["042", "42"]) == [1.0, 0.0]
    assert asyncio.run(length.score(PROMPT, ["042", "4"])) == [3.0, 1.0]
    both = WeightedRewards([(exact, 2.0), (length, -0.5)])
    assert not both.immediate and "2*exact" in both.name
    assert asyncio.run(both.score(PROMPT, ["042", "4"])) == [2.0 - 1.5, -0.5]
    assert WeightedRewards([(exact, 1.0), (exact, 1.0)]).score_now(PROMPT, ["042"]) == [2.0]
    with pytest.raises(NotImplementedError, match="not immediate"):
        HttpScorer("http://127.0.0.1:9/score").score_now(PROMPT, ["x"])


def test_bad_rewards_are_refused_with_the_reason():
    assert check_rewards([1, 0.5], 2, "f") == [1.0, 0.5]
    for values, message in (([1.0], "expected a list of 2"), ([1.0, float("nan")], "finite"),
                            ([1.0, "x"], "finite"), ([True, 1.0], "finite"), ("no", "expected a list")):
        with pytest.raises(RewardError, match=message):
            check_rewards(values, 2, "f")
    broken = FunctionReward(lambda p, c, d: None)
    with pytest.raises(RewardError, match="finite number"):
        broken.score_now(PROMPT, ["a"])


def test_load_callable_from_module_or_file(tmp_path: Path):
    assert load_callable("os.path:join", "rewards.function")("a", "b") == "a/b"
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompt, completion, data):\n    return 2.0\n")
    assert load_callable(f"{f}:score", "rewards.function")("p", "c", {}) == 2.0
    for spec, message in (("nocolon", "module:function"), (f"{tmp_path}/x.py:f", "no such file"),
                          ("no_such_module_xyz:f", "cannot import"), (f"{f}:missing", "has no function")):
        with pytest.raises(ValueError, match=message):
            load_callable(spec, "rewards.function")



def test_reward_model_scores_batched_equal_one_by_one_and_keeps_spaces(reward_model_dir: Path):
    from async_rlhf.rewards.model import RewardModelScorer

    scorer = RewardModelScorer(str(reward_model_dir), max_batch=3)
    texts = ["12+30=042", "12+30=4", "1 2", "12", "guess 0-9:3 higher:7"]
    together = scorer.score(texts)
    alone = [scorer.score([t])[0] for t in texts]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(v, 6) for v in together)) == len(texts)  # "1 2" and "12" differ: the space is kept
    assert scorer.tokenizer.decode(scorer.tokenizer("1 2", add_special_tokens=False)["input_ids"]) == "1 2"


def test_reward_model_server_merges_concurrent_requests(reward_model_dir: Path):
    from async_rlhf.rewards.model import RewardModelServer

    async def scenario() -> tuple[list[list[float]], dict]:
        server = RewardModelServer(str(reward_model_dir), max_batch=16, wait_s=0.02)
        outs = await asyncio.gather(*(server.score([f"{i}+1=", f"{i}+2="]) for i in range(12)))
        return outs, server.stats()

    outs, stats = asyncio.run(scenario())
    assert stats["texts"] == 24 and stats["batches"] == 2  # 12 requests of 2 texts, 16 per forward
    from async_rlhf.rewards.model import RewardModelScorer

    direct = RewardModelScorer(str(reward_model_dir)).score(["5+1=", "5+2="])
    assert outs[5] == pytest.approx(direct, abs=1e-5)


def ended_reward(prompt: str, completion: str, data: dict, *, completion_ids: list[int],
                 finish_reason: str) -> float:
    """A reward that requires a proper ending: the answer, then the stop token (id 2 here)."""
    return float(completion == data["answer"] and finish_reason == "stop" and completion_ids[-1:] == [2])


def test_reward_functions_get_token_ids_and_finish_reason_when_they_ask():
    from async_rlhf.rewards.base import Completion, wanted_extras

    ended = Completion("042", [3, 7, 5, 2], "stop")
    rambling = Completion("042", [3, 7, 5, 1, 1], "length")  # "042<s><s>": the same text once stripped
    assert ended == "042" and isinstance(ended, str) and ended.token_ids == [3, 7, 5, 2]
    # old three-argument functions are called as before and cannot tell the two apart
    old = FunctionReward(lambda p, c, d: float(c == d["answer"]))
    assert old.extras == () and old.score_now(PROMPT, [ended, rambling]) == [1.0, 1.0]
    new = FunctionReward(ended_reward, immediate=False)
    assert new.extras == ("completion_ids", "finish_reason")
    assert asyncio.run(new.score(PROMPT, [ended, rambling])) == [1.0, 0.0]

    def only_reason(prompt, completion, data, finish_reason=None):
        return float(finish_reason == "stop")

    def anything(prompt, completion, data, **kw):
        return float(sorted(kw) == ["completion_ids", "finish_reason", "prompt_ids"] and type(completion) is str)

    assert wanted_extras(only_reason) == ("finish_reason",)
    assert FunctionReward(only_reason).score_now(PROMPT, [ended, rambling]) == [1.0, 0.0]
    assert FunctionReward(anything).score_now(PROMPT, [ended]) == [1.0]
    # a plain str (a caller that has no token ids) gives None for them
    assert FunctionReward(lambda p, c, d, finish_reason: float(finish_reason is None)).score_now(PROMPT, ["x"]) == [1.0]
    import pickle

    back = pickle.loads(pickle.dumps(rambling))  # crosses to Ray actors (reward models) intact
    assert back == "042" and back.token_ids == rambling.token_ids and back.finish_reason == "length"


def test_reward_functions_get_the_prompt_ids_when_they_ask():
    """The tokens the model was given (a chat prompt after its template), beside the completion's."""
    from async_rlhf.rewards.base import Completion, wanted_extras

    def starts_with_bos(prompt, completion, data, *, prompt_ids):
        return float(prompt_ids[:1] == [1])

    assert wanted_extras(starts_with_bos) == ("prompt_ids",)
    seen = [Completion("042", [3, 2], "stop", [1, 5, 9]), Completion("042", [3, 2], "stop", [5, 9])]
    assert FunctionReward(starts_with_bos).score_now(PROMPT, seen) == [1.0, 0.0]
    assert Completion("x").prompt_ids == []


def test_http_request_carries_token_ids_and_finish_reasons():
    from async_rlhf.rewards.base import Completion
    from async_rlhf.rewards.http import request_body

    outs = [Completion("042", [3, 7, 5, 2], "stop"), Completion("04", [3, 7, 1, 1], "length")]
    body = request_body(PROMPT, outs)
    assert body == {"prompt": "12+30=", "completions": ["042", "04"], "data": {"answer": "042"},
                    "completion_ids": [[3, 7, 5, 2], [3, 7, 1, 1]], "finish_reasons": ["stop", "length"]}
    assert request_body(PROMPT, ["042"]) == {"prompt": "12+30=", "completions": ["042"], "data": {"answer": "042"}}
