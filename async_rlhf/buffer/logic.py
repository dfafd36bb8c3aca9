"""What the buffer service decides, without sockets: admission, capacity, sampling, staleness, the ledger.

The store holds the state (held / delivered / trained / dropped, see store.py); this class decides the
transitions and passes the admission and service counters with each one, so a durable store persists
them together. At construction it restores those counters from the store: a service restarted on the
same Redis continues with the same version, admission counts and totals.

What happens to a group once delivered (its consumer's lease: renew, time out, reclaim, a dead learner) and the
resume's restore of admission are in ``leases.py``, the base class of :class:`BufferLogic`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter, OrderedDict
from typing import Any

import msgpack

from async_rlhf.buffer.admission import AdmissionControl, is_stale, staleness
from async_rlhf.buffer.envelope import Envelope, inspect_group
from async_rlhf.buffer.leases import ConsumerLeases
from async_rlhf.buffer.metrics import LatencyWindow, RateMeter
from async_rlhf.buffer.policy import check_policy, select, victim
from async_rlhf.buffer.store import AWAITING, DELIVERED, DROPPED, HELD, TRAINED, Store, StoredGroup
from async_rlhf.prompt_window import Windows, is_open
from async_rlhf.wire import WireError

ADMISSION_KEYS = ("version", "accepted", "running")
PUT_OK, PUT_DUPLICATE, PUT_FULL = "ok", "duplicate", "full"
NO_FLOOR = 1 << 62
ADMIT_MEMORY = 4096
"""How many admit request ids the service remembers: a retried admit is answered from here, never granted twice."""
DROP_STREAK_BATCHES = 4
"""Dynamic sampling gives up (keeps uniform groups) after this many batches' worth of them in a row."""
REWARD_REFUSALS = {None: "unknown_group", HELD: "already_rewarded", DELIVERED: "already_rewarded",
                   TRAINED: "finished", DROPPED: "finished"}


