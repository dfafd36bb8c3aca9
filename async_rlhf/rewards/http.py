"""A remote scorer over HTTP: one POST per prompt group on the generator's event loop (httpx's asyncio
client: keep-alive connections, chunked or sized answers, no thread per request), so hundreds of slow requests
can be outstanding while the engine keeps stepping.

Request body (JSON): ``{"prompt": str, "completions": [str, ...], "data": {...}}``, plus ``"completion_ids"``
(a list of token ids per completion) and ``"finish_reasons"`` (``stop`` or ``length`` per completion) for
the generator's completions;
answer: ``{"rewards": [float, ...]}``, one per completion. ``async_rlhf.rewards.scorer_server`` is a
reference server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from async_rlhf.config.secrets import mask_url
from async_rlhf.env.base import Prompt
from async_rlhf.rewards.base import Completion, RewardError, RewardSource, check_rewards

MAX_CONNECTIONS = 256
"""Open connections per scorer and event loop (requests beyond it queue in the client's pool)."""
CLOSE_TIMEOUT_S = 5.0
"""Longest wait for an earlier loop's client to close its connections when a scorer moves to a new loop."""


def check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RewardError(f"scorer url {mask_url(url)!r} must be http://host[:port]/path or https://...")


class JsonPoster:
    """POSTs JSON to one URL through an ``httpx.AsyncClient`` of the running event loop (a client cannot move
    between loops: a new loop, e.g. a new ``asyncio.run``, gets its own)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        check_url(url)
        self.url, self.timeout_s = url, timeout_s
        self.shown = mask_url(url)  # what messages name: never the password
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client_for_this_loop(self) -> Any:
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._close_client(running=loop)  # the earlier loop's client: its connections end on that loop
            limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS)
            self._client, self._loop = httpx.AsyncClient(timeout=self.timeout_s, limits=limits), loop
        return self._client

    def close(self) -> None:
        """Close the client's keep-alive connections on the loop that opened them, if that loop can still run
        (call it before closing the loop; a closed loop leaves the sockets to the garbage collector)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # the usual case: called outside any loop
            running = None
        self._close_client(running)

    def _close_client(self, running: asyncio.AbstractEventLoop | None) -> None:
        """Close the client on its own loop: scheduled there if that loop runs (in another thread), else run to
        completion, on a helper thread when this thread is running a loop (``running``), which forbids running
        a second one here."""
        client, loop, self._client, self._loop = self._client, self._loop, None, None
        if client is None or loop is None or loop.is_closed():
            return
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(client.aclose(), loop)
        elif running is None:
            loop.run_until_complete(client.aclose())
        else:
            closer = threading.Thread(target=loop.run_until_complete, args=(client.aclose(),), daemon=True)
            closer.start()
            closer.join(CLOSE_TIMEOUT_S)

    async def post(self, payload: object) -> object:
        """The decoded JSON answer; any failure is a :class:`RewardError` naming the scorer and the cause."""
        import httpx

        try:
            response = await self._client_for_this_loop().post(self.url, json=payload)
        except httpx.TimeoutException as exc:
            raise RewardError(f"scorer {self.shown} failed: TimeoutError after {self.timeout_s:g} s "
                              f"({type(exc).__name__}); raise rewards.timeout_s if it is just slow") from None
        except httpx.HTTPError as exc:
            raise RewardError(f"scorer {self.shown} failed: {type(exc).__name__} {exc}") from None
        if response.status_code != 200:
            raise RewardError(f"scorer {self.shown} answered HTTP {response.status_code} {response.reason_phrase}")
        try:
            return response.json()
        except ValueError as exc:
            raise RewardError(f"scorer {self.shown} answered something that is not JSON: {exc}") from None


def request_body(prompt: Prompt, completions: Sequence[str]) -> dict[str, object]:
    """The JSON request: prompt, completions (text, special tokens stripped) and data; with the generator's
    completions also ``completion_ids`` and ``finish_reasons`` (one per completion, see ``rewards.base``)."""
    body: dict[str, object] = {"prompt": prompt.text, "completions": [str(c) for c in completions],
                               "data": prompt.data}
    known = [c for c in completions if isinstance(c, Completion)]
    if known and len(known) == len(completions):
        body["completion_ids"] = [c.token_ids for c in known]
        body["finish_reasons"] = [c.finish_reason for c in known]
    return body


class HttpScorer(RewardSource):
    name = "http"

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self.shown = mask_url(url)  # what messages name: never the password
        self.timeout_s = timeout_s
        self._poster: JsonPoster | None = None

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        if self._poster is None:  # the URL is checked on first use: a bad one fails the call, not the build
            self._poster = JsonPoster(self.url, self.timeout_s)
        answer = await self._poster.post(request_body(prompt, completions))
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"scorer {self.shown} answered {answer!r:.80}; expected {{\"rewards\": [...]}}")
        return check_rewards(answer["rewards"], len(completions), f"scorer {self.shown}")

    def close(self) -> None:
        if self._poster is not None:
            self._poster.close()
