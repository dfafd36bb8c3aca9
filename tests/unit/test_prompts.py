"""Prompt sources: iterables, JSONL and Parquet files through datasets, a real Redis stream fed mid-way."""

import json
from pathlib import Path

import pytest

from async_rlhf.buffer.testing import RedisServer
from async_rlhf.config import load_config
from async_rlhf.env.base import Prompt
from async_rlhf.env.registry import make_env
from async_rlhf.prompts.base import IterablePrompts, to_prompt
from async_rlhf.prompts.build import make_prompts
from async_rlhf.prompts.files import file_prompts
from async_rlhf.prompts.redis_stream import RedisStreamPrompts, push_prompts

ROWS = [{"prompt": f"{i:02d}+01=", "answer": f"{i + 1:03d}", "level": i % 3} for i in range(7)]


def test_to_prompt_and_iterables():
    assert to_prompt("hi") == Prompt("hi")
    assert to_prompt({"q": "hi", "answer": 3}, "q") == Prompt("hi", {"answer": 3})
    with pytest.raises(ValueError, match="prompts.text_field"):
        to_prompt({"question": "hi"})
    with pytest.raises(ValueError, match="give str, dict or Prompt"):
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


def test_redis_stream_prompts_arrive_while_consumers_poll(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        a = RedisStreamPrompts(server.url, "t:prompts", consumer="gen-a")
        b = RedisStreamPrompts(server.url, "t:prompts", consumer="gen-b")
        assert a.prefetch(4) == 0 and b.prefetch(4) == 0  # nothing yet, and no blocking
        assert push_prompts(server.url, "t:prompts", ROWS[:5]) == 5
        got_a = [next(a) for _ in range(a.prefetch(3))]
        got_b = [next(b) for _ in range(b.prefetch(10))]
        assert len(got_a) == 3 and len(got_b) == 2  # every prompt to exactly one consumer
        texts = sorted(p.text for p in got_a + got_b)
        assert texts == sorted(r["prompt"] for r in ROWS[:5])
        assert got_a[0].data == {"answer": ROWS[0]["answer"], "level": ROWS[0]["level"]}
        import redis

        r = redis.Redis.from_url(server.url)
        r.xadd("t:prompts", {"question": "no prompt field"})
        r.xadd("t:prompts", {"prompt": "05+05=", "data": json.dumps({"answer": "010"})})
        assert a.prefetch(5) == 1 and a.bad == 1 and next(a) == Prompt("05+05=", {"answer": "010"})
        assert r.xpending("t:prompts", "async_rlhf-generators")["pending"] == 0  # all acknowledged
        a.close(), b.close(), r.close()
    finally:
        server.stop()


def test_python_source_names_a_function_returning_an_iterable(tmp_path: Path):
    (tmp_path / "my_prompts.py").write_text(
        "def prompts():\n    return ({'prompt': f'{i}+1=', 'answer': i + 1} for i in range(3))\n")
    cfg = load_config(None, ["task.name=custom", "prompts.source=python",
                             f"prompts.path={tmp_path / 'my_prompts.py'}:prompts",
                             "rewards.sources=function", "rewards.function=m:f"])
    src = make_prompts(cfg, make_env(cfg.task), seed=0, consumer="t")
    assert src.prefetch(5) == 3
    assert [next(src) for _ in range(3)] == [Prompt(f"{i}+1=", {"answer": i + 1}) for i in range(3)]
