"""Figures of a fleet after its training, while its actors still run (bench/scale.py, tests/cluster's 8 + 8).

    raw_broadcast(cluster)       learner rank 0 -> every generator worker: the push's bytes, on the push's store and
                                 transport, timed as bench/weight_sync.py's raw (broadcast + a 1-element allreduce;
                                 receivers posted first): async_rlhf/sync/raw.py
    learner_allreduce(cluster)   every learner rank at once: an all-reduce over their group of as many elements as the
                                 trainable parameters (LearnerActor.allreduce_seconds); per repetition the slowest rank
    peak_rss(cluster)            per role, the peak resident MB of each actor's process and its children
                                 (async_rlhf/process_memory.py), and of this driver
    push_figures(records)        the run's pushes: median sync/push_s and sync/broadcast_s, bytes, members
    version_gaps(...)            what keeps "every version reached every generator" from holding (empty: it holds)

Measured after training on a quiet fleet, the raw broadcast is the wire's own time; the run's pushes overlapped
the learners' next step and the generators' work on the same cores (on 2 shared cores a push's figure is mostly
waiting for a core).
"""

from __future__ import annotations

import statistics
import uuid
from typing import Any

REPS = 5


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def raw_broadcast(cluster: Any, reps: int = REPS) -> dict[str, Any]:
    """``raw_broadcast_s`` (the median), the seconds of each repetition and the bytes (the push's)."""
    import ray

    from async_rlhf.sync.layout import layout_from_wire
    from async_rlhf.sync.protocol import tp_member_ids

    tp = cluster.cfg.resources.tensor_parallel
    members = [m for i in range(len(cluster.generators)) for m in tp_member_ids(f"gen{i}", tp)]
    nbytes = sum(b.nbytes for b in layout_from_wire(cluster.layout))
    tag = uuid.uuid4().hex[:12]
    receives = [g.raw_receive.remote(tag, members, nbytes, reps) for g in cluster.generators]
    sent = ray.get(cluster.learners[0].raw_broadcast.remote(len(members) + 1, tag, reps))
    ray.get(receives)
    if sent["bytes"] != nbytes:
        raise RuntimeError(f"the learner pushes {sent['bytes']} bytes, the layout handed out says {nbytes}")
    return {"raw_broadcast_s": _median(sent["seconds"]), "seconds": sent["seconds"], "bytes": nbytes,
            "receivers": len(members)}


def learner_allreduce(cluster: Any, reps: int = REPS) -> dict[str, Any]:
    """``allreduce_s``: the median over repetitions of the slowest rank's all-reduce; elements and bytes."""
    import ray

    per_rank = ray.get([lr.allreduce_seconds.remote(reps) for lr in cluster.learners])
    slowest = [max(r["seconds"][i] for r in per_rank) for i in range(reps)]
    return {"allreduce_s": _median(slowest), "seconds": slowest, "elements": per_rank[0]["elements"],
            "bytes": per_rank[0]["bytes"], "ranks": len(per_rank)}


def peak_rss(cluster: Any) -> dict[str, Any]:
    """Per role (generators, learners, buffer, driver): each process's peak resident MB with its children, and
    ``rss_mb_generator`` / ``rss_mb_learner``: the largest of the role."""
    import ray

    from async_rlhf.process_memory import actor_peak_rss_mb, peak_rss_mb

    roles = {"generators": cluster.generators, "learners": cluster.learners, "buffer": [cluster.buffer]}
    refs = {role: [a.__ray_call__.remote(actor_peak_rss_mb) for a in actors] for role, actors in roles.items()}
    per_role = {role: [r["total_mb"] for r in ray.get(rs)] for role, rs in refs.items()}
    per_role["driver"] = [peak_rss_mb()["total_mb"]]
    return {"rss_mb": per_role, "rss_mb_generator": max(per_role["generators"]),
            "rss_mb_learner": max(per_role["learners"]), "rss_mb_sum": round(sum(sum(v) for v in per_role.values()), 1)}


def push_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The pushes a run's records carry (each push's metrics ride on a later step's record; the last push's on
    none): ``push_s`` (median sync/push_s: from the push's start until every member acknowledged it, epoch rebuilds
    included), ``push_broadcast_s`` (median sync/broadcast_s: until the sender's chunks are out),
    ``push_ack_wait_s`` (median sync/ack_wait_s: then until every member has received them and acknowledged),
    ``pushes`` and ``push_bytes``."""
    pushes = [r for r in records if "sync/push_s" in r]

    def median_of(key: str) -> float:
        return _median([float(r[key]) for r in pushes if key in r])

    return {"push_s": median_of("sync/push_s"), "push_broadcast_s": median_of("sync/broadcast_s"),
            "push_ack_wait_s": median_of("sync/ack_wait_s"), "pushes": len(pushes),
            "push_bytes": max((float(r.get("sync/bytes", 0.0)) for r in pushes), default=0.0)}


def version_gaps(records: list[dict[str, Any]], generator_versions: list[int], members: int) -> list[str]:
    """Why "every version reached every generator" does not hold; empty when it does: every push but the last
    (whose metrics no record carries) was acknowledged by all ``members`` with none dropped (an acknowledgement
    means the member holds that version byte-exact), and every generator serves the final version at the end."""
    if not records:
        return ["no step was recorded"]
    final = int(records[-1]["version"])
    gaps = []
    pushed = {int(r["sync/version"]): r for r in records if "sync/version" in r}
    missing = [v for v in range(1, final) if v not in pushed]
    if missing:
        gaps.append(f"no record of the push of version(s) {missing}")
    for v, r in sorted(pushed.items()):
        if int(r.get("sync/members", 0)) != members or float(r.get("sync/dropped", 0.0)) > 0:
            gaps.append(f"version {v} was acknowledged by {int(r.get('sync/members', 0))} of {members} members "
                        f"({int(r.get('sync/dropped', 0.0))} dropped)")
    behind = {i: v for i, v in enumerate(generator_versions) if v != final}
    if not generator_versions:
        gaps.append("no generator reported its version")
    if behind:
        gaps.append(f"generator(s) {behind} end on another version than the final {final}")
    return gaps
