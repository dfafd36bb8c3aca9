"""The episodes an agent endpoint serves: one ``EpisodeLedger`` each, calls serialized, deadlines, idempotency.

    registry = EpisodeRegistry(tokenizer, timeout_s=600, stop_token_ids=stops)
    future = registry.submit("ep1", key, messages, tools, sample)   # sample: async (prompt_ids) -> EngineResult
    turn = await asyncio.shield(future)                            # the RecordedTurn to answer with
    episode = registry.close("ep1")                                # its ledger's branches become samples

Decisions:
  - **One call of an episode at a time** (``Episode.lock``, held from ``ledger.plan`` to ``ledger.record``). An
    agent's calls are sequential by nature (each sends the last reply back); serialized, every plan sees the record
    before it, so each call extends the branch exactly (two calls planned on one history would make a sibling
    branch, see ledger.py) and reuses the prefix the engine just cached. Calls of different episodes run
    concurrently. An agent that fans out inside one episode waits; one that needs parallel sub-agents gives them
    their own episodes.
  - **A call runs as its own task**, not in the HTTP handler: a client that goes away (its read timed out, its
    process died) does not cancel the generation half-way; the turn is recorded and the SDK's retry gets it.
  - **Idempotency.** The key of a call is its ``Idempotency-Key`` header when the agent sets one. The stock
    ``openai`` SDK sets none on chat completions (its ``_idempotency_header`` is None); it retries with the same
    body and ``x-stainless-retry-count: n``. So without a header the key is the body's digest plus a count: a
    first attempt (count 0 or absent) gets a new key, a retry (count > 0) the key of the latest call with that
    body. A retry whose call is in flight waits for it (the same task) and answers the same turn; a finished one
    gets the recorded turn (``ledger.plan`` replays it). One turn either way; ``ledger.counters["retries"]``
    counts both.
  - **Deadline** (``created_at + timeout_s``). A call arriving after it, or getting the lock after it, is refused
    with 408 and the episode is marked ``timeout`` (``counters["timeouts"]``); a call already sampling finishes
    and is recorded: the deadline ends the episode, it never kills a generation (so the longest episodes are not
    the ones cut short, and what was sampled stays consistent). 408 goes out with ``x-should-retry: false`` (the
    SDK retries a bare 408).
  - **Closed episodes** answer 410. Without ``auto_open`` an unknown episode answers 404 (the rollout side opens
    each episode before it hands the agent its URL); with it (the default) the first call opens it.

Thread-safety: none needed; everything runs on the serving event loop (the ledger is synchronous).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_rlhf.agent.engine import EngineResult
from async_rlhf.agent.ledger import EpisodeLedger
from async_rlhf.agent.tool_calls import ToolCallParser
from async_rlhf.agent.turns import RecordedTurn

Sampler = Callable[[list[int]], Awaitable[EngineResult]]
"""What a call does with the plan's prompt ids: sample them (the endpoint's closure over the engine)."""


class EndpointError(Exception):
    """A refused call, as the OpenAI-style error the endpoint answers with."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry: bool | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry = retry
        """``x-should-retry`` for the SDK (None: let it decide by status)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Episode:
    episode_id: str
    ledger: EpisodeLedger
    created_at: float
    deadline: float | None
    status: str = "open"
    """``open``, ``timeout`` (its deadline passed) or ``closed``."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    inflight: dict[str, asyncio.Future[RecordedTurn]] = field(default_factory=dict)
    latest_key: dict[str, str] = field(default_factory=dict)
    """Body digest -> the key of the latest call with that body (what a body-matched retry reuses)."""
    calls: int = 0
    timed_out: bool = False
    """Set when the episode is taken: it had passed its deadline (``status`` then reads ``closed``)."""

    def key(self, header: str | None, digest: str, retry_count: int) -> str:
        """The idempotency key of a call (see the module docstring)."""
        if header:
            return f"key:{header}"
        if retry_count > 0 and digest in self.latest_key:
            return self.latest_key[digest]
        self.calls += 1
        key = self.latest_key[digest] = f"body:{digest}:{self.calls}"
        return key


