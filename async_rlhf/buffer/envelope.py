"""Check a group's wire map without building arrays: what the service needs to accept, index and route it.

The service never trains on a group, so it does not materialise one (``Group.from_wire`` copies every array,
about 250 us per group in a profile). It checks the same rules on the headers instead (map layout, dtypes,
``len(data) == prod(shape) * itemsize``, equal lengths per sample) and reads only the versions to learn the
group's oldest token. The learner still builds the full :class:`~async_rlhf.types.Group` from the same bytes.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

import numpy as np

from async_rlhf.wire import ALLOWED_DTYPES, WireError

ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}
ARRAY_KEYS = frozenset({"dtype", "shape", "data"})
SAMPLE_ARRAYS = ("completion_ids", "logprobs", "versions")
OPTIONAL_ARRAYS = ("loss_mask", "token_rewards")
SCALARS = ("generator", "t_start", "t_end")


class Envelope(NamedTuple):
    group_id: str
    min_version: int
    num_samples: int
    num_tokens: int
    uniform_reward: bool = False
    """Every sample has the same reward (a group baseline gives each a zero advantage)."""


def _array(obj: Any, name: str, ndim: int | None = 1) -> int:
    """Checks an array header; returns its length (the first dimension)."""
    if type(obj) is not dict or obj.keys() != ARRAY_KEYS:
        raise WireError("malformed", f"{name}: an array must be a map with exactly dtype, shape and data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if type(dtype) is not str or dtype not in ITEMSIZE or type(data) is not bytes or type(shape) is not list:
        raise WireError("malformed", f"{name}: bad array header dtype={dtype!r} shape={shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise WireError("malformed", f"{name}: bad array shape {shape!r}")
        count *= d
    if count * ITEMSIZE[dtype] != len(data):
        raise WireError("malformed", f"{name}: shape {shape} and dtype {dtype} cannot hold {len(data)} bytes")
    if ndim is not None and len(shape) != ndim:
        raise WireError("malformed", f"{name} must be a {ndim}-D array, got shape {shape}")
    return shape[0] if shape else 1


def _length(obj: Any, sample: int, key: str) -> int:
    """:func:`_array` of a sample's array, with its common case (a valid 1-D array) checked inline.

    The fast path accepts exactly what ``_array`` accepts; anything else goes to ``_array`` for the refusal
    and its message (formatted only then: this runs several times per group on the service's hot path).
    """
    if type(obj) is dict and obj.keys() == ARRAY_KEYS:
        shape, data = obj["shape"], obj["data"]
        if type(shape) is list and len(shape) == 1 and type(data) is bytes:
            dtype = obj["dtype"]
            n, size = shape[0], ITEMSIZE.get(dtype) if type(dtype) is str else None
            if type(n) is int and size is not None and n >= 0 and n * size == len(data):
                return n
    return _array(obj, f"sample {sample} {key}" if sample >= 0 else "prompt_ids")


def inspect_group(obj: Any) -> Envelope:
    """The envelope of a wire group, or :class:`WireError` for exactly what ``Group.from_wire`` refuses."""
    if type(obj) is not dict:
        raise WireError("malformed", "a group must be a map")
    gid, samples = obj.get("group_id"), obj.get("samples")
    if type(gid) is not str or not gid:
        raise WireError("malformed", "group_id must be a non-empty string")
    if type(samples) is not list or not samples:
        raise WireError("malformed", "a group needs a non-empty list of samples")
    if _length(obj.get("prompt_ids"), -1, "") == 0:
        raise WireError("malformed", "prompt_ids must be a non-empty 1-D array")
    for key in SCALARS:
        value = obj.get(key, 0)
        kind = type(value)
        if kind is not int and (kind is not float or not math.isfinite(value)):
            raise WireError("malformed", f"group field {key} must be a finite number, got {value!r}")
    meta = obj.get("meta")
    if meta is not None and type(meta) is not dict:
        raise WireError("malformed", "group field meta must be a map")
    min_version: int | None = None
    tokens = 0
    rewards = set()
    for i, s in enumerate(samples):
        if type(s) is not dict:
            raise WireError("malformed", f"sample {i} must be a map")
        get = s.get
        n = _length(get("completion_ids"), i, "completion_ids")
        n_logprobs, n_versions = _length(get("logprobs"), i, "logprobs"), _length(get("versions"), i, "versions")
        mask, token_rewards = get("loss_mask"), get("token_rewards")
        n_mask = n if mask is None else _length(mask, i, "loss_mask")
        n_rewards = n if token_rewards is None else _length(token_rewards, i, "token_rewards")
        if not n == n_logprobs == n_versions == n_mask == n_rewards:
            raise WireError("malformed", f"sample {i}: completion_ids, logprobs, versions, loss_mask and "
                                         "token_rewards (when given) must be 1-D arrays of one length")
        reward = get("reward")
        if type(reward) is not float and type(reward) is not int:
            raise WireError("malformed", f"sample {i} reward must be a number, got {reward!r}")
        rewards.add(reward)
        if mask is not None and (mask["dtype"] != "uint8" or mask["data"].translate(None, b"\x00\x01")):
            raise WireError("malformed", f"sample {i} loss_mask must be uint8 zeros and ones")
        if token_rewards is not None and token_rewards["dtype"] != "float32":
            raise WireError("malformed", f"sample {i} token_rewards must be float32")
        tokens += n
        if n:
            v = s["versions"]
            data = v["data"]
            if v["dtype"] == "int32" and data == data[:4] * n:  # the usual case: one version for the sample
                low = int.from_bytes(data[:4], sys.byteorder, signed=True)
            else:
                low = int(np.frombuffer(data, v["dtype"]).min())
            if min_version is None or low < min_version:
                min_version = low
    if min_version is None:
        meta = obj.get("meta") or {}
        start = meta.get("start_version", 0)
        min_version = start if type(start) is int else 0
    return Envelope(gid, min_version, len(samples), tokens, len(rewards) == 1)
