"""Prompt sources: iterables, JSONL and Parquet files through datasets."""

import json
from pathlib import Path

import pytest

from async_rlhf.config import load_config
from async_rlhf.env.base import Prompt
from async_rlhf.env.registry import make_env
from async_rlhf.prompts.base import IterablePrompts, to_prompt
from async_rlhf.prompts.build import make_prompts
from async_rlhf.prompts.files import file_prompts

ROWS = [{"prompt": f"{i:02d}+01=", "answer": f"{i + 1:03d}", "level": i % 3} for i in range(7)]


def test_to_prompt_and_iterables():
    assert to_prompt("hi") == Prompt("hi")
    assert to_prompt({"q": "hi", "answer": 3}, "q") == Prompt("hi", {"answer": 3})
    with pytest.raises(ValueError, match="prompts.text_field"):
        to_prompt({"question": "hi"})
    with pytest.raises(ValueError, match="give str, chat messages, dict or Prompt"):
        to_prompt(3)
    src = IterablePrompts(["a", {"prompt": "b", "x": 1}, Prompt("c")])
    assert src.prefetch(2) == 2 and next(src) == Prompt("a")
    assert src.prefetch(5) == 2  # one left over from before, one fetched now
    assert [p.text for p in src] == ["b", "c"] and src.prefetch(1) == 0


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_file_prompts_through_datasets_cycle_reshuffled(tmp_path: Path, fmt: str):
    path = tmp_path / f"prompts.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(ROWS), path)
    src = file_prompts(str(path), seed=1)
    first, second = [next(src) for _ in range(7)], [next(src) for _ in range(7)]
    by_text = {r["prompt"]: r for r in ROWS}
    assert sorted(p.text for p in first) == sorted(by_text) == sorted(p.text for p in second)
    assert [p.text for p in first] != [p.text for p in second] or len(ROWS) < 3
    for p in first:
        assert p.data == {"answer": by_text[p.text]["answer"], "level": by_text[p.text]["level"]}
    cfg = load_config(None, ["task.name=custom", "prompts.source=file", f"prompts.path={path}",
                             "rewards.sources=function", "rewards.function=m:f"])
    built = make_prompts(cfg, make_env(cfg.task), seed=1, consumer="t")
    assert [next(built).text for _ in range(7)] == [p.text for p in first]
    with pytest.raises(ValueError, match="unknown format"):
        file_prompts(str(tmp_path / "x.csv"))


def test_python_source_names_a_function_returning_an_iterable(tmp_path: Path):
    (tmp_path / "my_prompts.py").write_text(
        "def prompts():\n    return ({'prompt': f'{i}+1=', 'answer': i + 1} for i in range(3))\n")
    cfg = load_config(None, ["task.name=custom", "prompts.source=python",
                             f"prompts.path={tmp_path / 'my_prompts.py'}:prompts",
                             "rewards.sources=function", "rewards.function=m:f"])
    src = make_prompts(cfg, make_env(cfg.task), seed=0, consumer="t")
    assert src.prefetch(5) == 3
    assert [next(src) for _ in range(3)] == [Prompt(f"{i}+1=", {"answer": i + 1}) for i in range(3)]


def test_file_prompts_are_partitioned_across_the_fleet(tmp_path: Path):
    """Three generators draw disjoint strides of one seeded sequence of epochs: together, each prompt once per
    epoch; a restarted generator (a new source, stream resumed at its position) continues exactly its stride."""
    from async_rlhf.generator.stream import PromptStream

    rows = [{"prompt": f"p{i}", "answer": i} for i in range(10)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["task.name=custom", "prompts.source=file", f"prompts.path={path}", "generators=3",
                             "rewards.sources=function", "rewards.function=m:f", "train.seed=4"])
    env = make_env(cfg.task)
    # per-generator seeds differ (as the generators pass them): the lane, not the seed, decides the stride
    fleet = [make_prompts(cfg, env, seed=100 + g, consumer=f"g{g}", lane=(g, 3)) for g in range(3)]
    drawn = [[next(src).text for _ in range(10)] for src in fleet]  # 30 draws: three epochs of 10
    merged = [drawn[k % 3][k // 3] for k in range(30)]  # the shared global order, position k from lane k % 3
    for epoch in range(3):
        assert sorted(merged[10 * epoch:10 * epoch + 10]) == sorted(r["prompt"] for r in rows), epoch
    assert merged[:10] != merged[10:20], "a new order every epoch"
    # one sequence: lanes=1 with the shared seed is that global order
    one = file_prompts(str(path), seed=4)
    assert [next(one).text for _ in range(30)] == merged
    # generator 1 restarted after drawing 4 prompts, with 2 and 4 re-issued: the same prompts, then its stride
    restarted = PromptStream(make_prompts(cfg, env, seed=7, consumer="g1", lane=(1, 3)), start=4, reissue=[2, 4])
    assert [p.text for _, p in (next(restarted) for _ in range(5))] == [drawn[1][i] for i in (1, 3, 4, 5, 6)]
    # without a lane (a generator beyond the configured fleet) the draw is its own shuffle, as before
    alone = make_prompts(cfg, env, seed=1, consumer="g3")
    own = file_prompts(str(path), seed=1)
    assert [next(alone).text for _ in range(10)] == [next(own).text for _ in range(10)]
    with pytest.raises(ValueError, match="lane 3 of 3"):
        next(file_prompts(str(path), lane=3, lanes=3))


def test_python_prompts_are_partitioned_across_the_fleet(tmp_path: Path):
    (tmp_path / "my_prompts.py").write_text(
        "def prompts():\n    return ({'prompt': f'{i}+1=', 'answer': i + 1} for i in range(7))\n")
    cfg = load_config(None, ["task.name=custom", "prompts.source=python",
                             f"prompts.path={tmp_path / 'my_prompts.py'}:prompts",
                             "rewards.sources=function", "rewards.function=m:f"])
    got = [[p.text for p in make_prompts(cfg, make_env(cfg.task), seed=0, consumer="t", lane=(g, 2))]
           for g in range(2)]
    assert got == [["0+1=", "2+1=", "4+1=", "6+1="], ["1+1=", "3+1=", "5+1="]]
