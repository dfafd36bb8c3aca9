"""What the buffer service decides, without sockets: admission, capacity, sampling, staleness, the ledger.

The store holds the state (held / delivered / trained / dropped, see store.py); this class decides the
transitions and passes the admission and service counters with each one, so a durable store persists
them together. At construction it restores those counters from the store: a service restarted on the
same Redis continues with the same version, admission counts and totals.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from async_rlhf.buffer.admission import AdmissionControl, is_stale, staleness
from async_rlhf.buffer.metrics import LatencyWindow, RateMeter
from async_rlhf.buffer.policy import check_policy, select, victim
from async_rlhf.buffer.store import DELIVERED, HELD, MemoryStore, StoredGroup
from async_rlhf.types import Group

ADMISSION_KEYS = ("version", "accepted", "running")


class BufferLogic:
    """Everything the service decides; unit tests drive it directly."""

    def __init__(self, store: MemoryStore, groups_per_version: int, max_staleness: int, *, capacity: int = 0,
                 policy: str = "fifo", visibility_timeout_s: float = 600.0) -> None:
        if capacity < 0:
            raise ValueError(f"buffer.capacity must be 0 (unbounded) or more, got {capacity}")
        self.store = store
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.policy = check_policy(policy)
        self.visibility_timeout_s = visibility_timeout_s
        meta = store.meta()
        self.admission = AdmissionControl(groups_per_version, max_staleness, **{
            k: int(meta[k]) for k in ADMISSION_KEYS if k in meta})
        self.counters: Counter[str] = Counter({k[2:]: int(v) for k, v in meta.items() if k.startswith("c:")})
        self.rejects: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self.put_rate, self.get_rate = RateMeter(), RateMeter()
        self.latency: dict[str, LatencyWindow] = {}
        self.started = time.time()

    # -- ledger views (kept for callers of the first version) --------------------------------
    @property
    def delivered(self) -> dict[str, int]:
        """group id -> learner version it was delivered at."""
        return {gid: d.version for gid, d in self.store.delivered().items()}

    @property
    def trained(self) -> set[str]:
        return self.store.trained()

    @property
    def dropped(self) -> dict[str, str]:
        return self.store.dropped()

    def _meta(self) -> dict[str, int]:
        a = self.admission
        return {"version": a.version, "accepted": a.accepted, "running": a.running,
                **{f"c:{k}": v for k, v in self.counters.items()}}

    def room(self) -> int | None:
        """Groups that may still be started or put before the capacity bound (None: unbounded)."""
        if not self.capacity:
            return None
        return self.capacity - len(self.store) - self.store.num_delivered() - self.admission.running

    # -- generators -------------------------------------------------------------------------
    def admit(self, want: int) -> dict[str, Any]:
        want = max(0, int(want))
        room = self.room()
        if room is not None:
            if room < want:
                self.counters["admit_full"] += 1  # persisted with the next write (refusals are frequent)
            want = min(want, max(0, room))
        granted = self.admission.admit(want)
        if granted:
            self.counters["admitted"] += granted
            self.store.save_meta(self._meta())
        return {"granted": granted, "version": self.admission.version}

    def release(self, n: int, consumer: str | None = None) -> dict[str, Any]:
        """Give back ``n`` unused admission slots; with ``consumer``, also declare that learner dead."""
        out: dict[str, Any] = {}
        n = max(0, int(n))
        if n:
            self.admission.release(n)
            self.store.save_meta(self._meta())
        if consumer:
            out["redelivered"] = self.declare_dead(str(consumer))
        return out

    def put(self, wire_group: Any) -> dict[str, Any]:
        group = Group.from_wire(wire_group)  # validates; raises WireError
        gid = group.group_id
        if self.store.state(gid) is not None:
            self.counters["duplicate_put"] += 1
            self.store.save_meta(self._meta())
            return {"accepted": False, "duplicate": True}
        min_version = group.min_version
        if self.capacity and len(self.store) + self.store.num_delivered() >= self.capacity:
            out = victim(self.policy, self.store.held(), min_version)
            if out is None:
                self.counters["put_full"] += 1
                self.store.save_meta(self._meta())
                return {"accepted": False, "duplicate": False, "full": True}
            self.admission.dropped(1)
            self.counters["dropped_evicted"] += 1
            self.store.drop([out.group_id], "evicted", self._meta())
        stored = StoredGroup(gid, min_version, len(group.samples), group.num_tokens, wire_group)
        self.admission.finished()
        self.counters["put"] += 1
        self.counters["put_tokens"] += group.num_tokens
        self.store.put(stored, self._meta())
        self.put_rate.add()
        return {"accepted": True, "duplicate": False}

    # -- learners ---------------------------------------------------------------------------
    def drop_stale(self, version: int) -> int:
        stale = [g.group_id for g in self.store.held() if is_stale(version, g.min_version, self.max_staleness)]
        if stale:
            self.admission.dropped(len(stale))
            self.counters["dropped_stale"] += len(stale)
            self.store.drop(stale, "stale", self._meta())
        return len(stale)

    def try_get(self, n: int, version: int, consumer: str = "anon") -> list[dict[str, Any]] | None:
        """``n`` fresh groups for ``consumer`` at learner ``version``, or None while fewer are held."""
        n, version = int(n), int(version)
        if n <= 0:
            return []
        self.drop_stale(version)
        if len(self.store) < n:
            return None
        chosen = [g.group_id for g in select(self.policy, self.store.held(), n)]
        redelivered = sum(1 for gid in chosen if self.store.get_held(gid).deliveries > 0)
        self.counters["delivered"] += len(chosen)
        self.counters["redelivered"] += redelivered
        taken = self.store.deliver(chosen, consumer, version, self._meta())
        for g in taken:
            self.staleness_hist[staleness(version, g.min_version)] += 1
        self.get_rate.add(len(taken))
        return [g.wire for g in taken]

    def ack(self, group_ids: list[Any]) -> dict[str, Any]:
        fresh: list[str] = []
        for gid in dict.fromkeys(map(str, group_ids)):
            state = self.store.state(gid)
            if state == "trained":
                self.counters["duplicate_ack"] += 1
            elif state == DELIVERED or (state == HELD and self.store.get_held(gid).deliveries > 0):
                fresh.append(gid)
            else:
                self.counters["unknown_ack"] += 1
        self.counters["duplicate_ack"] += len(group_ids) - len(set(map(str, group_ids)))
        self.counters["trained"] += len(fresh)
        self.store.ack(fresh, self._meta())
        return {"acked": len(fresh)}

    def tick(self, now: float | None = None) -> int:
        """Redeliver every group whose learner has not acked it within the visibility timeout."""
        now = time.time() if now is None else now
        overdue = [gid for gid, d in self.store.delivered().items() if now - d.at > self.visibility_timeout_s]
        return self._redeliver(overdue, "visibility_timeout")

    def declare_dead(self, consumer: str) -> int:
        """Take back everything delivered to ``consumer`` (its learner died) so others get it."""
        mine = [gid for gid, d in self.store.delivered().items() if d.consumer == consumer]
        return self._redeliver(mine, "consumer_dead")

    def _redeliver(self, gids: list[str], why: str) -> int:
        if not gids:
            return 0
        self.counters[f"returned_{why}"] += len(gids)
        return len(self.store.redeliver(gids, self._meta()))

    def drop_held(self, reason: str) -> int:
        """Mark every held group dropped (end of a run: generated, never trained)."""
        held = [g.group_id for g in self.store.held()]
        if held:
            self.admission.dropped(len(held))
            self.counters[f"dropped_{reason}"] += len(held)
            self.store.drop(held, reason, self._meta())
        return len(held)

    def set_version(self, version: int) -> dict[str, Any]:
        self.admission.set_version(int(version))
        self.store.save_meta(self._meta())
        return {"version": self.admission.version}

    # -- metrics ----------------------------------------------------------------------------
    def record_latency(self, kind: str, seconds: float) -> None:
        win = self.latency.get(kind)
        if win is None:
            win = self.latency[kind] = LatencyWindow()
        win.add(seconds)

    def stats(self, ledger: bool = False) -> dict[str, Any]:
        a = self.admission
        out: dict[str, Any] = {
            "buffer/store": self.store.name,
            "buffer/policy": self.policy,
            "buffer/depth": len(self.store),
            "buffer/version": a.version,
            "buffer/accepted": a.accepted,
            "buffer/running": a.running,
            "buffer/capacity": a.capacity,
            "buffer/capacity_groups": self.capacity,
            "buffer/delivered_unacked": self.store.num_delivered(),
            "buffer/trained_total": len(self.store.trained()),
            "buffer/dropped_total": len(self.store.dropped()),
            "buffer/put_per_s": self.put_rate.rate(),
            "buffer/get_per_s": self.get_rate.rate(),
            **{f"buffer/{k}": v for k, v in self.counters.items()},
            **{f"buffer/reject_{k}": v for k, v in self.rejects.items()},
            "staleness/hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
            "buffer/uptime_s": time.time() - self.started,
        }
        windows = list(self.latency.values())
        if windows:
            merged = LatencyWindow(size=sum(len(w) for w in windows))
            for w in windows:
                merged.extend(w)
            out["buffer/latency_p50_ms"], out["buffer/latency_p99_ms"] = merged.percentiles(0.5, 0.99)
        for kind, w in self.latency.items():
            out[f"buffer/latency_{kind}_p50_ms"], out[f"buffer/latency_{kind}_p99_ms"] = w.percentiles(0.5, 0.99)
        if ledger:
            out["ledger"] = {
                "held": [g.group_id for g in self.store.peek_all()],
                "delivered": sorted(self.store.delivered()),
                "trained": sorted(self.store.trained()),
                "dropped": dict(self.store.dropped()),
            }
        return out
