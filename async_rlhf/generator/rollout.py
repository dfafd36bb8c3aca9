"""The policy handle environments generate with, driven by the generator actor's engine loop (pure: the
engine is reached through ``add_request``; tests drive it with plain callables).

    env coroutine                      EnginePolicy                          actor loop (one thread)
    await policy.generate(ctx) -> add_request("t<k>", ctx, max_tokens) -> engine.step() ... deltas
                                  tokens += delta, versions += [served version] <- on_output(...)
          <- Turn (resolved future)  <- finished                              pump(): coroutines resume

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

AddRequest = Callable[[str, list[int], int], None]
"""add_request(request_id, context_ids, max_tokens)."""


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

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)

    async def generate(self, context_ids: list[int]) -> Turn:
        """One turn after ``context_ids``; an empty turn (finish "length") when the context window is full."""
        room = min(self.max_new_tokens, self.max_model_len - len(context_ids))
        if room <= 0:
            return Turn([], [], [], "length")
        rid = f"{self.prefix}{next(self._ids)}"
        req = _Request(asyncio.get_running_loop().create_future())
        self.requests[rid] = req
        try:
            self._add_request(rid, list(context_ids), room)
        except Exception:
            del self.requests[rid]
            raise
        return await req.future

    def owns(self, request_id: str) -> bool:
        return request_id in self.requests

    def on_output(self, request_id: str, token_ids: list[int], logprobs: list[float], version: int,
                  finish_reason: str | None) -> None:
        """New tokens of one request (a delta); resolves its turn when ``finish_reason`` is set."""
        req = self.requests[request_id]
        if len(token_ids) != len(logprobs):
            raise ValueError(f"request {request_id}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        req.tokens += token_ids
        req.logprobs += logprobs
        req.versions += [version] * len(token_ids)
        if finish_reason is not None:
            del self.requests[request_id]
            if not req.future.done():
                req.future.set_result(Turn(req.tokens, req.logprobs, req.versions, finish_reason))

    def cancel_all(self) -> list[str]:
        """Fail every open turn (the loop is stopping); returns their request ids to abort in the engine."""
        ids = list(self.requests)
        for req in self.requests.values():
            if not req.future.done():
                req.future.cancel()
        self.requests.clear()
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
