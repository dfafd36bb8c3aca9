"""The policy handle environments generate with, driven by the generator actor's engine loop (pure: the
engine is reached through ``add_request``; tests drive it with plain callables).

    env coroutine                      EnginePolicy                          actor loop (one thread)
    await policy.generate(ctx) -> queued as turn "t<k>"
                                  flush() (next loop pass, or before the
                                  engine steps): one add_request per
                                  distinct (ctx, max_tokens), n = turns  -> engine.step() ... deltas
                                  tokens += delta, versions += [served version] <- on_output(id, .., index)
          <- Turn (resolved future)  <- finished                              pump(): coroutines resume

The turns of one group start together with the same context (a single-turn environment's group_size
rollouts of one prompt): they go to vLLM as one request of n samples, which it prepares once instead of n
times (preparing a request cost a sixth of a generator's time on the tiny model when each went alone).
Every token carries the version that was being served when it came out of the engine, so a turn that spans
an in-flight weight swap is stamped exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rlhf.env.base import Trajectory, Turn
from async_rlhf.types import Group

AddRequest = Callable[[str, list[int], int, int], None]
"""add_request(request_id, context_ids, max_tokens, n): n samples after one context under one request id
(the engine's outputs then name the sample by its index, 0..n-1)."""


@dataclass
class _Request:
    future: asyncio.Future[Turn]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class EnginePolicy:
    """Implements ``async_rlhf.env.base.Policy`` on top of the actor's engine."""

    def __init__(self, add_request: AddRequest, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], max_new_tokens: int, max_model_len: int,
                 prefix: str = "t") -> None:
        self._add_request = add_request
        self._encode = encode
        self._decode = decode
        self.max_new_tokens = max_new_tokens
        self.max_model_len = max_model_len
        self.version = 0
        self.prefix = prefix
        self._ids = itertools.count()
        self.requests: dict[str, _Request] = {}
        """Open turns by turn id (queued or in the engine)."""
        self._queued: list[tuple[str, list[int], int]] = []
        """Turns asked for since the last flush: (turn id, context, max_tokens)."""
        self._in_engine: dict[str, list[str]] = {}
        """Engine request id -> the turn id of each of its sample indexes (a single turn: its own id)."""

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)

    async def generate(self, context_ids: list[int], max_tokens: int | None = None) -> Turn:
        """One turn after ``context_ids`` of at most ``max_tokens`` (and ``max_new_tokens``); an empty turn
        (finish "length") when the context window is full."""
        room = min(self.max_new_tokens, self.max_model_len - len(context_ids))
        if max_tokens is not None:
            room = min(room, max_tokens)
        if room <= 0:
            return Turn([], [], [], "length")
        rid = f"{self.prefix}{next(self._ids)}"
        loop = asyncio.get_running_loop()
        req = _Request(loop.create_future())
        self.requests[rid] = req
        if not self._queued:
            loop.call_soon(self.flush)  # after every coroutine started in this pass has asked for its turn
        self._queued.append((rid, list(context_ids), room))
        return await req.future

    def flush(self) -> None:
        """Send the queued turns to the engine: one request per distinct (context, max_tokens), of as many
        samples as turns asked for it. A request the engine refuses fails its turns (their ``generate``
        raises). Idempotent; the actor also calls it before an engine step."""
        queued, self._queued = self._queued, []
        same: dict[tuple[tuple[int, ...], int], list[str]] = {}
        for rid, context, room in queued:
            if rid in self.requests and not self.requests[rid].future.done():  # not cancelled meanwhile
                same.setdefault((tuple(context), room), []).append(rid)
            else:
                self.requests.pop(rid, None)
        for (context, room), rids in same.items():
            engine_id = rids[0] if len(rids) == 1 else f"{self.prefix}n{next(self._ids)}"
            self._in_engine[engine_id] = rids
            try:
                self._add_request(engine_id, list(context), room, len(rids))
            except Exception as exc:
                del self._in_engine[engine_id]
                for rid in rids:
                    self.requests.pop(rid).future.set_exception(exc)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` (an engine request id) is one of this policy's open requests."""
        return request_id in self._in_engine

    def on_output(self, request_id: str, token_ids: list[int], logprobs: list[float], version: int,
                  finish_reason: str | None, index: int = 0) -> None:
        """New tokens of sample ``index`` of engine request ``request_id`` (a delta); resolves its turn when
        ``finish_reason`` is set."""
        turns = self._in_engine[request_id]
        rid = turns[index]
        req = self.requests[rid]
        if len(token_ids) != len(logprobs):
            raise ValueError(f"request {rid}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        req.tokens += token_ids
        req.logprobs += logprobs
        req.versions += [version] * len(token_ids)
        if finish_reason is not None:
            del self.requests[rid]
            if not any(r in self.requests for r in turns):
                del self._in_engine[request_id]
            if not req.future.done():
                req.future.set_result(Turn(req.tokens, req.logprobs, req.versions, finish_reason))

    def cancel_all(self) -> list[str]:
        """Fail every open turn (the loop is stopping); returns the engine request ids to abort."""
        ids = list(self._in_engine)
        for req in self.requests.values():
            if not req.future.done():
                req.future.cancel()
        self.requests.clear()
        self._in_engine.clear()
        self._queued.clear()
        return ids

    def __len__(self) -> int:
        return len(self.requests)


def to_group(group_id: str, prompt_ids: list[int], trajectories: list[Trajectory], final_rewards: list[float],
             generator: int, meta: dict[str, Any], start_version: int, t_start: float) -> Group:
    """The buffer's record of one prompt group; ``final_rewards`` (one per trajectory) add to the returns."""
    if len(final_rewards) != len(trajectories):
        raise ValueError(f"{len(final_rewards)} rewards for {len(trajectories)} trajectories")
    samples = [t.to_sample(r) for t, r in zip(trajectories, final_rewards)]
    return Group(group_id, np.asarray(prompt_ids, np.int32), samples, generator,
                 {**meta, "start_version": start_version}, t_start, time.time())
