"""Control plane of the weight push: the TCPStore keys and the small JSON messages under them (pure).

Tensors and the acknowledgement of a push travel on a gloo/NCCL process group; everything else (who is in
the group, which version a push carries, who failed and why) travels through the TCPStore that the sender
hosts: a store round trip costs about as much as a 1 MB transfer on a loaded 2-core machine, so the
fast path of a push has none (members learn the version from the acknowledgement; joiners are looked for by
a thread of the sender), and a push costs the same collectives as a raw broadcast plus one allreduce
whenever it fits in one chunk. The store outlives
every process group: when membership changes, the sender opens a new *epoch* (a new process group on a
fresh key prefix of the same store), so a joiner only ever needs the store's address.

Ranks: in epoch e the sender is rank 0 and ``members[i]`` is rank i + 1. Members are named by stable ids
(``gen0``, ``gen1`` ...) plus a nonce per process incarnation, so a restarted generator takes over its
old id without being confused with the dead process.

Join, rebuild, push, ack (k counts push headers within an epoch; every wait has a deadline)::

    sender: learner rank 0, hosts the store          receiver "gen1" (a generator's vLLM worker)
    ----------------------------------------          --------------------------------------------
                                                      join: queue_push(joins, {"id", "nonce"})
                                                            wait(admit/gen1#nonce)
    push(params, v): a version boundary
      joiners queued, members dropped, or the last push failed?  -> open epoch e' = e + 1:
        set(e'/members, [[id, nonce], ...])
        set(e/hdr/k, {"next": e'})  ----------------> members of e (waiting for hdr k): go to e'
        set(admit/<id#nonce>, {"epoch": e'}) -------> joiners: go to e'
        wait(e'/ready/<id> for every member) <-------  set(e'/ready/gen1)
        set(e'/go) ---------------------------------> wait(e'/go)
        build the group of e' (rank 0) <=============> build the group of e' (rendezvous on e'/pg/)
      post the broadcasts of chunks 0..C-1; at an epoch's first push (k = 0) only, then
      set(e'/hdr/k, {"version": v, "layout": digest, "cut": chunks})
                                    ----------------> k = 0 (slow): wait(e'/hdr/k); refuse a foreign layout
                                                      (the header names the cut: its chunks); post the receives
                                                      k > 0 (fast): the receives were posted when the fetch
                                                      began (the epoch's wire never changes); between idle
                                                      slices look for e/hdr/k = {"next": e'} (the sender
                                                      rebuilt instead of pushing)
      chunks 0..C-1 =================================> into the buffer (on a thread: the engine generates)
      ack: allreduce(v) <============================> allreduce(0): this member holds every chunk; the
      result v by the deadline: every member holds v     result tells it which version (k > 0; the layout is
                                                         the epoch's: one changed here alone is refused
                                                         before loading)
                                                      (own failure instead: set(e'/ack/k/gen1, "error:
                                                       ..."), then add(e'/failed/k); no allreduce)
                                                      between two engine steps: load v, then
      live_times(): v is live at gen1 from then <----  set(e'/live/k/gen1, wall time)
      else: set(e'/abort/k) --------------------------> receivers still waiting on a chunk or the ack give
            collect reports for a short grace               up within a slice and report "aborted: ..."
                                                            under e'/ack/k/<id>
            raise PushError(missing, errors, aborted); the next push opens a new epoch

``missing`` (no report at all: dead or hung) and ``errors`` (reported its own failure) are the members to
drop; ``aborted`` ones only gave up because the sender did. Within an epoch the wire never changes
(``Sender.use_layout`` with another digest, or parameters that move in or out of one flat buffer, which
changes the cut, open a new epoch), so pre-posted receives always match what
comes. Receives pre-posted for longer than the group's own timeout fail there; that member then joins
again (a new incarnation) and the next push rebuilds the group with it. A receiver that finds itself absent from
e'/members was dropped: it raises ``Excluded`` and may join again. Keys are never deleted (a few hundred
bytes per push).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JOIN_QUEUE = "joins"
PREPOSTS = ("gloo",)
"""Backends whose members post their receives before a push starts (the fast path). Not NCCL: a posted NCCL
collective is a kernel holding GPU resources until its peers come, i.e. for the whole time between pushes;
there every push has a store header and members post once it arrives."""
ABORTED = "aborted"
"""Prefix of a receiver's report when it gave up because the sender aborted (a victim, not a culprit)."""


@dataclass(frozen=True)
class Member:
    """One receiver incarnation: a stable id and a nonce drawn by the process that joined."""

    id: str
    nonce: str

    @property
    def token(self) -> str:
        return f"{self.id}#{self.nonce}"


def members_key(epoch: int) -> str:
    return f"e{epoch}/members"


def ready_key(epoch: int, member_id: str) -> str:
    return f"e{epoch}/ready/{member_id}"


