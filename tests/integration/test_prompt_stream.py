"""Prompts from a real Redis stream, fed while generators poll it."""

import json
from pathlib import Path

import pytest

from async_rlhf.buffer.testing import RedisServer
from async_rlhf.env.base import Prompt
from async_rlhf.prompts.redis_stream import RedisStreamPrompts, push_prompts

pytestmark = pytest.mark.integration

ROWS = [{"prompt": f"{i:02d}+01=", "answer": f"{i + 1:03d}", "level": i % 3} for i in range(7)]


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
