"""The environment interface: how a prompt becomes a trajectory (single-turn or multi-turn).

An environment is an object with one coroutine, ``rollout(prompt, prompt_ids, policy)``. It asks the policy
for turns (``await policy.generate(context_ids)``: one engine request, the generator keeps stepping other
requests meanwhile), may splice its own observation tokens between turns, and attaches per-turn rewards::

    context = prompt_ids
    turn 1:  await policy.generate(context) -> g1 g1 g1     loss_mask 1, mu from vLLM
             observation " lower:"          -> o o o o o    loss_mask 0, logprob 0 (never trained)
    turn 2:  await policy.generate(context + g1 + o) -> g2 g2  per-turn reward on the last g2 token
    ...

The final reward (from ``rewards.*``: a function, a reward model, a remote scorer) is added by the generator
after the rollout and may arrive later than the trajectory (see ``async_rlhf.generator.actor``).

Advantages with per-turn rewards: the learner uses GRPO on the trajectory return, ``sample.reward`` = sum of
the per-turn rewards + the final reward, normalised within the prompt group and applied to every trained
token. ``Sample.token_rewards`` keeps each turn's reward on its last token for estimators that use
returns-to-go.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from async_rlhf.types import Sample


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text and task data (plain msgpack-able values, e.g. the answer), kept in group meta.

    A chat prompt also has ``messages`` (``[{"role": ..., "content": ...}]``); its ``text`` is empty until the
    generator renders it through the tokenizer's chat template (``async_rlhf.prompts.chat``)."""

    text: str
    data: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


@dataclass
class Turn:
    """What one ``generate`` call produced."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


class Policy(Protocol):
    """The handle an environment generates with (implemented by the generator actor's engine loop)."""

    version: int

    async def generate(self, context_ids: list[int]) -> Turn: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class Trajectory:
    """Everything after the prompt, token by token: generated turns and observations."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)
    finish_reason: str = "stop"
    text: str = ""
    """The decoded generated text of every turn (observations excluded), what reward sources score."""
    turns: int = 0

    def add_turn(self, turn: Turn, text: str) -> None:
        self.token_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.loss_mask += [1] * len(turn.token_ids)
        self.token_rewards += [0.0] * len(turn.token_ids)
        self.finish_reason = turn.finish_reason
        self.text += text
        self.turns += 1

    def add_observation(self, token_ids: list[int], version: int) -> None:
        """Environment tokens: in the context of later turns, never trained (loss_mask 0, logprob 0)."""
        self.token_ids += token_ids
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)
        self.token_rewards += [0.0] * len(token_ids)

    def reward_last_turn(self, reward: float) -> None:
        """Put a per-turn reward on the last generated token so far."""
        for i in range(len(self.loss_mask) - 1, -1, -1):
            if self.loss_mask[i]:
                self.token_rewards[i] += reward
                return
        raise ValueError("reward_last_turn before any generated token")

    @property
    def env_return(self) -> float:
        return float(sum(self.token_rewards))

    @property
    def multi_turn(self) -> bool:
        return self.turns > 1 or not all(self.loss_mask)

    def to_sample(self, final_reward: float) -> Sample:
        """A Sample whose reward is the return: per-turn rewards + ``final_reward``."""
        rewards = np.asarray(self.token_rewards, np.float32)
        trained = np.flatnonzero(self.loss_mask)
        if final_reward and len(trained):
            rewards[trained[-1]] += final_reward
        return Sample(
            completion_ids=np.asarray(self.token_ids, np.int32),
            logprobs=np.asarray(self.logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32),
            reward=self.env_return + float(final_reward),
            finish_reason=self.finish_reason,
            loss_mask=np.asarray(self.loss_mask, np.uint8),
            token_rewards=rewards if self.multi_turn else None,
        )


class DropGroup(Exception):
    """Raised by an environment to drop the group it is playing (counted under ``reason``, its admission given back,
    its prompt issued again by the driver's ledger), e.g. an agent episode past its deadline."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(message or reason)
        self.reason = reason


class Environment(ABC):
    """How a prompt becomes a trajectory; ``name`` is what ``task.name`` selects."""

    name: str = ""

    @abstractmethod
    async def rollout(self, prompt: Prompt, prompt_ids: list[int], policy: Policy) -> Trajectory:
        """Generate one trajectory for ``prompt`` (already tokenized as ``prompt_ids``)."""

    async def rollout_group(self, gid: str, prompt: Prompt, prompt_ids: list[int], n: int,
                            policy: Policy) -> tuple[list[int], list[Trajectory]]:
        """A prompt group: (the group's prompt ids, ``n`` trajectories after them). By default ``n`` rollouts of
        ``prompt_ids`` at once; an environment whose episodes find their own prompt (an agent's) plays them here."""
        return prompt_ids, list(await asyncio.gather(*(self.rollout(prompt, prompt_ids, policy) for _ in range(n))))

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """The environment's own prompt stream (``prompts.source=task``)."""
        raise ValueError(f"task.name={self.name} has no prompts of its own: set prompts.source to file, python "
                         "or redis")

    def verify(self, prompt: Prompt, completion: str) -> float:
        """The environment's own reward of a completion (reward source ``task``)."""
        raise ValueError(f"task.name={self.name} has no verifier of its own: set rewards.sources to function, "
                         "model or http")

    def close(self) -> None:
        """Release what the environment holds (threads, servers) when its generator's loop ends."""

    def score_heldout(self, prompt: Prompt, completion: str) -> float:
        """The held-out evaluation's score of a greedy completion (default: ``verify``)."""
        return self.verify(prompt, completion)

    @property
    def has_verifier(self) -> bool:
        return type(self).verify is not Environment.verify

    def heldout(self) -> list[Prompt]:
        """Prompts for the held-out greedy evaluation on generator 0 (empty: no evaluation)."""
        return []


class SingleTurnEnv(Environment):
    """One generation per prompt; the reward comes entirely from the reward sources."""

    async def rollout(self, prompt: Prompt, prompt_ids: list[int], policy: Policy) -> Trajectory:
        turn = await policy.generate(prompt_ids)
        traj = Trajectory()
        traj.add_turn(turn, policy.decode(turn.token_ids))
        return traj
