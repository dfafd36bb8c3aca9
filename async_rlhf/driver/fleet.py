"""The generator fleet while training runs: scale it, restart what died, re-issue what was in flight.

    driver progress loop, every ~0.5 s:  fleet.poll()
      scale request pending?   more: start gen k, late-join the push group (current weights first), run
                               fewer: stop(drain=True) the newest; once its groups are put, kill it
      a run() ref failed?      Ray restarted the actor (max_restarts): wait until it is up, re-join late
                               under a new member id, re-issue its in-flight prompts, count the restart

Requests come from :meth:`Fleet.request_scale` (Python) or from the control endpoint (``driver/control.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from async_rlhf.driver.handles import BufferStats, RoleCluster
from async_rlhf.driver.prompt_ledger import PromptLedger
from async_rlhf.generator.lanes import Layout
from async_rlhf.generator.stream import client_name

log = logging.getLogger(__name__)

MAX_GENERATORS = 4096
RESTART_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


class RunFailure(RuntimeError):
    """A role failed in a way a restart cannot mend (e.g. its reward source is broken): the run stops."""


class Fleet:
    """The live generators of one run; every method runs on the driver's progress thread except
    :meth:`request_scale` and :meth:`status` (any thread)."""

    def __init__(self, cluster: RoleCluster, ledger: PromptLedger, buffer_client: BufferStats,
                 version: int | None = None,
                 rolled_back: set[str] | None = None) -> None:
        """``rolled_back``: group ids the buffer saw trained after the checkpoint a run resumed from (their
        training was undone with the model: their prompts are issued again, never skipped)."""
        self.cluster = cluster
        self.rolled_back = rolled_back or set()
        self.ledger = ledger
        self.buffer_client = buffer_client
        self.version = version
        self.handles: dict[int, Any] = dict(enumerate(cluster.generators))
        self.runs: dict[int, Any] = {}
        self.draining: dict[int, Any] = {}
        self.final_stats: dict[int, dict[str, Any]] = {}
        self.last_stats: dict[int, dict[str, Any]] = {}
        self.incarnation: Counter[int] = Counter()
        self._joined_at: dict[int, float] = {}
        self._lagging_since: dict[int, float] = {}
        self.counters: Counter[str] = Counter()
        self.events: list[dict[str, Any]] = []
        self._target: int | None = None
        self.stop_requested = threading.Event()
        self._lock = threading.Lock()

    # -- requests (any thread) ----------------------------------------------------------------
    def request_scale(self, generators: int) -> None:
        if type(generators) is not int or not 1 <= generators <= MAX_GENERATORS:
            raise ValueError(f"--generators must be an integer between 1 and {MAX_GENERATORS}, got {generators!r}")
        with self._lock:
            self._target = generators

    def max_generators(self) -> int:
        """The largest fleet the cluster can hold now: the live generators plus as many more as Ray's free
        CPUs and GPUs fit (``resources.generator_cpus``/``generator_gpus`` each); any thread."""
        import ray

        res = self.cluster.cfg.resources
        free = ray.available_resources()
        fits = [MAX_GENERATORS]
        if res.generator_cpus > 0:
            fits.append(int(free.get("CPU", 0.0) // res.generator_cpus))
        if res.generator_gpus > 0:
            fits.append(int(free.get("GPU", 0.0) // res.generator_gpus))
        with self._lock:
            live = len(self.handles) - len(self.draining)
        return min(MAX_GENERATORS, live + min(fits))

    def request_stop(self) -> None:
        """End the run early: learners stop at a common step boundary and write a final checkpoint."""
        self.stop_requested.set()

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"generators": sorted(self.handles), "draining": sorted(self.draining),
                    "target": self._target, **{f"fleet/{k}": v for k, v in dict(self.counters).items()}}

    def pids(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Process ids of the learner ranks (by rank) and live generators (by id); any thread. An actor that
        does not answer within ``timeout_s`` (restarting) is left out."""
        import ray

        with self._lock:
            gens = dict(self.handles)
        refs = {lr.__ray_call__.remote(_actor_pid): ("learners", r) for r, lr in enumerate(self.cluster.learners)}
        refs.update({g.__ray_call__.remote(_actor_pid): ("generators", gen) for gen, g in gens.items()})
        refs[self.cluster.buffer.__ray_call__.remote(_actor_pid)] = ("buffer", None)
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out: dict[str, Any] = {"learners": {}, "generators": {}, "buffer": None}
        for ref in ready:
            role, key = refs[ref]
            try:
                pid = int(ray.get(ref))
            except ray.exceptions.RayError:
                continue  # died since
            if key is None:
                out[role] = pid
            else:
                out[role][str(key)] = pid
        return out

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {"fleet/generators": float(len(self.handles) - len(self.draining)),
                    **{f"fleet/{k}": float(v) for k, v in self.counters.items()}}

    # -- driver thread ------------------------------------------------------------------------
    def start(self) -> None:
        """Give every generator its stream position (a resumed run continues its data) and start it."""
        # a durable (Redis) buffer may still hold groups of the run being resumed: those are not issued
        # again; groups it saw trained after the checkpoint were rolled back with the model and are
        in_buffer = self._buffer_keys(set(self.handles) | set(self.ledger.positions), trained=False)
        self._deal_lanes(in_buffer)
        for gen, handle in self.handles.items():
            self._start_stream(gen, handle, in_buffer)

    def _deal_lanes(self, in_buffer: list[str]) -> None:
        """Record the fleet size the generators' positions are strides of; a resume with another ``--generators``
        deals a file or Python source's open positions and unreached places to the new fleet first
        (``generator/lanes.py``): every record of the epoch once, whatever the fleet sizes (issue 44, defect 7)."""
        cfg = self.cluster.cfg
        layout = self.ledger.layout
        if cfg.prompts.source == "redis":
            self._requeue_gone(in_buffer)
        if layout is None or (layout.lanes != cfg.generators and cfg.prompts.source not in ("file", "python")):
            # a fresh run; or a source without strides (the task's own draws per generator, a Redis stream)
            self.ledger.layout = Layout.default(cfg.generators) if layout is None else replace(
                layout, lanes=cfg.generators)
            return
        if layout.lanes == cfg.generators:
            return
        relaid = self.ledger.relayout(cfg.generators, in_buffer)
        self.events.append({"event": "relaid", "time": time.time(), "lanes_before": layout.lanes,
                            "lanes": cfg.generators, "dealt_again": relaid.moved, "abandoned": relaid.abandoned})
        print(f"resumed on {cfg.generators} generator(s) where the checkpoint's prompt positions are strides of "
              f"{layout.lanes}: {relaid.moved} prompt(s) the old fleet left open or never reached are dealt to the "
              "new fleet first" + (f"; {relaid.abandoned} open prompt(s) of generators beyond the old fleet (their "
                                   "own shuffle) are not issued again" if relaid.abandoned else ""), flush=True)

    def _requeue_gone(self, in_buffer: list[str]) -> None:
        """A resume on fewer generators with a Redis prompt stream: what the generators it no longer runs drew and
        nobody trained goes back to the stream as new entries (``requeue_drawn``), drawn by the new fleet; their
        old keys count as used up. Without it those prompts were never issued again (eaten)."""
        from async_rlhf.driver.prompt_ledger import held_positions
        from async_rlhf.prompts.redis_stream import requeue_drawn

        p = self.cluster.cfg.prompts
        gone = sorted(g for g in self.ledger.positions if g >= self.cluster.cfg.generators)
        held = held_positions(in_buffer)
        total = 0
        for g in gone:
            position = self.ledger.positions[g]
            ahead = self.ledger.ahead.get(g, set())
            given, top = requeue_drawn(p.redis_url, p.stream, client_name(g), self.cluster.cfg.run.id,
                                       self.ledger.outstanding.get(g, set()), position, held.get(g, set()) | ahead)
            # the ledger sees every recorded position as drawn; those given back are used up, the held ones stay
            # outstanding until the buffer's copies are trained
            self.ledger.observe_position(g, top)
            self.ledger.outstanding[g] = self.ledger.outstanding.get(g, set()) - set(given)
            total += len(given)
        if total:
            self.events.append({"event": "requeued", "time": time.time(), "prompts": total, "generators": gone})
            print(f"resumed on {self.cluster.cfg.generators} generator(s): {total} prompt(s) that generator(s) "
                  f"{', '.join(map(str, gone))} drew and nobody trained went back to the Redis stream {p.stream} "
                  "as new entries", flush=True)

    def _buffer_keys(self, gens: Iterable[int], trained: bool = True) -> list[str]:
        """Groups of generators ``gens`` the buffer holds, has delivered or (``trained``) saw trained: never
        issued again (trained ones may not have reached the ledger yet, which learns of them a poll later).
        Only those still open in the ledger are asked for (``PromptLedger.windows``): the reply is bounded by
        what is in flight, not by the run's length (issue 44, defect 11)."""
        ledger = self.buffer_client.stats(ledger=True, ledger_of=self.ledger.windows(gens))["ledger"]
        done = [g for g in ledger["trained"] if g not in self.rolled_back] if trained else []
        return [*ledger["held"], *ledger["delivered"], *done]

    def _start_stream(self, gen: int, handle: Any, in_buffer: list[str] | None = None) -> None:
        import ray

        plan = self.ledger.plan(gen, self._buffer_keys([gen]) if in_buffer is None else in_buffer)
        layout = self.ledger.layout.to_dict() if self.ledger.layout is not None else None
        ray.get(handle.resume_stream.remote(plan.position, plan.reissue, plan.skip, self.version, layout))
        self.runs[gen] = handle.run.remote()
        if plan.reissue:
            self.counters["reissued_prompts"] += len(plan.reissue)
        if plan.reissue or plan.skip:
            self._event("reissue", gen, prompts=len(plan.reissue), skipped=len(plan.skip), position=plan.position)

    def _event(self, kind: str, gen: int, **extra: Any) -> None:
        self.events.append({"event": kind, "generator": gen, "time": time.time(), **extra})
        log.warning("fleet: %s generator %d %s", kind, gen, extra or "")

    def observe(self, stats: dict[int, dict[str, Any]]) -> None:
        for gen, s in stats.items():
            self.last_stats[gen] = s
            self.ledger.observe_position(gen, int(s.get("position", 0)))

    def poll(self) -> None:
        """Apply a pending scale request and handle generators whose run() ended."""
        import ray

        from async_rlhf.run_logs import role_log_note

        with self._lock:
            target, self._target = self._target, None
        if target is not None:
            self._scale_to(target)
        refs = {ref: gen for gen, ref in self.runs.items()}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            gen = refs[ref]
            del self.runs[gen]
            try:
                self.final_stats[gen] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._restart(gen, exc)
                continue
            except ray.exceptions.RayTaskError as exc:  # run() raised: a restart would raise the same
                cause = exc.cause if exc.cause is not None else exc
                note = role_log_note(self.cluster.cfg.run.dir, f"generator-{gen}")
                raise RunFailure(f"generator {gen} ({note}): {type(cause).__name__}: {cause}") from exc
            if gen in self.draining:  # scaled down: every group it started is in the buffer now
                handle = self.draining.pop(gen)
                self.ledger.observe_position(gen, int(self.final_stats[gen].get("position", 0)))
                ray.kill(handle)
                with self._lock:
                    self.handles.pop(gen, None)
                self.counters["removed"] += 1
                self._event("removed", gen)

    def _scale_to(self, target: int) -> None:
        import ray

        live = sorted(g for g in self.handles if g not in self.draining)
        for gen in live[target:][::-1]:
            ray.get(self.handles[gen].stop.remote(drain=True))
            self.draining[gen] = self.handles[gen]
            self._event("draining", gen)
        free = (g for g in range(MAX_GENERATORS) if g not in self.handles)
        for _ in range(target - len(live)):
            gen = next(free)
            t0 = time.time()
            handle = self.cluster.new_generator(gen)
            ray.get(handle.ready.remote())
            self._join(gen, handle)
            with self._lock:
                self.handles[gen] = handle
            self.counters["added"] += 1
            self._event("added", gen, start_s=round(time.time() - t0, 1))

    def member_id(self, gen: int) -> str:
        """The push-group member id of generator ``gen``'s current incarnation."""
        return f"gen{gen}.{self.incarnation[gen]}" if self.incarnation[gen] else f"gen{gen}"

    def _join(self, gen: int, handle: Any) -> None:
        """Late join under a fresh member id: the generator loads the next version before it serves."""
        self.incarnation[gen] += 1
        self._joined_at[gen] = time.monotonic()
        self.cluster.join_late(self.member_id(gen), handle)
        self._start_stream(gen, handle)

    def heal(self, learner_version: int) -> None:
        """Re-join a live generator the push group dropped (a push timed out on it under load): one that
        lags the learner by more than the staleness bound can never serve again, and waits forever."""
        cfg = self.cluster.cfg
        now = time.monotonic()
        for gen, handle in list(self.handles.items()):
            lag = learner_version - int(self.last_stats.get(gen, {}).get("version", learner_version))
            if lag <= cfg.train.max_staleness + 2:
                self._lagging_since.pop(gen, None)
                continue
            # the learner no longer waits for generators, so a lag of a few versions comes and goes: only one
            # that lasts a push timeout is a generator the push group dropped
            since = self._lagging_since.setdefault(gen, now)
            recent = now - self._joined_at.get(gen, 0.0) < 3 * cfg.sync.timeout_s
            if gen in self.draining or gen not in self.runs or recent or now - since < cfg.sync.timeout_s:
                continue
            self._lagging_since.pop(gen, None)
            # its old member id leaves the push group at the next push (no push waits for the receiver it
            # replaces, which the generator's worker cancels: issue 31)
            self.cluster.generator_died(self.member_id(gen))
            self.incarnation[gen] += 1
            self._joined_at[gen] = time.monotonic()
            self.cluster.join_late(self.member_id(gen), handle)
            self.counters["rejoins"] += 1
            self._event("rejoined", gen, lag=lag)

    def _restart(self, gen: int, exc: Exception) -> None:
        import ray

        handle = self.handles[gen]
        self.cluster.generator_died(self.member_id(gen))  # no push waits for the dead process meanwhile
        was_draining = self.draining.pop(gen, None) is not None
        # the admission slots it held died with it: the buffer knows exactly which (its client's name), unlike
        # the last polled in_flight, seconds old. Released now (its re-issued prompts are admitted anew), before
        # a restarted process can admit under the same name, and also when it never comes back
        lost_slots = self.buffer_client.release_holder(client_name(gen))
        self._event("died", gen, error=type(exc).__name__, in_flight=lost_slots,
                    position=self.ledger.positions.get(gen, 0),
                    outstanding=len(self.ledger.outstanding.get(gen, ())))
        if not _wait_restarted(handle, RESTART_TIMEOUT_S):
            with self._lock:
                self.handles.pop(gen, None)
            self.counters["lost"] += 1
            self._event("lost", gen)
            return
        self.counters["restarts"] += 1
        self._event("restarted", gen)
        self._join(gen, handle)
        if was_draining:
            ray.get(handle.stop.remote(drain=True))
            self.draining[gen] = handle

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> list[dict[str, Any]]:
        """Stop every generator and collect its final stats; one that has not ended within ``timeout_s``
        (stuck on a dead buffer, say) is left for the caller to kill."""
        import ray

        for handle in self.handles.values():
            handle.stop.remote()
        runs = list(self.runs.values())
        ended = ray.wait(runs, num_returns=len(runs), timeout=timeout_s)[0] if runs else []
        for gen, ref in list(self.runs.items()):
            if ref not in ended:
                log.error("generator %d did not stop within %.0f s", gen, timeout_s)
                continue
            try:
                self.final_stats[gen] = ray.get(ref)
            except ray.exceptions.RayError as exc:  # one line: the cause and the generator's log
                from async_rlhf.run_logs import role_log_note

                cause = getattr(exc, "cause", None) or exc
                log.error("generator %d ended with %s: %s (%s)", gen, type(cause).__name__,
                          (str(cause).strip().splitlines() or [""])[0],
                          role_log_note(self.cluster.cfg.run.dir, f"generator-{gen}"))
        self.runs.clear()
        for gen, s in self.final_stats.items():
            self.ledger.observe_position(gen, int(s.get("position", 0)))
        return [self.final_stats[g] for g in sorted(self.final_stats) if g in self.handles]


def _wait_restarted(handle: Any, timeout_s: float) -> bool:
    """True once Ray has restarted the actor (a new engine starts); False if it is gone for good."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.ready.remote(), timeout=min(30.0, max(1.0, deadline - time.monotonic())))
            return True
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            time.sleep(1.0)  # restarting: its process and engine are still coming up
        except ray.exceptions.RayActorError:
            return False  # out of restarts (run.generator_max_restarts) or killed on purpose
    return False


def _actor_pid(actor: Any) -> int:
    """Runs inside an actor (``__ray_call__``): the id of its process."""
    import os

    return os.getpid()
