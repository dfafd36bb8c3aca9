"""The ``TokenEngine`` of a generator: the agent endpoint's calls become turns of the generator's own engine loop.

    serving thread (uvicorn's loop)           generator loop thread (vLLM engine, GroupRunner's event loop)
    endpoint call -> PolicyEngine.generate
        run_coroutine_threadsafe(policy.generate(ids, max_tokens)) ──> EnginePolicy: queued turn, flushed into
                                                                        engine.add_request at the next pass;
                                                                        tokens stamped with the served version
        await wrap_future(...)  <────────────────────────────────────── Turn (ids, log-probs, versions, finish)
    EngineResult -> ledger.record

So an agent's call is a request like every other: the group it belongs to was admitted by the buffer (staleness
bound), its prompt is salted with the served version (prefix cache), a weight push between two engine steps stamps
the tokens after it with the new version, and the calls of a group's episodes that send the same context at once go
to vLLM as one request of n samples.

Sampling is the run's, not the request's: the learner's importance ratios assume the generator's temperature
(generator.temperature, top_p 1), so a request's ``temperature``/``top_p``/``seed`` are not applied (counted in
``sampling_overridden``); ``max_tokens`` is (capped by generator.max_new_tokens and the context window). Stop strings
are refused: the engine reads ids, not text, and a stop string would end a turn inside a token.

Every sampled turn is logged per episode (``EPISODE``), so the rollout can check that the ids it trains are the ids
the engine returned (``token_mismatch``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

from async_rlhf.agent.engine import EPISODE, EngineResult, SamplingSpec
from async_rlhf.agent.episodes import EndpointError


class PolicyEngine:
    """``TokenEngine`` over an ``EnginePolicy`` (``generator/rollout.py``) whose loop runs on another thread."""

    def __init__(self, policy: Any, temperature: float) -> None:
        self.policy = policy
        self.temperature = temperature
        self.loop: asyncio.AbstractEventLoop | None = None
        """The generator's event loop (bound by the first rollout, which runs on it)."""
        self.outputs: dict[str, list[list[int]]] = defaultdict(list)
        """Episode id -> the ids of each turn the engine returned for it, in order (taken by ``take_outputs``)."""
        self.counters = {"sampling_overridden": 0}

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def take_outputs(self, episode_id: str) -> list[list[int]]:
        return self.outputs.pop(episode_id, [])

    async def generate(self, prompt_ids: list[int], params: SamplingSpec) -> EngineResult:
        if self.loop is None:
            raise EndpointError(503, "the generator's engine loop is not running yet: retry", type_="server_error",
                                code="engine_not_ready", retry=True)
        if params.stop:
            raise EndpointError(400, "stop strings are not supported in training episodes: the engine samples ids "
                                "and stops on the model's stop tokens; cut the text in the agent instead",
                                param="stop", code="stop_not_supported")
        if (params.temperature != self.temperature or params.top_p != 1.0 or params.seed is not None):
            self.counters["sampling_overridden"] += 1
        room = self.policy.max_model_len - len(prompt_ids)
        if room <= 0:
            raise EndpointError(400, f"the episode's context is {len(prompt_ids)} tokens and the engine's window "
                                f"{self.policy.max_model_len}: no room for an answer; end the episode (or raise "
                                "model.max_model_len)", param="messages", code="context_length_exceeded",
                                retry=False)
        future = asyncio.run_coroutine_threadsafe(self.policy.generate(list(prompt_ids), params.max_tokens),
                                                  self.loop)
        turn = await asyncio.wrap_future(future)
        episode = EPISODE.get()
        if episode is not None:
            self.outputs[episode].append(list(turn.token_ids))
        finish = turn.finish_reason if turn.finish_reason in ("stop", "length") else "stop"
        return EngineResult(list(turn.token_ids), list(turn.logprobs), list(turn.versions), finish)
