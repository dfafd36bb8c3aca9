"""Bookkeeping of prompt groups in flight: which request belongs to which group, and the version
of every token (pure; the generator actor feeds it engine outputs)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rlhf.types import Group, Sample


@dataclass
class GroupInProgress:
    group_id: str
    prompt_ids: list[int]
    n: int
    meta: dict[str, Any]
    start_version: int
    t_start: float = field(default_factory=time.time)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.n)]
        self.logprobs = [[] for _ in range(self.n)]
        self.versions = [[] for _ in range(self.n)]
        self.finish = [None] * self.n

    @property
    def done(self) -> bool:
        return all(f is not None for f in self.finish)

    def to_group(self, rewards: list[float], generator: int) -> Group:
        samples = [
            Sample(np.asarray(t, np.int32), np.asarray(lp, np.float32), np.asarray(v, np.int32), float(r),
                   f or "stop")
            for t, lp, v, r, f in zip(self.tokens, self.logprobs, self.versions, rewards, self.finish)
        ]
        meta = {**self.meta, "start_version": self.start_version}
        return Group(self.group_id, np.asarray(self.prompt_ids, np.int32), samples, generator, meta,
                     self.t_start, time.time())


class RolloutTracker:
    """Maps engine request ids ``<group_id>/<i>`` to samples and stamps tokens with versions."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupInProgress] = {}

    def start(self, group: GroupInProgress) -> list[str]:
        self.groups[group.group_id] = group
        return [f"{group.group_id}/{i}" for i in range(group.n)]

    def on_output(self, request_id: str, token_ids: list[int], logprobs: list[float], version: int,
                  finish_reason: str | None) -> GroupInProgress | None:
        """Record new tokens of one request; returns its group once every sample has finished."""
        gid, _, idx = request_id.rpartition("/")
        group = self.groups[gid]
        i = int(idx)
        if len(token_ids) != len(logprobs):
            raise ValueError(f"request {request_id}: {len(token_ids)} tokens but {len(logprobs)} logprobs")
        group.tokens[i].extend(token_ids)
        group.logprobs[i].extend(logprobs)
        group.versions[i].extend([version] * len(token_ids))
        if finish_reason is not None:
            group.finish[i] = finish_reason
            if group.done:
                return self.groups.pop(gid)
        return None

    def __len__(self) -> int:
        return len(self.groups)