class EpisodeRegistry:
    """Episode id -> ``Episode`` (its ledger made on open with the tokenizer)."""

    def __init__(self, tokenizer: Any, *, timeout_s: float | None = None,
                 stop_token_ids: Sequence[int] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None, tool_parser: str | ToolCallParser = "hermes",
                 auto_open: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.stop_token_ids = stop_token_ids
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.parser = tool_parser if isinstance(tool_parser, ToolCallParser) else ToolCallParser(tokenizer,
                                                                                                 tool_parser)
        self.auto_open = auto_open
        self.clock = clock
        self.episodes: dict[str, Episode] = {}
        self.counters = {"episodes": 0, "timeouts": 0}

    def open(self, episode_id: str, timeout_s: float | None = None) -> Episode:
        """Start an episode (``timeout_s``: this one's, default the registry's; None: no deadline)."""
        if episode_id in self.episodes:
            raise ValueError(f"episode {episode_id!r} is already open")
        ledger = EpisodeLedger(self.tokenizer, self.chat_template_kwargs, episode_id=episode_id,
                               stop_token_ids=self.stop_token_ids, tool_parser=self.parser)
        now = self.clock()
        limit = self.timeout_s if timeout_s is None else timeout_s
        ep = Episode(episode_id, ledger, now, None if limit is None else now + limit)
        self.episodes[episode_id] = ep
        self.counters["episodes"] += 1
        return ep

    def get(self, episode_id: str) -> Episode:
        """The episode a call names (opened here with ``auto_open``); EndpointError 404 or 410."""
        ep = self.episodes.get(episode_id)
        if ep is None:
            if not self.auto_open:
                raise EndpointError(404, f"no episode {episode_id!r} is open on this endpoint: use the URL the "
                                    "rollout gave the agent (.../s/<episode id>/v1)", code="episode_not_found")
            return self.open(episode_id)
        if ep.status == "closed":
            raise EndpointError(410, f"episode {episode_id!r} is closed: its samples are taken; a new episode "
                                "needs a new id", code="episode_closed")
        return ep

    def close(self, episode_id: str) -> Episode:
        """End an episode (later calls get 410); returns it, its ledger's branches to become samples. Calls still
        in flight are recorded into the ledger; await ``ep.inflight`` first to have them."""
        ep = self.episodes[episode_id]
        ep.status = "closed"
        return ep

    def check_deadline(self, ep: Episode) -> None:
        if ep.status == "timeout" or (ep.deadline is not None and self.clock() > ep.deadline):
            if ep.status == "open":
                ep.status = "timeout"
                self.counters["timeouts"] += 1
            limit = ep.deadline - ep.created_at if ep.deadline is not None else 0.0
            raise EndpointError(408, f"episode {ep.episode_id!r} passed its deadline ({limit:g} s after its first "
                                "call) and ended as 'timeout': no more calls are served in it; end the agent's run "
                                "(a larger agent timeout gives longer episodes room)", type_="timeout_error",
                                code="episode_timeout", retry=False)

    def submit(self, episode_id: str, key: str | Callable[[Episode], str], messages: Sequence[Any],
               tools: Sequence[Any] | None, sample: Sampler) -> asyncio.Future[RecordedTurn]:
        """Start (or join) one call: the future of its recorded turn. Raises EndpointError for an episode that
        cannot take calls; the future raises EndpointError 400 for messages the template cannot render, 408 past
        the deadline, or what ``sample`` raised. ``key``: the call's idempotency key, or a function of the episode
        giving it. Await it through ``asyncio.shield`` so a caller that goes away does not cancel it."""
        ep = self.get(episode_id)
        key = key(ep) if callable(key) else key
        joined = ep.inflight.get(key)
        if joined is not None:  # a retry while its call is sampling: the same turn
            ep.ledger.counters["retries"] += 1
            return joined
        self.check_deadline(ep)
        task = asyncio.ensure_future(self._call(ep, key, messages, tools, sample))
        ep.inflight[key] = task

        def done(t: asyncio.Future[RecordedTurn]) -> None:
            if ep.inflight.get(key) is t:
                del ep.inflight[key]
            if not t.cancelled():
                t.exception()  # retrieved: a caller that went away leaves no "never retrieved" warning

        task.add_done_callback(done)
        return task

    async def _call(self, ep: Episode, key: str, messages: Sequence[Any], tools: Sequence[Any] | None,
                    sample: Sampler) -> RecordedTurn:
        async with ep.lock:
            recorded = ep.ledger.recorded(key)
            if recorded is None:
                self.check_deadline(ep)  # a call that waited past the deadline; a replay is still answered
            try:
                plan = ep.ledger.plan(messages, tools, key)
            except ValueError as exc:
                raise EndpointError(400, f"{exc}. Send OpenAI chat messages (role, content as text) in an order "
                                    "the model's chat template accepts", code="invalid_messages",
                                    param="messages") from exc
            if plan.replay is not None:
                return plan.replay
            result = await sample(plan.prompt_ids)
            return ep.ledger.record(plan, result.token_ids, result.logprobs, result.versions, result.finish_reason)
