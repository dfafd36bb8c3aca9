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
    loss_mask: np.ndarray | None = None
    """uint8 [T]: 1 = a generated token the learner trains on, 0 = an environment observation token spliced
    into a multi-turn trajectory. None (the default) is filled with all ones."""
    token_rewards: np.ndarray | None = None
    """float32 [T] or None: per-turn rewards, each placed on the last token of its turn."""

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.completion_ids), np.uint8)

    def to_wire(self, views: bool = False) -> dict[str, Any]:
        """The wire map; ``views=True`` refers to the arrays' memory instead of copying it (encode at once)."""
        out = {
            "completion_ids": pack_array(self.completion_ids.astype(np.int32, copy=False), views),
            "logprobs": pack_array(self.logprobs.astype(np.float32, copy=False), views),
            "versions": pack_array(self.versions.astype(np.int32, copy=False), views),
            "reward": float(self.reward),
            "finish_reason": self.finish_reason,
        }
        mask = np.asarray(self.loss_mask, np.uint8)
        if not mask.all() or len(mask) != len(self.completion_ids):  # absent on the wire means all ones
            out["loss_mask"] = pack_array(mask, views)
        if self.token_rewards is not None:
            out["token_rewards"] = pack_array(np.asarray(self.token_rewards, np.float32), views)
        return out

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
                loss_mask=unpack_array(obj["loss_mask"]) if obj.get("loss_mask") is not None else None,
                token_rewards=unpack_array(obj["token_rewards"]) if obj.get("token_rewards") is not None else None,
            )
        except WireError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError("malformed", f"sample field {exc}") from None
        arrays = [s.completion_ids, s.logprobs, s.versions, s.loss_mask]
        if s.token_rewards is not None:
            arrays.append(s.token_rewards)
        if any(a.ndim != 1 for a in arrays) or len({a.shape[0] for a in arrays}) != 1:
            raise WireError("malformed", "completion_ids, logprobs, versions, loss_mask and token_rewards (when "
                                         "given) must be 1-D arrays of one length")
        if s.loss_mask.dtype != np.uint8 or s.loss_mask.max(initial=0) > 1:
            raise WireError("malformed", "loss_mask must be uint8 zeros and ones")
        if s.token_rewards is not None and s.token_rewards.dtype != np.float32:
            raise WireError("malformed", "token_rewards must be float32")
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

    def to_wire(self, views: bool = False) -> dict[str, Any]:
        """The wire map; ``views=True`` refers to the arrays' memory instead of copying it (encode at once)."""
        return {
            "group_id": self.group_id,
            "prompt_ids": pack_array(self.prompt_ids.astype(np.int32, copy=False), views),
            "samples": [s.to_wire(views) for s in self.samples],
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
