"""Deadlines of a start-up, phase by phase (pure: times are passed in).

Every rank goes through phases; each phase has a budget (``run.startup_phase_s``) counted from the moment
the rank entered it::

    generator   process start -> imports (vllm) -> engine build (model load inside) -> started
    learner     process start -> imports (deepspeed) -> op build | op load -> rendezvous -> model load
                -> engine build -> started
    all         first push (the push group forms; the driver enters it for every rank) -> ready

Past its budget a rank is

- **slow** while it, or any other rank still starting, makes progress (its heartbeat uses CPU: a compiler,
  imports, a model load; a rank waiting in a collective for a slow peer uses none, the peer does): the line
  says what it is doing and the deadline moves on by another budget;
- **stopped** when nothing starting makes progress any more, naming the phase.

A rank whose heartbeat stops for ``run.startup_silent_s`` stops the run at once (its process died or hangs).
The **rendezvous** is the one phase that is never extended: ``run.rendezvous_timeout_s`` counts from the
moment the last learner rank reached it (a rank waiting there for a peer still compiling is not at fault),
and past it the message is about the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROCESS = "process start"
"""From the actor's creation to its first report: Ray starting the process (with ``run.fork_workers``, a fork of
its node's server, which may still be importing), the actor module's imports."""
IMPORTS = "imports"
OP_BUILD = "op build"
OP_LOAD = "op load"
RENDEZVOUS = "rendezvous"
MODEL = "model load"
ENGINE = "engine build"
STARTED = "started"
"""The rank finished its own start-up and waits for the others."""
FIRST_PUSH = "first push"
READY = "ready"

_LABELS = {PROCESS: "starting", IMPORTS: "importing {detail}", OP_BUILD: "building op {detail}",
           OP_LOAD: "loading op {detail}", RENDEZVOUS: "in the rendezvous", MODEL: "loading model",
           ENGINE: "building engine", STARTED: "ready", FIRST_PUSH: "forming the push group", READY: "ready"}
DONE = (STARTED, READY)


def label(phase: str, detail: str = "") -> str:
    """What a rank in ``phase`` is doing, for a person: ``building op shm_comm``."""
    return _LABELS.get(phase, phase).format(detail=detail).strip()


@dataclass(frozen=True)
class Limits:
    phase_s: float = 120.0
    """Budget of a phase before its rank is reported slow (and, unless something makes progress, stopped)."""
    rendezvous_s: float = 120.0
    """Time in the rendezvous once every learner rank reached it."""
    silent_s: float = 90.0
    """A rank with no heartbeat for this long stops the run; also the window progress is judged over."""
    min_cpu_share: float = 0.05
    """Share of a core a rank's process tree must use over the window to count as making progress."""


@dataclass
class Rank:
    name: str
    """``learner rank 0``, ``generator 3``."""
    role: str
    """``learners`` or ``generators``."""
    node: str
    created: float
    deadline: float
    phases: list[tuple[str, str, float]] = field(default_factory=list)
    """(phase, detail, since), the first one ``process start`` at creation."""
    beat: float | None = None
    cpu: list[tuple[float, float]] = field(default_factory=list)
    """(time, CPU seconds of the rank's process tree) from its heartbeats."""
    extensions: int = 0

    @property
    def phase(self) -> str:
        return self.phases[-1][0]

    @property
    def since(self) -> float:
        return self.phases[-1][2]

    def doing(self) -> str:
        return label(self.phase, self.phases[-1][1])

    def reached(self, phase: str) -> float | None:
        return next((t for p, _, t in self.phases if p == phase), None)


@dataclass(frozen=True)
class Event:
    kind: str
    """``slow`` (the run goes on) or ``stop``."""
    rank: str
    phase: str
    message: str