def go_key(epoch: int) -> str:
    return f"e{epoch}/go"


def pg_prefix(epoch: int) -> str:
    return f"e{epoch}/pg/"


def header_key(epoch: int, k: int) -> str:
    return f"e{epoch}/hdr/{k}"


def ack_key(epoch: int, k: int, member_id: str) -> str:
    return f"e{epoch}/ack/{k}/{member_id}"


def live_key(epoch: int, k: int, member_id: str) -> str:
    """Set by a member once it serves push k (its wall time), or to "error: ..." if loading failed."""
    return f"e{epoch}/live/{k}/{member_id}"


def failed_key(epoch: int, k: int) -> str:
    return f"e{epoch}/failed/{k}"


def abort_key(epoch: int, k: int) -> str:
    return f"e{epoch}/abort/{k}"


def admit_key(member: Member) -> str:
    return f"admit/{member.token}"


def encode(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def decode(raw: bytes | str) -> Any:
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def encode_members(members: list[Member]) -> str:
    return encode([[m.id, m.nonce] for m in members])


def decode_members(raw: bytes | str) -> list[Member]:
    data = decode(raw)
    if not isinstance(data, list) or not all(isinstance(m, list) and len(m) == 2 for m in data):
        raise ValueError(f"malformed member list: {data!r}")
    return [Member(str(i), str(n)) for i, n in data]


def encode_join(member: Member) -> str:
    return encode({"id": member.id, "nonce": member.nonce})


def decode_join(raw: bytes | str) -> Member:
    data = decode(raw)
    if not isinstance(data, dict) or not isinstance(data.get("id"), str) or not isinstance(data.get("nonce"), str):
        raise ValueError(f"malformed join request: {data!r}")
    if not data["id"] or "#" in data["id"] or "/" in data["id"]:
        raise ValueError(f"member id {data['id']!r} must be non-empty and free of '#' and '/'")
    return Member(data["id"], data["nonce"])


def tp_member_id(base: str, rank: int, tensor_parallel: int) -> str:
    """The push-group member id of TP worker ``rank`` of generator ``base``: every worker holds a shard and
    receives the whole version itself (vLLM's weight loaders take its shard), so each is a member."""
    if not 0 <= rank < tensor_parallel:
        raise ValueError(f"worker rank {rank} outside tensor_parallel={tensor_parallel}")
    return base if tensor_parallel == 1 else f"{base}.tp{rank}"


def tp_member_ids(base: str, tensor_parallel: int) -> list[str]:
    """Every member id of one generator (one per TP worker)."""
    return [tp_member_id(base, r, tensor_parallel) for r in range(tensor_parallel)]


MAX_CHUNKS = 1 << 16
"""At most this many broadcasts per push (a header cutting finer is malformed: every broadcast costs a few
hundred microseconds, and the receiver posts one receive per chunk)."""


@dataclass(frozen=True)
class Header:
    """What push k of an epoch is: a version on the wire (with the sender's layout digest, so that a
    receiver holding another layout refuses it instead of receiving garbage, and the cut: the arena's byte
    ranges, one broadcast each, in order), or a move to the next epoch."""

    version: int | None = None
    next_epoch: int | None = None
    layout: str = ""
    cut: tuple[tuple[int, int], ...] = ()

    def encode(self) -> str:
        if (self.version is None) == (self.next_epoch is None):
            raise ValueError("a header carries exactly one of version and next_epoch")
        if self.version is not None:
            return encode({"version": self.version, "layout": self.layout, "cut": [list(c) for c in self.cut]})
        return encode({"next": self.next_epoch})

    @staticmethod
    def decode(raw: bytes | str) -> Header:
        data = decode(raw)
        if (isinstance(data, dict) and set(data) == {"version", "layout", "cut"} and isinstance(data["version"], int)
                and isinstance(data["layout"], str) and _is_cut(data["cut"])):
            return Header(version=data["version"], layout=data["layout"], cut=tuple(tuple(c) for c in data["cut"]))
        if isinstance(data, dict) and set(data) == {"next"} and isinstance(data["next"], int):
            return Header(next_epoch=data["next"])
        raise ValueError(f"malformed push header: {str(data)[:200]}")


def _is_cut(cut: Any) -> bool:
    return (isinstance(cut, list) and len(cut) <= MAX_CHUNKS
            and all(isinstance(c, list) and len(c) == 2 and all(type(x) is int and x >= 0 for x in c) for c in cut))


def merge_members(current: list[Member], dropped: set[str], joiners: list[Member]) -> list[Member]:
    """The next epoch's members: current ones not dropped, in order; a joiner replaces its own id's old
    incarnation in place (a restarted generator keeps its rank) or is appended."""
    out = [m for m in current if m.id not in dropped]
    for j in joiners:
        for i, m in enumerate(out):
            if m.id == j.id:
                out[i] = j
                break
        else:
            out.append(j)
    return out
