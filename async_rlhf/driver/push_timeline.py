"""When each generator served each pushed version, from what bench/scale.py logged (pure: no Ray, no torch).

    training_pushes(records)     the run's pushes from the learner's records, each with its epoch and k
    served_timeline(...)         per push and member: acknowledged -> the engine step in progress ends -> the load
                                 starts -> live (time.time() on one machine: the namespaces share its clock)
    timeline_summary(...)        their medians and maxima

The logs come from async_rlhf/driver/push_timing.py, which runs inside the actors.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from typing import Any


def median(values: list[float]) -> float:
    """The median, 0.0 for none."""
    return float(statistics.median(values)) if values else 0.0


def training_pushes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's pushes (their metrics ride on a later step's record), each with its epoch and k, the push's index
    in its epoch: one push per version, so k is the version less the epoch's first version."""
    pushes = sorted((r for r in records if "sync/version" in r), key=lambda r: r["sync/version"])
    first: dict[int, int] = {}
    for r in pushes:
        first.setdefault(int(r["sync/epoch"]), int(r["sync/version"]))
    return [{**r, "epoch": int(r["sync/epoch"]), "k": int(r["sync/version"]) - first[int(r["sync/epoch"])]}
            for r in pushes]


def _containing(intervals: list[tuple[float, float]], t: float) -> tuple[float, float] | None:
    """The interval of ``intervals`` (sorted, disjoint) that holds ``t``, if any."""
    i = bisect.bisect_right([a for a, _ in intervals], t) - 1
    return intervals[i] if i >= 0 and intervals[i][0] <= t <= intervals[i][1] else None


