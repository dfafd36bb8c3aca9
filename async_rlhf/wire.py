"""The wire codec: msgpack maps with a schema version and a ``kind``; arrays as raw bytes.

Every message on a ZeroMQ socket (and, later, in Redis) is one msgpack map::

    {"schema": 1, "kind": "<one of KINDS>", ...fields}

Arrays travel as ``{"dtype": "int32", "shape": [n], "data": <bytes>}`` (see :func:`pack_array`).
Nothing received is ever unpickled; anything malformed raises :class:`WireError`, whose ``reason`` is a
short label the receiver counts by (``malformed``, ``oversized``, ``schema``, ``unknown_kind``).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1

# Requests and their replies between generators, learners, the launcher and the buffer service.
KINDS = frozenset({
    "admit",        # generator -> buffer: may I start k new prompt groups?
    "put",          # generator -> buffer: finished prompt groups (one map, or a list of msgpack-encoded groups)
    "reward",       # generator / reward source -> buffer: the late rewards of a group put with rewards pending
    "get",          # learner -> buffer: a share of the next batch for version v
    "ack",          # learner -> buffer: these group ids were trained on
    "renew",        # learner -> buffer: it still trains these group ids (lease: not redelivered meanwhile)
    "set_version",  # learner -> buffer: version v is live
    "release",      # generator -> buffer: give back admitted slots it will not use
    "stats",        # anyone -> buffer: counters and ledgers
    "reply",        # buffer -> client: success
    "error",        # buffer -> client: the request was refused, with a reason
})

ALLOWED_DTYPES = frozenset({"int32", "int64", "float32", "float64", "float16", "uint8", "bool"})
_DTYPE_NAMES = {np.dtype(name): name for name in ALLOWED_DTYPES}  # dtype.name is slow (a Python property)
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ALLOWED_DTYPES}


class WireError(ValueError):
    """A message that cannot be accepted; ``reason`` is a counter label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def pack_array(arr: np.ndarray, view: bool = False) -> dict[str, Any]:
    """The wire map of an array; ``view=True`` puts a memoryview of its memory instead of a copy (for a map
    that is encoded at once: msgpack copies it into the message, and a later change of the array would not)."""
    arr = np.asarray(arr)
    name = _DTYPE_NAMES.get(arr.dtype)
    if name is None:
        raise WireError("malformed", f"dtype {arr.dtype.name} cannot travel; use one of {sorted(ALLOWED_DTYPES)}")
    data = memoryview(np.ascontiguousarray(arr)).cast("B") if view else arr.tobytes()
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def unpack_array(obj: Any) -> np.ndarray:
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise WireError("malformed", "an array must be a map with exactly dtype, shape and data")
    dtype, shape, data = obj["dtype"], obj["shape"], obj["data"]
    if dtype not in ALLOWED_DTYPES or not isinstance(data, bytes) or not isinstance(shape, list):
        raise WireError("malformed", f"bad array header dtype={dtype!r} shape={shape!r}")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WireError("malformed", f"bad array shape {shape!r}")
    count = int(np.prod(shape)) if shape else 1
    if count * _ITEMSIZE[dtype] != len(data):
        raise WireError("malformed", f"array of shape {shape} and dtype {dtype} cannot hold {len(data)} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def encode(kind: str, **fields: Any) -> bytes:
    if kind not in KINDS:
        raise WireError("unknown_kind", f"cannot send kind {kind!r}")
    return msgpack.packb({"schema": SCHEMA_VERSION, "kind": kind, **fields}, use_bin_type=True)


def decode(frame: bytes | memoryview, max_bytes: int) -> dict[str, Any]:
    """Parse and check one frame; raises WireError with a countable reason."""
    if len(frame) > max_bytes:
        raise WireError("oversized", f"{len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=max_bytes)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError("malformed", f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(msg, dict):
        raise WireError("malformed", f"top level must be a map, got {type(msg).__name__}")
    if msg.get("schema") != SCHEMA_VERSION:
        raise WireError("schema", f"schema {msg.get('schema')!r}, this build speaks {SCHEMA_VERSION}")
    if msg.get("kind") not in KINDS:
        raise WireError("unknown_kind", f"kind {msg.get('kind')!r}")
    return msg