class StartupClock:
    """The start-up of every rank of a run as the driver sees it, and the verdicts on it."""

    def __init__(self, limits: Limits, rendezvous: str = "") -> None:
        self.limits = limits
        self.rendezvous = rendezvous
        """``host:port`` of DeepSpeed's rendezvous, for the message about it."""
        self.ranks: dict[str, Rank] = {}
        self.helpers: list[tuple[float, float]] = []
        """(time, CPU seconds) of the processes that ranks still in process start wait for on the driver's host:
        the fork servers importing (``helper_cpu``). A rank that has not reported yet makes progress while they
        use CPU."""

    def add(self, name: str, role: str, node: str, now: float) -> None:
        """A rank's actor was created now (again, after a restart: its history starts over)."""
        self.ranks[name] = Rank(name, role, node, now, now + self.limits.phase_s, [(PROCESS, "", now)])

    def report(self, name: str, phase: str, detail: str, at: float) -> None:
        """Rank ``name`` entered ``phase`` at ``at``. Reports may arrive late (the board is read every second,
        the driver sees a call return at once): each goes in its place in time, a repeat of a neighbour is merged."""
        r = self.ranks[name]
        i = len(r.phases)
        while i > 1 and r.phases[i - 1][2] > at:
            i -= 1
        if r.phases[i - 1][:2] == (phase, detail):
            return
        if i < len(r.phases) and r.phases[i][:2] == (phase, detail):
            r.phases[i] = (phase, detail, at)
            return
        r.phases.insert(i, (phase, detail, at))
        if i == len(r.phases) - 1:
            r.deadline = at + self.limits.phase_s
            r.extensions = 0

    def beat(self, name: str, at: float, cpu_s: float) -> None:
        r = self.ranks[name]
        if r.beat is not None and at <= r.beat:
            return
        r.beat = at
        self._record(r.cpu, at, cpu_s)

    def helper_cpu(self, at: float, cpu_s: float) -> None:
        """The CPU seconds the helpers (see ``helpers``) have used by ``at``."""
        self._record(self.helpers, at, cpu_s)

    def _record(self, series: list[tuple[float, float]], at: float, cpu_s: float) -> None:
        """Append a (time, CPU seconds) sample, keeping what the last two ``silent_s`` windows need."""
        series.append((at, cpu_s))
        keep = at - 2 * self.limits.silent_s
        while len(series) > 2 and series[1][0] < keep:
            series.pop(0)

    def enter(self, names: list[str], phase: str, now: float) -> None:
        """A phase the driver runs for these ranks (``first push``, then ``ready``)."""
        for name in names:
            self.report(name, phase, "", now)

    def progressing(self, r: Rank, now: float) -> bool:
        """Whether ``r`` shows progress over the last ``silent_s``: a new phase, or CPU used by its process
        tree (too few heartbeats to judge yet counts as progress)."""
        w = self.limits.silent_s
        if r.beat is None and r.phase == PROCESS and self.helpers:
            return self._uses_cpu(self.helpers, now)  # its node's fork server imports what it will start with
        if r.beat is None or now - r.beat > w:
            return False
        if now - r.since < w:
            return True
        return self._uses_cpu(r.cpu, now)

    def _uses_cpu(self, series: list[tuple[float, float]], now: float) -> bool:
        """Whether (time, CPU seconds) samples show CPU use over the last ``silent_s`` (too few to judge: yes)."""
        w = self.limits.silent_s
        window = [(t, c) for t, c in series if t >= now - w]
        if len(window) < 2 or window[0][0] > now - w / 2:
            return True
        (t0, c0), (t1, c1) = window[0], window[-1]
        return (c1 - c0) >= self.limits.min_cpu_share * (t1 - t0)

    def rendezvous_clock(self, r: Rank) -> float | None:
        """When ``r``'s rendezvous deadline started: once every rank of its role reached the rendezvous (None
        while one has not)."""
        arrivals = [p.reached(RENDEZVOUS) for p in self.ranks.values() if p.role == r.role]
        if any(a is None for a in arrivals):
            return None
        return max(a for a in arrivals if a is not None)

    def check(self, now: float) -> list[Event]:
        """Verdicts at ``now``: ``slow`` events (deadlines moved on) and at most one ``stop`` (the first)."""
        lim = self.limits
        starting = [r for r in self.ranks.values() if r.phase not in DONE]
        anyone = any(self.progressing(r, now) for r in starting)
        events: list[Event] = []
        for r in starting:
            where = f"{r.name} on node {r.node}"
            if r.beat is not None and now - r.beat > lim.silent_s:
                return events + [Event("stop", r.name, r.phase, (
                    f"{where} went silent while {r.doing()}: no heartbeat for {now - r.beat:.0f} s "
                    f"(run.startup_silent_s={lim.silent_s:g}); its process died or hangs (ray status; the logs "
                    "under /tmp/ray/session_latest/logs)"))]
            if r.phase == RENDEZVOUS:
                t0 = self.rendezvous_clock(r)
                if t0 is not None and now - t0 > lim.rendezvous_s:
                    at = f" at {self.rendezvous}" if self.rendezvous else ""
                    host = self.rendezvous.rpartition(":")[0] or "rank 0's node"
                    port = self.rendezvous.rpartition(":")[2] or "its port"
                    return events + [Event("stop", r.name, r.phase, (
                        f"{where} did not get through the DeepSpeed rendezvous{at} within {lim.rendezvous_s:g} s "
                        f"of every learner rank reaching it (run.rendezvous_timeout_s): check that node {r.node} "
                        f"reaches {host} on TCP port {port} and on gloo's ports (firewall, routes)"))]
                continue  # waiting for a peer, which has deadlines of its own
            if now <= r.deadline:
                continue
            spent = now - r.since
            if anyone:
                r.deadline = now + lim.phase_s
                r.extensions += 1
                if r.beat is None and r.phase == PROCESS and self.helpers and self.progressing(r, now):
                    what = "the fork server it starts from is still importing"
                else:
                    what = ("still working" if self.progressing(r, now) and r.beat is not None
                            else "waiting while other ranks still make progress")
                events.append(Event("slow", r.name, r.phase, (
                    f"{where} is slow: {r.doing()} for {spent:.0f} s (run.startup_phase_s={lim.phase_s:g}); "
                    f"{what}, deadline extended by {lim.phase_s:g} s")))
                continue
            if r.phase == PROCESS:
                msg = (f"{where} did not start: its process has not reported {spent:.0f} s after the actor was "
                       f"created (run.startup_phase_s={lim.phase_s:g}); check ray status and the raylet's logs "
                       "under /tmp/ray/session_latest/logs")
            else:
                msg = (f"{where} made no progress {r.doing()}: {spent:.0f} s in that phase "
                       f"(run.startup_phase_s={lim.phase_s:g}) and no starting rank used CPU in the last "
                       f"{lim.silent_s:g} s")
            return events + [Event("stop", r.name, r.phase, msg)]
        return events

    def progress_line(self, now: float, t0: float) -> str:
        """``start-up 41 s: generators 5/8 ready, 3/8 building engine; learners 3/8 loading model, ...``."""
        parts = []
        for role in ("generators", "learners"):
            ranks = [r for r in self.ranks.values() if r.role == role]
            if not ranks:
                continue
            counts: dict[str, int] = {}
            for r in sorted(ranks, key=lambda r: r.since):
                if r.phase not in DONE:
                    counts[r.doing()] = counts.get(r.doing(), 0) + 1
            done = sum(r.phase in DONE for r in ranks)
            n = len(ranks)
            parts.append(", ".join([f"{role} {done}/{n} ready"] + [f"{k}/{n} {what}" for what, k in counts.items()]))
        return f"start-up {now - t0:.0f} s: " + "; ".join(parts)

    def durations(self, now: float) -> dict[str, dict[str, float]]:
        """Seconds per phase and role: the slowest rank's (phases it went through, the open one up to ``now``;
        ``started``/``ready`` are waiting, not counted)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.ranks.values():
            per: dict[str, float] = {}
            for i, (phase, _, since) in enumerate(r.phases):
                if phase in DONE:
                    continue
                end = r.phases[i + 1][2] if i + 1 < len(r.phases) else now
                per[phase] = per.get(phase, 0.0) + max(end - since, 0.0)
            role = out.setdefault(r.role, {})
            for phase, s in per.items():
                role[phase] = round(max(role.get(phase, 0.0), s), 3)
        return out
