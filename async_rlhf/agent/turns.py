"""What an agent episode's ledger is made of (async_rlhf/agent/ledger.py keeps them): the recorded assistant
turn, the plan of a call, a branch of token ids with its loss mask, log-probs and versions (and its Sample), and
the OpenAI messages normalised to what the chat template renders and what the ledger compares."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rlhf.types import Sample


@dataclass(frozen=True)
class RecordedTurn:
    """One assistant turn as sampled and recorded: what the endpoint answers with."""

    response_id: str
    message: dict[str, Any]
    """The OpenAI assistant message: ``role``, ``content`` (None when only tool calls), ``tool_calls``
    (when any: ``id``, ``type``, ``function.name``, ``function.arguments`` JSON text)."""
    finish_reason: str
    """``tool_calls`` when the turn called tools, else the engine's (``stop``, ``length``)."""
    tool_parse_error: bool
    text: str
    """The decoded completion (the trailing stop token excluded)."""
    branch: int
    start: int
    end: int
    """The sampled span ``[start, end)`` in the branch's ids."""
    prompt_tokens: int
    engine_finish_reason: str

    @property
    def completion_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    """What to send to the engine for one call (from ``EpisodeLedger.plan``; hand it back to ``record``)."""

    prompt_ids: list[int]
    """The whole context for the engine (empty when ``replay`` is set)."""
    key: str | None = None
    replay: RecordedTurn | None = None
    """The turn already recorded under ``key``: answer with it, do not sample."""
    fork: bool = False
    """The call starts a new branch diverging from an existing one."""
    fork_reason: str = ""
    new_tokens: int = 0
    """How many ids at the end of ``prompt_ids`` are new to the ledger (rendered, mask 0)."""
    branch: int | None = None
    """The branch this call extends (None: a new branch)."""
    base_len: int = 0
    """That branch's length when planned (a record finding it longer starts a sibling)."""
    parent: int | None = None
    """The branch a new branch diverges from (None: a root or an extension)."""
    messages: tuple[Any, ...] = ()
    """The normalized history the call sent (the branch's messages after it, with the reply appended)."""
    tools: list[dict[str, Any]] | None = None
    tools_key: str = ""


@dataclass
class Branch:
    """One trainable token sequence of the episode."""

    index: int
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 exactly on sampled tokens."""
    logprobs: list[float] = field(default_factory=list)
    """Behaviour log-probs of sampled tokens; 0.0 elsewhere."""
    versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token; a not-sampled token has that of the turn after it."""
    turns: list[RecordedTurn] = field(default_factory=list)
    parent: int | None = None
    """The branch this one forked from (None: a root)."""
    messages: list[Any] = field(default_factory=list)
    tools_key: str = ""
    covered: str = ""
    """The text of the stop token that ended the last turn ("" when it ended otherwise)."""

    @property
    def prompt_len(self) -> int:
        """Ids before the first sampled token (all of them when nothing was sampled)."""
        return self.mask.index(1) if 1 in self.mask else len(self.ids)

    def oldest_version(self) -> int | None:
        """The oldest policy version among the sampled tokens (staleness is measured from it); None if none."""
        sampled = [v for v, m in zip(self.versions, self.mask, strict=True) if m]
        return min(sampled) if sampled else None

    def to_sample(self, reward: float, turn_rewards: Sequence[float] | None = None,
                  prompt_len: int | None = None) -> Sample:
        """A Sample of the ids after ``prompt_len`` (default: the first sampled token; a group's samples share one
        prompt, see ``common_prompt_len``). ``turn_rewards`` (one per turn) go on each turn's last sampled token
        and the sample's reward is their sum + ``reward``, as ``env.base.Trajectory.to_sample``."""
        p = self.prompt_len if prompt_len is None else prompt_len
        if any(self.mask[:p]):
            raise ValueError(f"prompt_len {p} cuts into the sampled tokens of branch {self.index} (its first "
                             f"sampled token is at {self.prompt_len})")
        rewards = np.zeros(len(self.ids) - p, np.float32)
        if turn_rewards is not None:
            if len(turn_rewards) != len(self.turns):
                raise ValueError(f"{len(turn_rewards)} turn rewards for {len(self.turns)} turns")
            for turn, r in zip(self.turns, turn_rewards, strict=True):
                if turn.end > turn.start:
                    rewards[turn.end - 1 - p] += r
        trained = np.flatnonzero(self.mask[p:])
        if reward and len(trained):
            rewards[trained[-1]] += reward
        return Sample(
            completion_ids=np.asarray(self.ids[p:], np.int32),
            logprobs=np.asarray(self.logprobs[p:], np.float32),
            versions=np.asarray(self.versions[p:], np.int32),
            reward=float(sum(turn_rewards or ())) + float(reward),
            finish_reason=self.turns[-1].engine_finish_reason if self.turns else "stop",
            loss_mask=np.asarray(self.mask[p:], np.uint8),
            token_rewards=rewards if turn_rewards is not None or len(self.turns) > 1 else None,
        )


def common_prompt_len(branches: Sequence[Branch]) -> int:
    """The longest prefix of ids every branch shares before any of them samples: the group's prompt."""
    if not branches:
        return 0
    limit = min(b.prompt_len for b in branches)
    first = branches[0].ids
    n = 0
    while n < limit and all(b.ids[n] == first[n] for b in branches):
        n += 1
    return n


def _content_text(content: Any) -> str:
    """A message's content as text: None is "", a list of parts is its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise ValueError(f"only text content parts are supported, got {part!r}")
        return "".join(parts)
    raise ValueError(f"message content must be a string, a list of text parts or null, got {type(content).__name__}")


def _arguments(value: Any) -> Any:
    """Tool-call arguments for rendering and comparing: a JSON object text becomes the object (what templates
    expect, as vLLM's chat rendering does); anything else is kept."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def template_message(message: Any) -> dict[str, Any]:
    """An OpenAI chat message as a chat template renders it (plain dict, content as text, arguments parsed)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError(f"a message must be a map with a role, got {message!r}")
    out: dict[str, Any] = {"role": message["role"], "content": _content_text(message.get("content"))}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = []
        for call in calls:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise ValueError(f"a tool call must have function.name, got {call!r}")
            out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                      "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}})
    return out


def normal_message(message: dict[str, Any]) -> tuple[Any, ...]:
    """What two messages must share to be the same turn (tool-call ids left out)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls", ()))
    return (message["role"], message["content"], message.get("name"), message.get("tool_call_id"),
            message.get("reasoning_content") or None, calls)


def tools_key(tools: Sequence[Any] | None) -> str:
    return json.dumps(list(tools or ()), sort_keys=True, default=str)
