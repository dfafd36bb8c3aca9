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


def _texts(items: list[tuple[int, Prompt]]) -> list[tuple[int, str]]:
    return [(seq, p.text) for seq, p in items]


def test_redis_prompts_survive_a_generator_restart_without_replay(tmp_path: Path):
    """Issue 44, defect 3: a restarted generator (or a resume) continues a Redis stream from what Redis recorded,
    never by reading and discarding ``start`` new entries. Its re-issued positions come back with their own prompts,
    a position it drew that the driver never saw comes back under its key, and an empty stream means "nothing
    ready" (no StopIteration), so every entry is trained once and none is eaten."""
    from async_rlhf.generator.stream import PromptStream

    server = RedisServer(tmp_path / "redis").start()
    try:
        push_prompts(server.url, "t:prompts", ROWS[:5])
        first = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-0"))
        assert first._problems.prefetch(3) == 3
        drawn = [next(first) for _ in range(3)]  # positions 1, 2, 3 <- entries 0, 1, 2
        assert _texts(drawn) == [(i + 1, ROWS[i]["prompt"]) for i in range(3)]
        # the generator dies: the driver saw position 2 (not 3); 2 was trained, 1 was in flight (re-issued)
        again = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-0"), start=2, reissue=[1])
        source = again._problems
        assert source.prefetch(10) == 3  # position 3 (drawn, never seen by the driver), then entries 3 and 4
        got = [next(again) for _ in range(1 + 3)]
        assert _texts(got) == [(1, ROWS[0]["prompt"]), (3, ROWS[2]["prompt"]), (4, ROWS[3]["prompt"]),
                               (5, ROWS[4]["prompt"])]
        assert source.prefetch(4) == 0  # an empty stream: nothing ready, the generator asks again later
        push_prompts(server.url, "t:prompts", ROWS[5:6])
        assert source.prefetch(4) == 1 and _texts([next(again)]) == [(6, ROWS[5]["prompt"])]
        # a restart with nothing left in the stream: nothing is read to reach the position, no StopIteration
        late = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-0"), start=6, reissue=[4])
        assert _texts([next(late)]) == [(4, ROWS[3]["prompt"])] and late._problems.prefetch(2) == 0
        # positions the buffer holds beyond the driver's position are skipped, never drawn again
        skip = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-0"), start=3, skip=[4, 6])
        assert skip._problems.prefetch(5) == 1 and _texts([next(skip)]) == [(5, ROWS[4]["prompt"])]
    finally:
        server.stop()


def test_redis_prompt_positions_are_per_run_and_no_entry_read_is_lost(tmp_path: Path, monkeypatch):
    """A fresh run (another ``run.id``) on the same stream starts at position 1 with new entries, never an earlier
    run's records; an entry delivered to a consumer that died before recording it is drawn at its next start, or
    claimed by another consumer once idle (it never comes back)."""
    import redis

    from async_rlhf.generator.stream import PromptStream
    from async_rlhf.prompts import redis_stream

    server = RedisServer(tmp_path / "redis").start()
    r = redis.Redis.from_url(server.url)
    try:
        push_prompts(server.url, "t:p", ROWS[:4])
        run_a = PromptStream(RedisStreamPrompts(server.url, "t:p", "generator-0", scope="a"))
        assert run_a._problems.prefetch(2) == 2 and _texts([next(run_a)]) == [(1, ROWS[0]["prompt"])]
        run_b = PromptStream(RedisStreamPrompts(server.url, "t:p", "generator-0", scope="b"))
        assert run_b._problems.prefetch(1) == 1 and _texts([next(run_b)]) == [(1, ROWS[2]["prompt"])]
        # generator-1 reads an entry and dies before recording it: delivered, not acknowledged
        r.xreadgroup(redis_stream.GROUP, "generator-1", {"t:p": ">"}, count=1)
        assert r.xpending("t:p", redis_stream.GROUP)["pending"] == 1
        again = PromptStream(RedisStreamPrompts(server.url, "t:p", "generator-1", scope="b"))
        assert again._problems.prefetch(3) == 1 and _texts([next(again)]) == [(1, ROWS[3]["prompt"])]
        assert r.xpending("t:p", redis_stream.GROUP)["pending"] == 0
        # generator-2 dies the same way and never comes back: generator-0 claims its entry once it is idle
        push_prompts(server.url, "t:p", ROWS[4:5])
        r.xreadgroup(redis_stream.GROUP, "generator-2", {"t:p": ">"}, count=1)
        monkeypatch.setattr(redis_stream, "CLAIM_IDLE_S", 0.0)
        other = PromptStream(RedisStreamPrompts(server.url, "t:p", "generator-0", scope="b"), start=1)
        assert other._problems.prefetch(3) == 1 and _texts([next(other)]) == [(2, ROWS[4]["prompt"])]
        assert r.xpending("t:p", redis_stream.GROUP)["pending"] == 0
    finally:
        r.close()
        server.stop()


def test_prompts_of_a_generator_a_resume_drops_go_back_to_the_stream(tmp_path: Path):
    """A resume on fewer generators: what the dropped generator drew and nobody trained (outstanding in the
    driver's ledger, or drawn and never seen) goes back to the stream as new entries, once, and the dropped
    generator's own record no longer gives them out; what a durable buffer holds stays where it is."""
    from async_rlhf.generator.stream import PromptStream
    from async_rlhf.prompts.redis_stream import requeue_drawn

    server = RedisServer(tmp_path / "redis").start()
    try:
        push_prompts(server.url, "t:prompts", ROWS[:5])
        gone = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-1", scope="r1"))
        assert gone._problems.prefetch(4) == 4
        assert _texts([next(gone) for _ in range(4)]) == [(i + 1, ROWS[i]["prompt"]) for i in range(4)]
        # the driver saw position 3: 1 trained, 2 outstanding, 3 held by the buffer; 4 drawn, never seen
        given, top = requeue_drawn(server.url, "t:prompts", "generator-1", "r1", {2, 3}, 3, keep={3})
        assert (given, top) == ([2, 4], 4)
        again, _ = requeue_drawn(server.url, "t:prompts", "generator-1", "r1", {2, 3}, 3, keep={3})
        assert again == [2, 4]  # given back before: counted, not added to the stream twice
        stays = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-0", scope="r1"))
        assert stays._problems.prefetch(10) == 3  # entry 4 (never drawn), then the two given back
        assert sorted(p.text for _, p in (next(stays) for _ in range(3))) == sorted(
            [ROWS[4]["prompt"], ROWS[1]["prompt"], ROWS[3]["prompt"]])
        assert stays._problems.prefetch(10) == 0
        # generator 1 comes back later in the run (a scale-up): its given-back positions are not issued again
        back = PromptStream(RedisStreamPrompts(server.url, "t:prompts", "generator-1", scope="r1"), start=3,
                            reissue=[2], skip=[3])
        assert back._problems.prefetch(10) == 0 and back.reissue_left == 0
    finally:
        server.stop()
