"""The HTTP scorer against a real server: requests overlap, connections are kept alive, and a slow, silent or
wrong scorer is a RewardError naming it."""

import asyncio
import gc
import time
import warnings
from urllib.parse import urlsplit

import pytest

from async_rlhf.env.base import Prompt
from async_rlhf.rewards.base import RewardError
from async_rlhf.rewards.http import HttpScorer
from async_rlhf.rewards.scorer_server import ScorerServer

pytestmark = pytest.mark.integration

PROMPT = Prompt("12+30=", {"answer": "042"})


def test_http_scorer_against_a_real_server_slow_silent_and_broken():
    server = ScorerServer(delay_s=0.3)
    try:
        scorer = HttpScorer(server.url, timeout_s=5.0)

        async def many() -> tuple[list, float]:
            t0 = time.monotonic()
            out = await asyncio.gather(*(scorer.score(PROMPT, ["042", "41", "x"]) for _ in range(40)))
            return out, time.monotonic() - t0

        out, took = asyncio.run(many())
        assert all(r == [1.0, 0.0, 0.0] for r in out) and server.requests == 40
        assert took < 0.3 * 40 / 4, f"40 requests of 0.3 s took {took:.1f} s: they did not overlap"
        server.drop = 1.0
        with pytest.raises(RewardError, match="TimeoutError"):
            asyncio.run(HttpScorer(server.url, timeout_s=0.5).score(PROMPT, ["042"]))
        server.drop = 0.0
        server.fn = lambda p, c, d: "not a number"
        with pytest.raises(RewardError, match="finite number"):
            asyncio.run(scorer.score(PROMPT, ["042"]))
    finally:
        server.close()
    with pytest.raises(RewardError, match="failed"):
        asyncio.run(HttpScorer(server.url, timeout_s=2.0).score(PROMPT, ["042"]))  # nobody listens any more
    with pytest.raises(RewardError, match="must be http"):
        asyncio.run(HttpScorer("ftp://host/x").score(PROMPT, ["042"]))


def test_http_scorer_keeps_its_connections_alive():
    server = ScorerServer()
    try:
        scorer = HttpScorer(server.url, timeout_s=5.0)

        async def one_after_another() -> list[list[float]]:
            return [await scorer.score(PROMPT, ["042"]) for _ in range(20)]

        assert asyncio.run(one_after_another()) == [[1.0]] * 20
        assert server.requests == 20 and server.connections == 1, "each request opened its own connection"
    finally:
        server.close()


def test_http_scorer_closes_its_connections_when_closed():
    """The generator closes its reward sources before its event loop: the scorer sees the connection end."""
    server = ScorerServer()
    loop = asyncio.new_event_loop()
    try:
        scorer = HttpScorer(server.url, timeout_s=5.0)
        assert loop.run_until_complete(scorer.score(PROMPT, ["042"])) == [1.0]
        assert server.connections == 1 and server.connections_closed == 0
        scorer.close()
        deadline = time.monotonic() + 5
        while server.connections_closed < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections_closed == 1, "the scorer's connection stayed open after close()"
        scorer.close()  # again: nothing left to close
        assert loop.run_until_complete(scorer.score(PROMPT, ["1"])) == [0.0]  # usable again: a new client
        assert server.connections == 2
    finally:
        loop.close()
        server.close()


def test_http_scorer_closes_the_earlier_loops_connections_when_it_moves_to_a_new_loop():
    """A client cannot move between event loops: the scorer opens one on the new loop and closes the old one's
    connections on the old loop, instead of leaving them open until garbage collection."""
    server = ScorerServer()
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        gc.collect()
        scorer = HttpScorer(server.url, timeout_s=5.0)
        assert first.run_until_complete(scorer.score(PROMPT, ["042"])) == [1.0]
        with warnings.catch_warnings(record=True) as caught:  # dropped unclosed, its transport would warn
            warnings.simplefilter("always")
            assert second.run_until_complete(scorer.score(PROMPT, ["042"])) == [1.0]
            gc.collect()
        port = str(urlsplit(server.url).port)  # sockets of earlier tests' scorers may be collected here too
        ours = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning) and port in str(w.message)]
        assert not ours, ours
        deadline = time.monotonic() + 5
        while server.connections_closed < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections == 2 and server.connections_closed == 1, "the first loop's connection stayed open"
        scorer.close()
        while server.connections_closed < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.connections_closed == 2
    finally:
        first.close()
        second.close()
        server.close()
