"""The weight push like with like (bench/scale.py, issue 46): the push and a raw broadcast of the same bytes to the
same receivers, both on the quiet fleet and both during training, and when each generator serves a pushed version.

    instrument(cluster)          before training: each generator's engine.step and _load_version log their wall
                                 times (instance attributes wrapped in place: the loop calls them through self)
    RawDuringTraining(cluster)   a thread: once learner rank 0 recorded ``after_steps`` steps, ``reps`` raw broadcasts
                                 (async_rlhf/sync/raw.py) while the run trains, on store connections of their own
                                 (the push thread's and the fetch threads' connections are never shared)
    raw_broadcast(cluster)       the same, called on the quiet fleet after training
    quiet_push(cluster)          after training: pushes of learner rank 0's weights as versions final + 1, ...; each
                                 generator serves each one as its loop would (polls its workers every UPDATE_POLL_S,
                                 loads at once; nothing else runs); per push its metrics and every member's live time
    training_live(cluster, ...)  after training: each member's live time of every push of the run (the store's)
    served_timeline(...)         per push and member: acknowledged -> the engine step in progress ends -> the load
                                 starts -> live (async_rlhf/driver/push_timeline.py: the pure part, re-exported)

The push's ``sync/push_s`` and the raw broadcast both run from learner rank 0 until every receiver holds the bytes
(the push's acknowledgement, the raw's one-element allreduce): they compare like with like. Serving the version is
the generator's loop's business afterwards, bounded by the engine step in progress plus the load (the apply).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

from async_rlhf.driver.push_timeline import median, served_timeline, timeline_summary, training_pushes

__all__ = [
    "RawDuringTraining", "generator_intervals", "instrument", "longest_wait_s", "quiet_push", "quiet_rounds",
    "raw_broadcast", "served_timeline", "thread_run_delays", "timeline_summary", "training_live", "training_pushes",
]

LOG_MAX = 200_000
"""Step and load intervals kept per generator (a few MB at most)."""


def _members(cluster: Any) -> list[str]:
    from async_rlhf.sync.protocol import tp_member_ids

    tp = cluster.cfg.resources.tensor_parallel
    return [m for i in range(len(cluster.generators)) for m in tp_member_ids(f"gen{i}", tp)]


# -- run inside the actors (through __ray_call__: the first argument is the actor instance) -----------------------
def _worker_instrument(worker: Any) -> None:
    """In a generator's vLLM worker: its receiver's fetch (the fetch thread calls it each time through the
    attribute) logs when it returned which version (this member held the bytes and had acknowledged), and how
    long before that its thread saw the first chunk (``sync/transfer_s``) and every byte (``sync/ack_s``)."""
    from collections import deque

    rx = worker._receiver  # vLLM's worker wrapper hands unknown attributes to the worker (worker_ext.py's)
    if rx is None or getattr(rx, "_push_timing_fetches", None) is not None:
        return
    fetches: deque = deque(maxlen=LOG_MAX)
    fetch = rx.fetch

    def timed_fetch(*args: Any, **kwargs: Any) -> Any:
        staged = fetch(*args, **kwargs)
        fetches.append((time.time(), int(staged.version), float(staged.metrics.get("sync/transfer_s", 0.0)),
                        float(staged.metrics.get("sync/ack_s", 0.0))))
        return staged

    rx.fetch, rx._push_timing_fetches = timed_fetch, fetches


def _worker_fetches(worker: Any) -> dict[str, Any]:
    rx = worker._receiver
    return {"member": rx.member_id, "fetches": list(getattr(rx, "_push_timing_fetches", ()) or ())}


def _instrument(gen: Any) -> None:
    if getattr(gen, "_push_timing_steps", None) is not None:
        return
    from collections import deque

    steps: deque = deque(maxlen=LOG_MAX)
    loads: deque = deque(maxlen=LOG_MAX)
    polls: deque = deque(maxlen=LOG_MAX)
    step, load, staged = gen.engine.step, gen._load_version, gen._staged

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return step(*args, **kwargs)
        finally:
            steps.append((t0, time.time()))

    def timed_load() -> None:
        t0 = time.time()
        try:
            load()
        finally:
            loads.append((t0, time.time()))

    def timed_staged() -> int | None:
        got = staged()
        polls.append((time.time(), -2 if got is None else int(got)))
        return got

    gen.engine.step, gen._load_version, gen._staged = timed_step, timed_load, timed_staged
    gen._push_timing_steps, gen._push_timing_loads, gen._push_timing_polls = steps, loads, polls
    gen.llm.collective_rpc(_worker_instrument)


def _intervals(gen: Any) -> dict[str, Any]:
    fetches = {w["member"]: w["fetches"] for w in gen.llm.collective_rpc(_worker_fetches)}
    return {"steps": list(getattr(gen, "_push_timing_steps", ()) or ()),
            "loads": list(getattr(gen, "_push_timing_loads", ()) or ()),
            "polls": list(getattr(gen, "_push_timing_polls", ()) or ()), "fetches": fetches,
            "states": [list(x) for x in gen.timeline.intervals()]}


def _steps_done(learner: Any) -> int:
    return len(learner.metrics)


def _raw_send(learner: Any, world: int, tag: str, reps: int, idle_s: float = 0.0) -> dict[str, Any]:
    from async_rlhf.sync.group import connect_store
    from async_rlhf.sync.raw import raw_send

    sender, timeout_s = learner._pusher.sender, learner.cfg.sync.timeout_s
    store = connect_store(sender.host, sender.port, timeout_s)
    nbytes = sum(b.nbytes for b in learner._buckets)
    t0 = time.time()
    seconds = raw_send(store, sender.transport, nbytes, world, tag, reps, timeout_s, idle_s)
    return {"bytes": nbytes, "seconds": seconds, "t_start": t0, "t_end": time.time()}


def _worker_raw_receive(worker: Any, tag: str, members: list[str], nbytes: int, reps: int) -> None:
    from async_rlhf.sync.group import connect_store
    from async_rlhf.sync.raw import raw_receive

    rx = worker._receiver  # vLLM's worker wrapper hands unknown attributes to the worker (worker_ext.py's)
    store = connect_store(rx.store.host, rx.store.port, rx.timeout_s)
    raw_receive(store, rx.transport, members.index(rx.member_id) + 1, len(members) + 1, nbytes, tag, reps,
                rx.timeout_s)


def _raw_receive(gen: Any, tag: str, members: list[str], nbytes: int, reps: int) -> None:
    gen.llm.collective_rpc(_worker_raw_receive, args=(tag, list(members), int(nbytes), int(reps)))


def thread_run_delays() -> dict[str, int]:
    """Per thread of this process: the nanoseconds it has spent runnable but waiting for a core (the run queue;
    Linux's /proc/self/task/*/schedstat, second field); empty where there is none."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return out


def longest_wait_s(before: dict[str, int], after: dict[str, int]) -> float:
    """The longest any one thread waited for a core between two :func:`thread_run_delays`, in seconds."""
    return max((after[t] - before[t] for t in after if t in before), default=0) / 1e9


def _push_versions(learner: Any, count: int, timeout_s: float, settle_s: float) -> list[dict[str, Any]]:
    """Learner rank 0: ``count`` pushes of its current weights as the next versions, each awaited until every
    member serves it (or ``timeout_s``), then ``settle_s`` for the members to finish the load and post their
    receives again (the raw broadcast, likewise, starts once every member is posted); the parameters are read as
    the run's pushes read them."""
    if learner.merged is None and learner.cfg.learner.zero_stage == 3:
        raise RuntimeError("a quiet push under ZeRO-3 needs every rank's gather: not measured")
    sender = learner._pusher.sender
    params = learner.merged.tensors if learner.merged is not None else dict(learner.engine.module.named_parameters())
    out = []
    for _ in range(count):
        version = (sender.version or 0) + 1
        waited = thread_run_delays()
        metrics = sender.push(params, version)
        # the sender's threads (its gloo loop and worker, the store's, this one) waiting for a core meanwhile
        metrics["sync/sender_run_delay_s"] = longest_wait_s(waited, thread_run_delays())
        epoch, k, _ids = sender._last
        out.append({**metrics, "epoch": epoch, "k": k, "live": sender.wait_live(timeout_s)})
        time.sleep(settle_s)
    return out


def _serve_versions(gen: Any, last: int, timeout_s: float) -> int:
    """A generator on the quiet fleet (its loop ended) serving every version up to ``last`` as soon as it arrives:
    the loop's load (``_load_version``: its workers' ``apply_update`` waits on their fetch thread's condition, so
    nothing polls and the receivers are as idle as the raw broadcast's)."""
    deadline = time.monotonic() + timeout_s
    while gen.version < last and time.monotonic() < deadline:
        gen._load_version()
    return int(gen.version)


def _live_times(learner: Any, pushes: list[tuple[int, int]], members: list[str]) -> list[dict[str, float]]:
    """Per (epoch, k): member -> the wall time it started serving that push (absent: it never did, e.g. a
    version skipped because a newer one arrived first)."""
    from async_rlhf.sync import protocol as P
    from async_rlhf.sync.group import connect_store

    sender = learner._pusher.sender
    store = connect_store(sender.host, sender.port, learner.cfg.sync.timeout_s)
    out = []
    for e, k in pushes:
        got: dict[str, float] = {}
        for m in members:
            key = P.live_key(e, k, m)
            if store.check([key]):
                text = store.get(key).decode()
                if not text.startswith("error"):
                    got[m] = float(text)
        out.append(got)
    return out


# -- called by the driver --------------------------------------------------------------------------------------
def instrument(cluster: Any) -> None:
    import ray

    ray.get([g.__ray_call__.remote(_instrument) for g in cluster.generators])


def generator_intervals(cluster: Any) -> list[dict[str, list[tuple[float, float]]]]:
    import ray

    return ray.get([g.__ray_call__.remote(_intervals) for g in cluster.generators])


def raw_broadcast(cluster: Any, reps: int, idle_s: float = 0.0) -> dict[str, Any]:
    """``reps`` raw broadcasts (after a warm-up) of the push's bytes from learner rank 0 to every generator worker:
    the median seconds, each repetition's, the bytes and when they ran (wall times). ``idle_s``: each starts that
    long after every member posted (:func:`async_rlhf.sync.raw.raw_send`)."""
    import ray

    from async_rlhf.sync.layout import layout_from_wire

    members = _members(cluster)
    tag = uuid.uuid4().hex[:12]
    nbytes = sum(b.nbytes for b in layout_from_wire(cluster.layout))
    receives = [g.__ray_call__.remote(_raw_receive, tag, members, nbytes, reps) for g in cluster.generators]
    sent = ray.get(cluster.learners[0].__ray_call__.remote(_raw_send, len(members) + 1, tag, reps, idle_s))
    ray.get(receives)
    if sent["bytes"] != nbytes:
        raise RuntimeError(f"the learner pushes {sent['bytes']} bytes, the layout handed out says {nbytes}")
    return {"raw_s": median(sent["seconds"]), "seconds": sent["seconds"], "bytes": sent["bytes"],
            "receivers": len(members), "t_start": sent["t_start"], "t_end": sent["t_end"]}


class RawDuringTraining:
    """:func:`raw_broadcast` on a thread of the driver, started once learner rank 0 has recorded ``after_steps``
    steps (the first step's warm-up left out); :meth:`result` joins it (an error is returned, not raised: the run's
    figures stand without it)."""

    def __init__(self, cluster: Any, reps: int, after_steps: int = 1, poll_s: float = 0.2) -> None:
        self.cluster, self.reps, self.after_steps, self.poll_s = cluster, reps, after_steps, poll_s
        self._stop = threading.Event()
        self._out: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="raw-during-training", daemon=True)

    def start(self, *_: Any) -> None:
        """Start the thread (takes and ignores runner.train's ``on_fleet`` argument)."""
        self._thread.start()

    def _run(self) -> None:
        import ray

        try:
            learner = self.cluster.learners[0]
            while not self._stop.is_set():
                if ray.get(learner.__ray_call__.remote(_steps_done)) >= self.after_steps:
                    self._out = raw_broadcast(self.cluster, self.reps)
                    return
                time.sleep(self.poll_s)
            self._out = {"error": "training ended before the raw broadcast started"}
        except Exception as exc:  # reported in the row
            self._out = {"error": f"{type(exc).__name__}: {exc}"}

    def result(self, timeout_s: float = 300.0) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout_s)
        return dict(self._out) if not self._thread.is_alive() else {"error": f"still running after {timeout_s} s"}


