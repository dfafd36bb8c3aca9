"""The driver's side of a start-up: the board actor, waits that apply each phase's deadline, the progress line.

    watch = StartupWatch(cfg, t0)          the board (named in every role's environment: BOARD_ENV)
    watch.add("generator 0", ...)          as each actor is created
    watch.wait({"generator 0": ref, ...})  until those calls return; meanwhile, every second: the board's
                                           reports -> StartupClock.check (slow: a line; stop: the error),
                                           and the progress line when it changes (at least every 15 s)
    watch.finish()                         start-up over: heartbeats end; ``figures()`` for summary.json
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from async_rlhf.startup.board import BOARD_ENV, StartupBoard
from async_rlhf.startup.phases import READY, STARTED, Limits, StartupClock

log = logging.getLogger(__name__)


class StartupWatch:
    def __init__(self, cfg: Any, t0: float, error: type[Exception] = RuntimeError) -> None:
        import ray

        run = cfg.run
        self.name = f"startup-{uuid.uuid4().hex[:8]}"
        self.board = ray.remote(StartupBoard).options(name=self.name, num_cpus=0).remote()
        self.clock = StartupClock(Limits(phase_s=run.startup_phase_s, rendezvous_s=run.rendezvous_timeout_s,
                                         silent_s=run.startup_silent_s))
        self.t0 = t0
        self.error = error
        self.env = {BOARD_ENV: self.name}
        self.helpers: Callable[[], float] | None = None
        """The CPU seconds used so far by what the ranks' processes wait for on this host (the fork servers of a
        Ray this driver started; set once they are started); sampled at every poll (``StartupClock.helper_cpu``)."""
        self.driver_phases: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._line = ""
        self._printed = 0.0

    def driver_phase(self, phase: str, seconds: float) -> None:
        """A phase the driver itself went through (``ray start``, ``placement``...), for the figures."""
        self.driver_phases[phase] = round(self.driver_phases.get(phase, 0.0) + seconds, 3)

    def add(self, name: str, role: str, node: str) -> None:
        """Rank ``name``'s actor was just created (again after a restart: its reports start over)."""
        self.board.forget.remote(name)
        self._seen[name] = 0
        self.clock.add(name, role, node, time.time())

    def set_rendezvous(self, host: str, port: int) -> None:
        self.clock.rendezvous = f"{host}:{port}"

    def enter(self, phase: str) -> None:
        """Every rank enters a phase the driver runs (``first push``)."""
        self.clock.enter(list(self.clock.ranks), phase, time.time())

    def wait(self, refs: dict[str, Any], then: str = STARTED) -> dict[str, Any]:
        """The results of ``refs`` (rank name -> object ref), each rank entering ``then`` as its call returns;
        raises what a call raised, or ``error`` when a rank is stopped by its phase's deadline."""
        import ray

        pending = {ref: name for name, ref in refs.items()}
        out: dict[str, Any] = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0)
            for ref in done:
                name = pending.pop(ref)
                out[name] = ray.get(ref)  # a rank that failed (a port taken, an exception) raises at once
                self.clock.report(name, then, "", time.time())
            self.poll()
        return out

    def poll(self) -> None:
        """Read the board, apply the deadlines, print what is slow and the progress line."""
        import ray

        try:
            snap = ray.get(self.board.snapshot.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            snap = None  # the board is starting (or busy): judge on what is known
        now = time.time()
        if self.helpers is not None:
            self.clock.helper_cpu(now, self.helpers())
        if snap is not None:
            shift = now - snap["now"]  # the board's clock onto ours
            for name, phases in snap["phases"].items():
                if name not in self.clock.ranks:
                    continue
                for phase, detail, at in phases[self._seen.get(name, 0):]:
                    self.clock.report(name, phase, detail, at + shift)
                self._seen[name] = len(phases)
            for name, (at, cpu_s) in snap["beats"].items():
                if name in self.clock.ranks:
                    self.clock.beat(name, at + shift, cpu_s)
        for event in self.clock.check(now):
            if event.kind == "stop":
                print(f"start-up: {self.clock.progress_line(now, self.t0)}", flush=True)
                raise self.error(f"start-up stopped in phase '{event.phase}': {event.message}")
            print(f"start-up: {event.message}", flush=True)
        line = self.clock.progress_line(now, self.t0)
        body = line.split(":", 1)[1]
        if (body != self._line and now - self._printed >= 2.0) or now - self._printed >= 15.0:
            print(line, flush=True)
            self._line, self._printed = body, now

    def finish(self) -> None:
        """Start-up is over: every rank is ready, their heartbeats end."""
        self.clock.enter(list(self.clock.ranks), READY, time.time())
        self.board.finish.remote()

    def figures(self) -> dict[str, dict[str, float]]:
        """``startup_s_by_phase``: per role (driver, generators, learners), seconds per phase (the slowest
        rank's)."""
        return {"driver": dict(self.driver_phases), **self.clock.durations(time.time())}

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.board)
        except Exception:  # noqa: BLE001 - already gone with its Ray
            pass
