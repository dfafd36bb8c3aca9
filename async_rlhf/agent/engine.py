"""The seam between the agent endpoint (``endpoint.py``) and an engine that samples token ids.

The endpoint never sees text going to the engine: it sends the ledger's prompt ids and gets sampled ids back, each
with its behaviour log-prob and the policy version that sampled it (a turn may span a weight push). The generator
actor's vLLM engine loop implements it (same admission, staleness bound and version
stamping as every other request, stop ids those of ``async_rlhf.tokenizer.stop_token_ids``: ``policy_engine.py``); the
unit tests of the HTTP layer use a scripted fake.

    class TokenEngine(Protocol):
        async def generate(prompt_ids, params: SamplingSpec) -> EngineResult
    class StreamingTokenEngine(TokenEngine, Protocol):       # optional: streamed answers as the tokens come
        def stream(prompt_ids, params) -> AsyncIterator[EngineChunk]   # the last chunk has finish_reason set
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

EPISODE: ContextVar[str | None] = ContextVar("agent_episode", default=None)
"""The episode a ``generate``/``stream`` call samples for (set by the endpoint around each engine call): an engine
that keeps per-episode records (the generator's, which checks the trained ids against its outputs) reads it."""


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling parameters of one request, as the agent sent them (the engine may clamp ``max_tokens`` to the
    context left)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    """None: the engine's own limit."""
    stop: tuple[str, ...] = ()
    """Stop strings (the engine also stops on the model's stop ids). The sampled ids that spell one stay in the
    turn: what was sampled is what is trained, and the content the agent sends back must match the ledger."""
    seed: int | None = None


@dataclass(frozen=True)
class EngineResult:
    """A finished generation: one log-prob and one policy version per sampled id."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str = "stop"
    """``stop`` (a stop id or string) or ``length``."""

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(f"token_ids ({len(self.token_ids)}), logprobs ({len(self.logprobs)}) and versions "
                             f"({len(self.versions)}) must have one length")


@dataclass(frozen=True)
class EngineChunk:
    """Ids sampled since the last chunk of a stream; ``finish_reason`` is set on the last chunk only."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@runtime_checkable
class TokenEngine(Protocol):
    async def generate(self, prompt_ids: list[int], params: SamplingSpec) -> EngineResult: ...


@runtime_checkable
class StreamingTokenEngine(TokenEngine, Protocol):
    def stream(self, prompt_ids: list[int], params: SamplingSpec) -> AsyncIterator[EngineChunk]: ...


async def stream_of(engine: TokenEngine, prompt_ids: list[int], params: SamplingSpec) -> AsyncIterator[EngineChunk]:
    """The engine's stream, or its one answer as a single final chunk when it cannot stream."""
    if isinstance(engine, StreamingTokenEngine):
        async for chunk in engine.stream(prompt_ids, params):
            yield chunk
        return
    result = await engine.generate(prompt_ids, params)
    yield EngineChunk(list(result.token_ids), list(result.logprobs), list(result.versions), result.finish_reason)