def _count(names: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def _generator_of(member: str) -> int:
    """gen3 or gen3.tp1 -> 3."""
    return int(member.split(".")[0][len("gen"):])


def _last_before(times: list[float], t: float) -> int:
    """The index of the last of ``times`` (sorted) at or before ``t``; -1 if none."""
    return bisect.bisect_right(times, t) - 1


def _busiest_state(states: list[list[Any]], start: float, end: float) -> str:
    """The generator's timeline state (generate, reward_and_put, wait_admission, ...) that covers most of
    ``[start, end]``; "" if none does."""
    overlap: dict[str, float] = {}
    for name, a, b in states:
        if b > start and a < end:
            overlap[name] = overlap.get(name, 0.0) + min(b, end) - max(a, start)
    return max(overlap, key=lambda n: overlap[n]) if overlap else ""


def served_timeline(pushes: list[dict[str, Any]], lives: list[dict[str, float]], intervals: list[dict[str, Any]],
                    poll_s: float) -> list[dict[str, Any]]:
    """Per push and member that served it, from the push's start (``sync/acked_time - sync/push_s``):

        staged_s     until this member's fetch returned it (it holds the bytes and has acknowledged)
        ack          ``sync/acked_time``: every member acknowledged (the push is done for the learner)
        step_left_s  then until the end of the engine step in progress (``step_s`` long; 0: none in progress)
        asked_s      then until the loop asked its workers and found the version (the loop's other work, its poll
                     every ``poll_s``, waiting for a core or the GIL; ``loop_state``: its busiest timeline state)
        apply_s      the load (``_load_version``), live inside it; ``wait_s``: acknowledgement to live

    ``bound_s``: one engine step (the one in progress) plus the apply plus one poll interval; ``held``: the wait
    stayed within it. ``late_steps``: engine steps this generator began after the acknowledgement (every member
    held the bytes) and before its load: ``held_steps`` when at most one (the step the loop was about to begin
    when the bytes landed); unlike ``held``, it does not count the time the loop waits for a core."""
    rows = []
    for p, live in zip(pushes, lives):
        t_ack = float(p["sync/acked_time"])
        t_start = t_ack - float(p["sync/push_s"])
        version = int(p["sync/version"])
        for member, t_live in sorted(live.items()):
            logs = intervals[_generator_of(member)]
            step = _containing([tuple(s) for s in logs["steps"]], t_ack)
            load = _containing([tuple(x) for x in logs["loads"]], t_live)
            fetched = [f for f in logs.get("fetches", {}).get(member, []) if f[1] == version]
            polls = logs.get("polls", [])
            # a load that began before this member held the version waited inside for it (a quiet generator's
            # does: _load_version waits on the fetch thread): its apply starts when the fetch returned
            held_at = fetched[0][0] if fetched else t_start
            load_start = max(load[0], held_at) if load else t_live
            i = _last_before([t for t, _ in polls], load_start)
            asked = polls[i][0] if i >= 0 and polls[i][0] >= t_ack - 1.0 else load_start
            step_s = step[1] - step[0] if step else 0.0
            step_end = step[1] if step else t_ack
            apply_s = load[1] - load_start if load else 0.0
            wait_s = t_live - t_ack
            bound_s = step_s + apply_s + poll_s
            late_steps = sum(1 for a, _ in logs["steps"] if t_ack < a < load_start)
            loads = [tuple(x) for x in logs["loads"]]
            at_start = ("loading" if _containing(loads, t_start) else "stepping"
                        if _containing([tuple(x) for x in logs["steps"]], t_start) else "other")
            rows.append({"version": version, "member": member, "start": t_start, "ack": t_ack, "live": t_live,
                         "at_start": at_start,
                         "push_s": float(p["sync/push_s"]), "staged_s": held_at - t_start if fetched else -1.0,
                         **_fetch_phases(fetched[0] if fetched else None, t_start),
                         "wait_s": wait_s, "step_s": step_s, "step_left_s": step_end - t_ack if step else 0.0,
                         "asked_s": asked - step_end, "between_s": load_start - step_end, "apply_s": apply_s,
                         "loop_state": _busiest_state(logs.get("states", []), step_end, asked),
                         "bound_s": bound_s, "held": wait_s <= bound_s, "late_steps": late_steps,
                         "held_steps": late_steps <= 1})
    return rows


def _fetch_phases(fetch: Sequence[float] | None, t_start: float) -> dict[str, float]:
    """From the push's start until this member's fetch thread saw its first chunk (``first_s``) and every byte
    (``bytes_s``); -1 where the fetch was not logged (or logged without them)."""
    if not fetch or len(fetch) < 4:
        return {"first_s": -1.0, "bytes_s": -1.0}
    t, _v, transfer_s, ack_s = fetch[:4]
    return {"first_s": t - transfer_s - t_start, "bytes_s": t - ack_s - t_start}


def timeline_summary(rows: list[dict[str, Any]], pushes: list[dict[str, Any]], lives: list[dict[str, float]],
                     members: int) -> dict[str, Any]:
    """Medians and maxima of :func:`served_timeline`'s rows; ``served_s``: per push from its start until the last
    member serves it (pushes every member served), the median; ``skipped``: (push, member) pairs never served (a
    newer version came first)."""

    def col(key: str) -> list[float]:
        return [float(r[key]) for r in rows]

    served = [max(live.values()) - (float(p["sync/acked_time"]) - float(p["sync/push_s"]))
              for p, live in zip(pushes, lives) if len(live) == members]
    worst = max(rows, key=lambda r: r["wait_s"] - r["bound_s"], default=None)
    return {"pairs": len(rows), "skipped": len(pushes) * members - len(rows), "served_s": median(served),
            "served_s_max": max(served, default=0.0),
            "ack_to_live_s": median(col("wait_s")), "ack_to_live_s_max": max(col("wait_s"), default=0.0),
            "step_s": median(col("step_s")), "step_left_s": median(col("step_left_s")),
            "between_s": median(col("between_s")), "between_s_max": max(col("between_s"), default=0.0),
            "staged_s": median([x for x in col("staged_s") if x >= 0]), "staged_s_max": max(col("staged_s"),
                                                                                              default=0.0),
            "first_s": median([x for x in col("first_s") if x >= 0]),
            "bytes_s": median([x for x in col("bytes_s") if x >= 0]),
            "loop_states_late": _count([r["loop_state"] for r in rows if not r["held"]]),
            "staged_s_by_state_at_start": {
                state: {"pairs": len(v), "median": median(v), "max": max(v)}
                for state in ("loading", "stepping", "other")
                if (v := [float(r["staged_s"]) for r in rows if r.get("at_start") == state and r["staged_s"] >= 0])},
            "apply_s": median(col("apply_s")), "apply_s_max": max(col("apply_s"), default=0.0),
            "in_step_at_ack": sum(r["step_s"] > 0 for r in rows), "bound_held": sum(r["held"] for r in rows),
            "steps_held": sum(r.get("held_steps", True) for r in rows),
            "late_steps_max": max((r.get("late_steps", 0) for r in rows), default=0),
            "worst": {k: (round(v, 4) if isinstance(v, float) and k not in ("start", "ack", "live") else v)
                      for k, v in worst.items()} if worst else {}}
