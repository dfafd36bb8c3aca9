"""The user's held-out figure: eval prompts from a file, greedy completions, scored by the reward sources."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.driver.stopping import stop_reason
from async_rlhf.env.base import Prompt
from async_rlhf.evaluation import (
    eval_figures,
    eval_label,
    eval_record,
    eval_summary,
    heldout_label,
    load_eval_prompts,
    score_completions,
    summarize,
)
from async_rlhf.rewards.base import Completion, FunctionReward


def test_summarize_reports_accuracy_only_for_pass_fail_rewards():
    assert summarize([1.0, 0.0, 1.0, 1.0]) == {"reward_mean": 0.75, "accuracy": 0.75}
    assert summarize([0.5, 1.0]) == {"reward_mean": 0.75}
    assert summarize([-1.0, 1.0]) == {"reward_mean": 0.0}
    with pytest.raises(ValueError):
        summarize([])


def test_score_completions_uses_the_sources_with_ids_and_finish_reason():
    def exact(prompt, completion, data, finish_reason):
        return float(completion == data["answer"] and finish_reason == "stop")

    prompts = [Prompt("1+1=", {"answer": "2"}), Prompt("2+2=", {"answer": "4"}), Prompt("3+3=", {"answer": "6"})]
    outs = [Completion("2", [5, 2], "stop"), Completion("4", [7, 1, 1], "length"), Completion("5", [8, 2], "stop")]
    for immediate in (True, False):
        got = asyncio.run(score_completions(FunctionReward(exact, immediate=immediate), prompts, outs, 5.0))
        assert got == pytest.approx({"reward_mean": 1 / 3, "accuracy": 1 / 3})
    graded = FunctionReward(lambda p, c, d: 0.5 if c == d["answer"] else 0.0)
    assert asyncio.run(score_completions(graded, prompts, outs, 5.0)) == {"reward_mean": 1 / 3}
    with pytest.raises(ValueError, match="2 completions for 3"):
        asyncio.run(score_completions(graded, prompts, outs[:2], 5.0))


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "12+30=", "answer": "042"}) + "\n")
    heldout = tmp_path / "eval.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}) + "\n"
                               for a, b in [(1, 2), (10, 20), (33, 44), (5, 5)]))
    fn = tmp_path / "reward.py"
    fn.write_text("def score(prompt, completion, data, completion_ids=None, finish_reason=None):\n"
                  "    return float(completion.startswith(data['answer']))\n")
    return data, heldout, fn


def _custom(tmp_path: Path, *extra: str):
    data, heldout, fn = _files(tmp_path)
    return load_config(None, ["task.name=custom", "prompts.source=file", f"prompts.path={data}",
                              "rewards.sources=function", f"rewards.function={fn}:score", *extra])


def test_eval_path_is_validated_and_loaded(tmp_path: Path):
    cfg = _custom(tmp_path, f"prompts.eval_path={tmp_path / 'eval.jsonl'}")
    prompts = load_eval_prompts(cfg)
    assert [p.text for p in prompts] == ["01+02=", "10+20=", "33+44=", "05+05="]
    assert prompts[2].data == {"answer": "077"}
    assert load_eval_prompts(_custom(tmp_path)) == []
    with pytest.raises(ConfigError, match="prompts.eval_path=.*no such file"):
        _custom(tmp_path, f"prompts.eval_path={tmp_path / 'missing.jsonl'}")
    (tmp_path / "eval.csv").write_text("prompt\n1+1=\n")
    with pytest.raises(ConfigError, match="unknown format"):
        _custom(tmp_path, f"prompts.eval_path={tmp_path / 'eval.csv'}")


def test_eval_figures_of_a_model_directory(tmp_path: Path, tiny_model_dir: Path):
    """Greedy with transformers on the user's set, scored by the user's function: a random tiny model gets
    none right, and the figures say so (accuracy too: the function's rewards are 0 or 1)."""
    cfg = _custom(tmp_path, f"prompts.eval_path={tmp_path / 'eval.jsonl'}", "generator.max_new_tokens=4")
    assert eval_figures(str(tiny_model_dir), cfg) == {"reward_mean": 0.0, "accuracy": 0.0}
    (tmp_path / "reward.py").write_text("def score(prompt, completion, data, completion_ids, finish_reason):\n"
                                        "    return len(completion_ids) + (0.5 if finish_reason == 'stop' else 0)\n")
    got = eval_figures(str(tiny_model_dir), cfg)
    assert set(got) == {"reward_mean"} and 1.0 <= got["reward_mean"] <= 4.5
    assert eval_figures(str(tiny_model_dir), _custom(tmp_path)) is None


def test_what_the_launcher_reports_for_each_kind_of_held_out_set(tmp_path: Path):
    cfg = _custom(tmp_path)
    assert heldout_label(cfg) == "no held-out set"
    assert heldout_label(load_config(None, [])) == "held-out acc   -  "
    assert heldout_label(_custom(tmp_path, f"prompts.eval_path={tmp_path / 'eval.jsonl'}")) == "eval   -  "
    builtin = {"version": 25, "accuracy": 0.5}
    assert eval_label(builtin) == "held-out acc 0.500@v25"
    assert eval_record(builtin) == {"kind": "eval", "version": 25, "eval/heldout_accuracy": 0.5}
    mine = {"version": 5, "reward_mean": 0.25, "accuracy": 0.25}
    assert eval_label(mine) == "eval acc 0.250@v5"
    assert eval_record(mine) == {"kind": "eval", "version": 5, "eval/reward_mean": 0.25, "eval/accuracy": 0.25}
    graded = {"version": 5, "reward_mean": 0.7}
    assert eval_label(graded) == "eval reward 0.700@v5" and "eval/accuracy" not in eval_record(graded)
    assert eval_summary(None, None) == {}
    assert eval_summary({"reward_mean": 0.2, "accuracy": 0.2}, {"reward_mean": 0.6, "accuracy": 0.6}) == {
        "eval_reward_start": 0.2, "eval_reward_end": 0.6, "eval_accuracy_start": 0.2, "eval_accuracy_end": 0.6}
    assert eval_summary({"reward_mean": 0.2, "accuracy": 0.2}, {"reward_mean": 0.7}) == {
        "eval_reward_start": 0.2, "eval_reward_end": 0.7}


def test_stop_reasons():
    cfg = load_config(None, ["train.max_time_s=60"])
    assert stop_reason(cfg, 10.0, False, False) is None
    assert "train.max_time_s=60" in stop_reason(cfg, 60.0, False, False)
    assert "SIGINT" in stop_reason(cfg, 1.0, True, False)
    assert "stop request" in stop_reason(cfg, 1.0, False, True)
    assert stop_reason(load_config(None, []), 1e9, False, False) is None  # 0: no budget
    with pytest.raises(ConfigError, match="train.max_time_s must be 0 or more"):
        load_config(None, ["train.max_time_s=-1"])