class BufferLogic(ConsumerLeases):
    """Everything the service decides; unit tests drive it directly. The consumer leases (``tick``, ``renew``,
    ``reclaim``, ``declare_dead``, ``drop_held``) and ``restore_admission`` are in ``leases.py``."""

    def __init__(self, store: Store, groups_per_version: int, max_staleness: int, *, capacity: int = 0,
                 policy: str = "fifo", visibility_timeout_s: float = 600.0, reward_deadline_s: float = 60.0,
                 drop_zero_advantage: bool = False) -> None:
        """``drop_zero_advantage``: a complete group whose rewards are all equal is dropped as soon as it is
        put or rewarded (reason ``zero_advantage``, its admission slot goes back to the generators), so
        learners only get groups that carry a gradient under a group baseline (DAPO's dynamic sampling).
        Once ``DROP_STREAK_BATCHES`` batches' worth of uniform groups in a row were dropped (a policy that
        always fails, or always succeeds), uniform groups are kept again until an informative one comes:
        training goes on instead of waiting forever (counted as ``kept_zero_advantage``)."""
        if capacity < 0:
            raise ValueError(f"buffer.capacity must be 0 (unbounded) or more, got {capacity}")
        if not reward_deadline_s > 0:
            raise ValueError(f"buffer.reward_deadline_s must be above 0, got {reward_deadline_s}")
        self.reward_deadline_s = reward_deadline_s
        self.drop_zero_advantage = drop_zero_advantage
        self._uniform_streak = 0  # uniform groups in a row since the last informative one
        self._consumed_unreported: list[str] = []  # dropped as zero_advantage, not yet reported by an ack
        self._admits: OrderedDict[str, dict[str, Any]] = OrderedDict(
            (rid, {"granted": g, "version": v}) for rid, (g, v) in store.admits().items())
        self.store = store
        self.max_staleness = max_staleness
        self.capacity = capacity
        self.policy = check_policy(policy)
        self.visibility_timeout_s = visibility_timeout_s
        meta = store.meta()
        self.admission = AdmissionControl(groups_per_version, max_staleness, **{
            k: int(meta[k]) for k in ADMISSION_KEYS if k in meta})
        self.counters: Counter[str] = Counter({k[2:]: int(v) for k, v in meta.items() if k.startswith("c:")})
        self.holdings: Counter[str] = Counter(
            {k[2:]: int(v) for k, v in meta.items() if k.startswith("h:") and int(v) > 0})
        """Admission slots each generator (by its client's name) holds: granted, not yet put or released. When a
        generator dies, :meth:`release_holder` gives back exactly these (the driver's polled count is seconds
        old). Saved with the admission counters (``h:<holder>`` in the meta): a service restarted on a durable store
        still releases a dead generator's slots (issue 44, item 12)."""
        self._holders_saved: set[str] = {k[2:] for k in meta if k.startswith("h:")}
        """Holders whose count the store has: a holder whose slots all ended is saved as 0, not left at its last."""
        self._dead_holders: set[str] = set()
        """Holders released by :meth:`release_holder` that have not admitted since: a put of theirs still on its
        way counts as accepted but ends no running slot (those went back already)."""
        self.rejects: Counter[str] = Counter()
        self.staleness_hist: Counter[int] = Counter()
        self.put_rate, self.get_rate = RateMeter(), RateMeter()
        self.latency: dict[str, LatencyWindow] = {}
        self.started = time.time()

    def _meta(self) -> dict[str, int]:
        a = self.admission
        self._holders_saved.update(self.holdings)
        return {"version": a.version, "accepted": a.accepted, "running": a.running,
                **{f"c:{k}": v for k, v in self.counters.items()},
                **{f"h:{h}": self.holdings.get(h, 0) for h in self._holders_saved}}

    def room(self) -> int | None:
        """Groups that may still be started or put before the capacity bound (None: unbounded)."""
        if not self.capacity:
            return None
        return self.capacity - self._stored() - self.admission.running

    def _stored(self) -> int:
        """Groups that take room: held, awaiting their reward, delivered and not yet acknowledged."""
        return len(self.store) + len(self.store.awaiting()) + self.store.num_delivered()

    # -- generators -------------------------------------------------------------------------
    def _unhold(self, holder: str | None, n: int) -> None:
        """``holder``'s slots that ended (put or released): at most what it holds."""
        if holder is not None and n > 0 and holder in self.holdings:
            self.holdings[holder] -= min(n, self.holdings[holder])
            if self.holdings[holder] <= 0:
                del self.holdings[holder]

    def release_holder(self, holder: str) -> dict[str, Any]:
        """``holder`` (a generator's client) is gone: give back exactly the admission slots it still held."""
        n = self.holdings.pop(str(holder), 0)
        self._dead_holders.add(str(holder))
        if n:
            self.admission.release(n)
            self.counters["released_dead_holder"] += n
            self.store.save_meta(self._meta())
        return {"released": n}

    def admit(self, want: int, request_id: str | None = None, holder: str | None = None) -> dict[str, Any]:
        """Grant up to ``want`` new groups (to ``holder``, whose slots are counted until put or released). A
        repeated ``request_id`` (a client retry) gets the first answer."""
        if request_id is not None:
            earlier = self._admits.get(request_id)
            if earlier is not None:
                self.counters["admit_retried"] += 1
                return earlier
        want = max(0, int(want))
        room = self.room()
        if room is not None:
            if room < want:
                self.counters["admit_full"] += 1  # persisted with the next write (refusals are frequent)
            want = min(want, max(0, room))
        granted = self.admission.admit(want)
        out = {"granted": granted, "version": self.admission.version}
        if holder is not None:
            self._dead_holders.discard(holder)  # a restarted generator under the same name
        if granted:
            if holder is not None:
                self.holdings[holder] += granted
            self.counters["admitted"] += granted
            if request_id is None:
                self.store.save_meta(self._meta())
            else:  # a durable store keeps the answer with the counters: a retry after a restart finds it too
                self._admits[request_id] = out
                if len(self._admits) > ADMIT_MEMORY:
                    self._admits.popitem(last=False)
                self.store.save_admit(request_id, granted, self.admission.version, ADMIT_MEMORY, self._meta())
        return out

    def release(self, n: int, consumer: str | None = None, holder: str | None = None) -> dict[str, Any]:
        """Give back ``n`` unused admission slots (``holder``'s); with ``consumer``, also declare that learner dead."""
        out: dict[str, Any] = {}
        n = max(0, int(n))
        if n and not (holder is not None and holder in self._dead_holders):  # a dead one's went back already
            self.admission.release(n)
            self._unhold(holder, n)
            self.store.save_meta(self._meta())
        if consumer:
            out["redelivered"] = self.declare_dead(str(consumer))
        return out

    def put(self, wire_group: Any, rewards_pending: bool = False, holder: str | None = None) -> dict[str, Any]:
        """Store one complete group, given as its wire map or its msgpack bytes (kept as they are).

        A known id (in any state) is a duplicate: answered, counted, never stored twice, so a client may
        repeat a put whose reply it lost. With ``rewards_pending`` the group waits in ``awaiting_reward``
        until :meth:`reward` (or the reward deadline) and is never delivered before.
        """
        if isinstance(wire_group, bytes):
            status = self.put_many([wire_group], rewards_pending, holder)[0]
        else:
            env = inspect_group(wire_group)  # validates; raises WireError
            status = self._store([(env, msgpack.packb(wire_group, use_bin_type=True))], rewards_pending, holder)[0]
        return {"accepted": status == PUT_OK, "duplicate": status == PUT_DUPLICATE, **(
            {"full": True} if status == PUT_FULL else {})}

    def put_many(self, groups: list[bytes], rewards_pending: bool = False, holder: str | None = None) -> list[str]:
        """Store groups given as msgpack bytes; one status each (``ok``, ``duplicate``, ``full``).

        All are checked before any is stored, so one malformed group refuses the whole call (WireError).
        """
        checked = []
        unpackb = msgpack.unpackb
        for i, data in enumerate(groups):
            try:
                wire = unpackb(data, raw=False, strict_map_key=True)
            except Exception as exc:  # msgpack raises several unrelated types on garbage
                raise WireError("malformed", f"group {i} of the put is not msgpack ({type(exc).__name__})") from None
            checked.append((inspect_group(wire), data))
        return self._store(checked, rewards_pending, holder)

    def _store(self, checked: list[tuple[Envelope, bytes]], rewards_pending: bool,
               holder: str | None = None) -> list[str]:
        status: list[str] = []
        fresh: list[StoredGroup] = []
        taken: set[str] = set()
        stored = self._stored()
        state, now = self.store.state, time.time()
        for env, data in checked:
            gid = env.group_id
            if gid in taken or state(gid) is not None:
                self.counters["duplicates"] += 1
                status.append(PUT_DUPLICATE)
                continue
            if self.capacity and stored + len(fresh) >= self.capacity:
                out = victim(self.policy, self.store.held(), env.min_version)
                if out is None:
                    self.counters["put_full"] += 1
                    status.append(PUT_FULL)
                    continue
                self.admission.dropped(1)
                self.counters["dropped_evicted"] += 1
                self.store.drop([out.group_id], "evicted", self._meta())
                stored -= 1
            taken.add(gid)
            fresh.append(StoredGroup(gid, env.min_version, env.num_samples, env.num_tokens, data, since=now))
            status.append(PUT_OK)
        if fresh:
            self.admission.finished(len(fresh), slots_released=holder is not None and holder in self._dead_holders)
            self._unhold(holder, len(fresh))
            self.counters["put_tokens"] += sum(g.num_tokens for g in fresh)
            self.counters["put"] += len(fresh)
            if rewards_pending:
                self.counters["put_awaiting_reward"] += len(fresh)
            self.store.put_many(fresh, self._meta(), awaiting=bool(rewards_pending))
            self.put_rate.add(len(fresh))
            if self.drop_zero_advantage and not rewards_pending:
                self._drop_uninformative([env.group_id for env, _ in checked if env.group_id in taken
                                          and self._uninformative(env.uniform_reward)])
        else:  # duplicates or "full" only: persist their counters (a durable store reloads them)
            self.store.save_meta(self._meta())
        return status

    def reward(self, group_id: Any, rewards: Any) -> dict[str, Any]:
        """Fill the rewards of a group put with ``rewards_pending`` (one per sample, in order) and release it.

        A reward for a group that is unknown, finished or already rewarded is answered ``ok=False`` with a
        reason and counted; a wrong count or a non-number is a malformed request (nothing changes).
        """
        if not isinstance(group_id, str) or not group_id:
            raise WireError("malformed", "reward needs group_id, a non-empty string")
        if not isinstance(rewards, list) or not all(
                type(r) in (int, float) and math.isfinite(r) for r in rewards):
            raise WireError("malformed", "rewards must be a list of finite numbers, one per sample in sample order")
        state = self.store.state(group_id)
        if state != AWAITING:
            reason = REWARD_REFUSALS.get(state, "not_awaiting")
            self.counters[f"reward_refused_{reason}"] += 1
            return {"ok": False, "reason": reason, "state": state}
        group = self.store.awaiting()[group_id]
        if len(rewards) != group.num_samples:
            raise WireError("malformed", f"group {group_id} has {group.num_samples} samples but {len(rewards)} "
                                         "rewards were given; send exactly one reward per sample, in sample order")
        self.counters["rewarded"] += 1
        if self.drop_zero_advantage and self._uninformative(len(set(rewards)) == 1):
            self._drop_uninformative([group_id])
            return {"ok": True, "dropped": "zero_advantage"}
        wire = group.wire
        for sample, r in zip(wire["samples"], rewards, strict=True):
            sample["reward"] = float(r)
        self.store.reward(group_id, msgpack.packb(wire, use_bin_type=True), self._meta())
        return {"ok": True}

    def _uninformative(self, uniform: bool) -> bool:
        """Whether to drop a complete group (see ``drop_zero_advantage``); counts the streak."""
        if not uniform:
            self._uniform_streak = 0
            return False
        self._uniform_streak += 1
        if self._uniform_streak > DROP_STREAK_BATCHES * self.admission.groups_per_version:
            self.counters["kept_zero_advantage"] += 1
            return False
        return True

    def _drop_uninformative(self, group_ids: list[str]) -> None:
        """Drop complete groups whose rewards are all equal (reason ``zero_advantage``)."""
        if group_ids:
            self.admission.dropped(len(group_ids))
            self.counters["dropped_zero_advantage"] += len(group_ids)
            self.store.drop(group_ids, "zero_advantage", self._meta())
            self._consumed_unreported += group_ids

    def abandon(self, group_ids: list[str]) -> dict[str, Any]:
        """Drop groups still awaiting their reward whose generator gives up on it (a scale-down ends it): reason
        ``reward_abandoned``, admission back at once; their prompts stay outstanding for the driver to issue
        again. Groups in any other state are left alone."""
        gids = [g for g in dict.fromkeys(map(str, group_ids)) if self.store.state(g) == AWAITING]
        if gids:
            self.admission.dropped(len(gids))
            self.counters["dropped_reward_abandoned"] += len(gids)
            self.store.drop(gids, "reward_abandoned", self._meta())
        return {"abandoned": gids}

    def expire_rewards(self, now: float | None = None) -> int:
        """Drop (reason ``reward_timeout``) every group still awaiting its reward after the deadline."""
        now = time.time() if now is None else now
        late = [gid for gid, g in self.store.awaiting().items() if now - g.since > self.reward_deadline_s]
        if late:
            self.admission.dropped(len(late))
            self.counters["dropped_reward_timeout"] += len(late)
            self.store.drop(late, "reward_timeout", self._meta())
        return len(late)

    # -- learners ---------------------------------------------------------------------------
    def drop_stale(self, version: int) -> int:
        floor = self.store.held_floor()
        if floor is not None and not is_stale(version, floor, self.max_staleness):
            return 0  # no held group can be stale: skip the scan
        stale = [g.group_id for g in self.store.held() if is_stale(version, g.min_version, self.max_staleness)]
        if stale:
            self.admission.dropped(len(stale))
            self.counters["dropped_stale"] += len(stale)
            self.store.drop(stale, "stale", self._meta())
        self.store.set_held_floor(min((g.min_version for g in self.store.held()), default=NO_FLOOR))
        return len(stale)

    def try_get(self, n: int, version: int, consumer: str = "anon", at_least: int | None = None) -> list[bytes] | None:
        """Up to ``n`` fresh groups (their bytes) for ``consumer`` at learner ``version``.

        None while fewer than ``at_least`` (default ``n``) are held; a learner asks for exactly its share,
        a streaming consumer for "up to n, at least 1".
        """
        taken = self.take(n, version, consumer, at_least)
        return None if taken is None else [g.data for g in taken]

    def take(self, n: int, version: int, consumer: str = "anon",
             at_least: int | None = None) -> list[StoredGroup] | None:
        """:meth:`try_get` returning the stored groups (id and bytes)."""
        n, version = int(n), int(version)
        if n <= 0:
            return []
        at_least = n if at_least is None else max(1, min(int(at_least), n))
        self.drop_stale(version)
        if len(self.store) < at_least:
            return None
        n = min(n, len(self.store))
        if self.policy == "fifo" and self.store.held_in_order():
            chosen = list(itertools.islice(self.store.held_ids(), n))
        else:
            chosen = [g.group_id for g in select(self.policy, self.store.held(), n)]
        redelivered = sum(1 for gid in chosen if self.store.get_held(gid).deliveries > 0)
        self.counters["delivered"] += len(chosen)
        self.counters["redelivered"] += redelivered
        taken = self.store.deliver(chosen, consumer, version, self._meta())
        for g in taken:
            self.staleness_hist[staleness(version, g.min_version)] += 1
        self.get_rate.add(len(taken))
        return taken

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
        # the groups dropped as zero_advantage since the last ack: their prompts were used up (judged, not
        # trained), so the driver's prompt ledger never issues them again. Kept in memory only: a restarted
        # service forgets the ones not yet reported, whose prompts are then issued again
        consumed, self._consumed_unreported = self._consumed_unreported, []
        return {"acked": len(fresh), **({"consumed": consumed} if consumed else {})}

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

    def stats(self, ledger: bool = False, ledger_of: Windows | None = None) -> dict[str, Any]:
        """Counters; with ``ledger`` every group id by state. ``ledger_of`` (the driver's open ledger,
        ``async_rlhf.prompt_window``) keeps only the groups still open in it: a reply bounded by what is in
        flight, not by the run's length."""
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
            "buffer/awaiting_reward": len(self.store.awaiting()),
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
            def keep(gid: str) -> bool:
                return ledger_of is None or is_open(gid, ledger_of)

            out["ledger"] = {
                "held": [g.group_id for g in self.store.peek_all() if keep(g.group_id)],
                "awaiting_reward": sorted(g for g in self.store.awaiting() if keep(g)),
                "delivered": sorted(g for g in self.store.delivered() if keep(g)),
                "trained": sorted(g for g in self.store.trained() if keep(g)),
                "dropped": {g: why for g, why in self.store.dropped().items() if keep(g)},
            }
            out["holders"] = dict(self.holdings)  # admission slots each generator holds (see release_holder)
        return out
