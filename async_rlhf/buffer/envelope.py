"""Check a group's wire map without building arrays: what the service needs to accept, index and route it.

The service never trains on a group, so it does not materialise one (``Group.from_wire`` copies every array,
about 250 us per group in a profile). It checks the same rules on the headers instead (map layout, dtypes,
``len(data) == prod(shape) * itemsize``, equal lengths per sample) and reads only the versions to learn the
group's oldest token. The learner still builds the full :class:`~async_rlhf.types.Group` from the same bytes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from async_rlhf.wire import ALLOWED_DTYPES, WireError

ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}
ARRAY_KEYS = frozenset({"dtype", "shape", "data"})
SAMPLE_ARRAYS = ("completion_ids", "logprobs", "versions")
OPTIONAL_ARRAYS = ("loss_mask", "token_rewards")


class Envelope(NamedTuple):
    group_id: str
    min_version: int
    num_samples: int
    num_tokens: int


def _array(obj: Any, name: str, ndim: int | None = 1) -> int:
    """Checks an array header; returns its length (the first dimension)."""
    if type(obj) is not dict or obj.keys() != ARRAY_KEYS:
        raise WireError("malformed", f"{name}: an array must be a map with exactly dtype, shape and data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in ITEMSIZE or type(data) is not bytes or type(shape) is not list:
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


def inspect_group(obj: Any) -> Envelope:
    """The envelope of a wire group, or :class:`WireError` for exactly what ``Group.from_wire`` refuses."""
    if type(obj) is not dict:
        raise WireError("malformed", "a group must be a map")
    gid, samples = obj.get("group_id"), obj.get("samples")
    if type(gid) is not str or not gid:
        raise WireError("malformed", "group_id must be a non-empty string")
    if type(samples) is not list or not samples:
        raise WireError("malformed", "a group needs a non-empty list of samples")
    if _array(obj.get("prompt_ids"), "prompt_ids") == 0:
        raise WireError("malformed", "prompt_ids must be a non-empty 1-D array")
    for key in ("generator", "t_start", "t_end"):
        value = obj.get(key, 0)
        if type(value) not in (int, float) or (type(value) is float and not math.isfinite(value)):
            raise WireError("malformed", f"group field {key} must be a finite number, got {value!r}")
    if obj.get("meta") is not None and type(obj["meta"]) is not dict:
        raise WireError("malformed", "group field meta must be a map")
    min_version: int | None = None
    tokens = 0
    for i, s in enumerate(samples):
        if type(s) is not dict:
            raise WireError("malformed", f"sample {i} must be a map")
        n = _array(s.get("completion_ids"), f"sample {i} completion_ids")
        lengths = [n, _array(s.get("logprobs"), f"sample {i} logprobs"),
                   _array(s.get("versions"), f"sample {i} versions")]
        for key in OPTIONAL_ARRAYS:
            if s.get(key) is not None:
                lengths.append(_array(s[key], f"sample {i} {key}"))
        if lengths.count(n) != len(lengths):
            raise WireError("malformed", f"sample {i}: completion_ids, logprobs, versions, loss_mask and "
                                         "token_rewards (when given) must be 1-D arrays of one length")
        reward = s.get("reward")
        if type(reward) not in (int, float):
            raise WireError("malformed", f"sample {i} reward must be a number, got {reward!r}")
        mask = s.get("loss_mask")
        if mask is not None and (mask["dtype"] != "uint8" or mask["data"].translate(None, b"\x00\x01")):
            raise WireError("malformed", f"sample {i} loss_mask must be uint8 zeros and ones")
        if s.get("token_rewards") is not None and s["token_rewards"]["dtype"] != "float32":
            raise WireError("malformed", f"sample {i} token_rewards must be float32")
        tokens += n
        if n:
            v = s["versions"]
            if v["dtype"] == "int32" and n <= 512:  # small: a memoryview is cheaper than a numpy call
                low = min(memoryview(v["data"]).cast("i"))
            else:
                low = int(np.frombuffer(v["data"], v["dtype"]).min())
            min_version = low if min_version is None or low < min_version else min_version
    if min_version is None:
        meta = obj.get("meta") or {}
        start = meta.get("start_version", 0)
        min_version = start if type(start) is int else 0
    return Envelope(gid, min_version, len(samples), tokens)
