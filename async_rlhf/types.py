"""Records that cross process boundaries: samples, prompt groups, and their wire form.

Every generated token carries the policy version that produced it (``Sample.versions``), so a
trajectory that spans a weight update is handled exactly: its staleness at training time is
``learner_version - min(token versions)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rlhf.wire import WireError, pack_array, unpack_array


@dataclass
class Sample:
    """One completion of a prompt."""

    completion_ids: np.ndarray
    """int32 [T] generated token ids (eos included when generation stopped on it)."""
    logprobs: np.ndarray
    """float32 [T] behaviour log-probs (mu) of each generated token, from the generator."""
    versions: np.ndarray
    """int32 [T] policy version that generated each token."""
    reward: float
    finish_reason: str = "stop"

    def to_wire(self) -> dict[str, Any]:
        return {
            "completion_ids": pack_array(self.completion_ids.astype(np.int32)),
            "logprobs": pack_array(self.logprobs.astype(np.float32)),
            "versions": pack_array(self.versions.astype(np.int32)),
            "reward": float(self.reward),
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> Sample:
        if not isinstance(obj, dict):
            raise WireError("malformed", "a sample must be a map")
        try:
            s = cls(
                completion_ids=unpack_array(obj["completion_ids"]),
                logprobs=unpack_array(obj["logprobs"]),
                versions=unpack_array(obj["versions"]),
                reward=float(obj["reward"]),
                finish_reason=str(obj.get("finish_reason", "stop")),
            )
        except WireError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError("malformed", f"sample field {exc}") from None
        arrays = (s.completion_ids, s.logprobs, s.versions)
        if any(a.ndim != 1 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
            raise WireError("malformed", "completion_ids, logprobs and versions must be 1-D of one length")
        return s


@dataclass
class Group:
    """All completions of one prompt: the unit the buffer stores and releases."""

    group_id: str
    prompt_ids: np.ndarray
    samples: list[Sample]
    generator: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    """Task data needed downstream (e.g. the problem), plain msgpack-able values only."""
    t_start: float = field(default_factory=time.time)
    t_end: float = field(default_factory=time.time)

    @property
    def min_version(self) -> int:
        mins = [int(s.versions.min()) for s in self.samples if len(s.versions)]
        return min(mins) if mins else int(self.meta.get("start_version", 0))

    @property
    def num_tokens(self) -> int:
        return sum(len(s.completion_ids) for s in self.samples)

    def to_wire(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_ids": pack_array(self.prompt_ids.astype(np.int32)),
            "samples": [s.to_wire() for s in self.samples],
            "generator": int(self.generator),
            "meta": self.meta,
            "t_start": self.t_start,
            "t_end": self.t_end,
        }

    @classmethod
    def from_wire(cls, obj: Any) -> Group:
        if not isinstance(obj, dict):
            raise WireError("malformed", "a group must be a map")
        try:
            samples = obj["samples"]
            if not isinstance(samples, list) or not samples:
                raise WireError("malformed", "a group needs a non-empty list of samples")
            g = cls(
                group_id=str(obj["group_id"]),
                prompt_ids=unpack_array(obj["prompt_ids"]),
                samples=[Sample.from_wire(s) for s in samples],
                generator=int(obj.get("generator", 0)),
                meta=dict(obj.get("meta") or {}),
                t_start=float(obj.get("t_start", 0.0)),
                t_end=float(obj.get("t_end", 0.0)),
            )
        except WireError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError("malformed", f"group field {exc}") from None
        if not g.group_id:
            raise WireError("malformed", "group_id must not be empty")
        if g.prompt_ids.ndim != 1 or g.prompt_ids.shape[0] == 0:
            raise WireError("malformed", "prompt_ids must be a non-empty 1-D array")
        return g