def quiet_push(cluster: Any, reps: int, timeout_s: float = 120.0, settle_s: float = 0.2) -> list[dict[str, Any]]:
    """On the quiet fleet after training: a warm-up and ``reps`` pushes (see :func:`_push_versions`), every
    generator serving each version as it arrives; per push (warm-up left out) its metrics and ``live``."""
    import ray

    start = ray.get(cluster.generators[0].__ray_call__.remote(lambda g: int(g.version)))
    serving = [g.__ray_call__.remote(_serve_versions, start + reps + 1, timeout_s) for g in cluster.generators]
    pushes = ray.get(cluster.learners[0].__ray_call__.remote(_push_versions, reps + 1, timeout_s, settle_s))
    ray.get(serving)
    return pushes[1:]


def quiet_rounds(cluster: Any, reps: int, rounds: int = 2, timeout_s: float = 120.0,
                 settle_s: float = 0.2) -> dict[str, Any]:
    """``rounds`` times: ``reps`` raw broadcasts sent as soon as every member posted (``at_once``), ``reps`` raw
    broadcasts sent ``settle_s`` after (``raw``: like with like, as each push starts ``settle_s`` after the last
    one was served), then ``reps`` pushes, on the quiet fleet (alternating blocks: a drift of the machine's load
    reaches all three); the raw broadcasts' seconds, the pushes (:func:`quiet_push`)."""
    at_once: list[float] = []
    raws: list[float] = []
    pushes: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for _ in range(rounds):
        at_once += raw_broadcast(cluster, reps)["seconds"]
        raw = raw_broadcast(cluster, reps, idle_s=settle_s)
        raws += raw["seconds"]
        pushes += quiet_push(cluster, reps, timeout_s, settle_s)
    return {"raw": {**raw, "raw_s": median(raws), "seconds": raws, "idle_s": settle_s,
                    "at_once_s": median(at_once), "at_once_seconds": at_once}, "pushes": pushes}


def training_live(cluster: Any, pushes: list[dict[str, Any]]) -> list[dict[str, float]]:
    import ray

    keys = [(p["epoch"], p["k"]) for p in pushes]
    return ray.get(cluster.learners[0].__ray_call__.remote(_live_times, keys, _members(cluster)))
