"""CPU placement on one host: which cores and how many threads every actor gets (pure, no torch or ray).

On a machine shared by roles, vLLM's and DeepSpeed's thread pools would otherwise spin on the same cores
(2 torch threads per role on 2 cores halve throughput, measured). The plan gives each role its own
core set and each actor a slice of it:

    cores available (os.sched_getaffinity, or run.cpus)        e.g. [0 1 2 3 4 5 6 7]
    auto:  learner fleet gets round(C * M / (N + M)) cores    ->  learners [6 7]   generators [0 .. 5]
           each fleet's cores are cut into one block per actor (actors share cores when there are fewer)
           the buffer (ZeroMQ I/O) runs on the learner fleet's cores: generation is usually the bound and
           its cores pay for every put and admit the buffer answers, while learners wait for data (measured
           on 2 cores, 1 generator, demo task: 600 steps in 66 s instead of 75 s with the buffer beside the
           generator); the generators' cores on a node without learners
           small host (fewer generator cores than generators, e.g. 2 cores, 2 generators, 1 learner):
           generators are spread over every core and run at niceness +BORROW_NICE, so they use the learners'
           cores while the learners wait for data and yield them while the learners compute (measured on
           2 cores: 300 steps in 47 s instead of 69 s, generation being the bottleneck)
    explicit: generator.cpus=0-5  learner.cpus=6,7  buffer.cpus=all   (core ids of this host)

Threads per actor come from ``generator.threads`` / ``learner.threads``; the plan flags an actor whose
threads exceed its cores, or cores that two roles share (``oversubscribed``), but it never refuses them:
a colocated synchronous trainer shares every core on purpose (``cpus=all``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from async_rlhf.cpu_spec import ALL, AUTO, CpuSpecError, parse_cores

BORROW_NICE = 10
"""Niceness of generators that borrow the learners' cores: CFS then gives a busy learner about 90% of a
core it shares with one of them."""


@dataclass(frozen=True)
class Placement:
    """Where one actor runs: its cores and the size of its thread pools."""

    actor: str
    cores: tuple[int, ...]
    threads: int
    nice: int = 0
    """Added to the process's niceness: a role that borrows another's cores yields them when that one works."""


@dataclass
class CpuPlan:
    available: tuple[int, ...]
    placements: dict[str, Placement] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def oversubscribed(self) -> bool:
        return bool(self.warnings)

    def cores_of(self, role: str) -> tuple[int, ...]:
        """Union of the cores of every actor whose name starts with ``role`` (e.g. ``generator``)."""
        return tuple(sorted({c for p in self.placements.values() if p.actor.startswith(role) for c in p.cores}))

    def to_dict(self) -> dict[str, Any]:
        return {"available": list(self.available), "oversubscribed": self.oversubscribed,
                "warnings": list(self.warnings),
                "placements": {k: {**asdict(p), "cores": list(p.cores)} for k, p in self.placements.items()}}


def unpinned(plan: CpuPlan, reason: str) -> CpuPlan:
    """The same actors on every core of ``plan`` at default priority (threads kept): for a host whose cores another
    run has pinned its roles to (core_claims.py), where a second split would put both runs' generators on the same
    cores."""
    out = CpuPlan(plan.available, warnings=[reason])
    for name, p in plan.placements.items():
        out.placements[name] = Placement(p.actor, plan.available, p.threads, 0)
    return out


def split_blocks(cores: tuple[int, ...], actors: int) -> list[tuple[int, ...]]:
    """One contiguous block per actor (sizes differ by at most one); with fewer cores, actors share."""
    if actors <= 0:
        return []
    if len(cores) < actors:
        return [(cores[i % len(cores)],) for i in range(actors)]
    size, extra = divmod(len(cores), actors)
    out, start = [], 0
    for i in range(actors):
        n = size + (1 if i < extra else 0)
        out.append(cores[start:start + n])
        start += n
    return out


def _auto_split(available: tuple[int, ...], generators: int, learners: int) -> tuple[tuple[int, ...],
                                                                                      tuple[int, ...]]:
    """Generator fleet first, learner fleet on the last cores; a single core is shared; a fleet with no actor
    here (a node of a multi-node run may hold only one role) leaves every core to the other."""
    c = len(available)
    if c == 1 or not generators or not learners:
        return (available if generators else ()), (available if learners else ())
    n_learn = min(c - 1, max(1, round(c * learners / (generators + learners))))
    return available[: c - n_learn], available[c - n_learn:]


def plan_cpus(available: tuple[int, ...], generators: int, learners: int, *, generator_cpus: str = AUTO,
              learner_cpus: str = AUTO, buffer_cpus: str = AUTO, generator_threads: int = 1,
              learner_threads: int = 1, generator_nice: int = 0) -> CpuPlan:
    """The core set and thread count of every generator, learner rank and the buffer (see module doc)."""
    available = tuple(sorted(set(available)))
    if not available:
        raise CpuSpecError("no CPU cores are available to this process (os.sched_getaffinity is empty)")
    auto_gen, auto_learn = _auto_split(available, generators, learners)
    gen_auto, learn_auto = generator_cpus.strip() == AUTO, learner_cpus.strip() == AUTO
    gen = auto_gen if gen_auto else parse_cores(generator_cpus, available, "generator.cpus")
    learn = auto_learn if learn_auto else parse_cores(learner_cpus, available, "learner.cpus")
    if gen_auto and not learn_auto:  # the other fleet takes what is left (everything if nothing is)
        gen = tuple(c for c in available if c not in learn) or available
    if learn_auto and not gen_auto:
        learn = tuple(c for c in available if c not in gen) or available
    borrow = gen_auto and learn_auto and 1 < len(available) and len(gen) < generators
    if borrow:  # small host: generators on every core, below the learners' priority
        gen, generator_nice = available, generator_nice or BORROW_NICE
    buf = (learn or gen or available) if buffer_cpus.strip() == AUTO else parse_cores(buffer_cpus, available,
                                                                                     "buffer.cpus")
    plan = CpuPlan(available)
    for i, cores in enumerate(split_blocks(gen, generators)):
        plan.placements[f"generator {i}"] = Placement(f"generator {i}", cores, generator_threads, generator_nice)
    for r, cores in enumerate(split_blocks(learn, learners)):
        plan.placements[f"learner {r}"] = Placement(f"learner {r}", cores, learner_threads)
    plan.placements["buffer"] = Placement("buffer", buf, 1)
    plan.warnings = _oversubscription(plan)
    if borrow:
        advice = ("; on 2 cores one generator with twice the groups in flight trains faster (--generators 1 "
                  "generator.groups_in_flight=16: 9.4 learner steps/s against 7.8-8.2 with 2, measured)"
                  if len(available) == 2 else "")
        plan.warnings.append(f"generators borrow the learners' cores at niceness +{generator_nice}: they yield "
                             f"them while a learner computes (set generator.cpus to keep them apart){advice}")
    return plan


def _oversubscription(plan: CpuPlan) -> list[str]:
    out = []
    load: dict[int, int] = {}
    for p in plan.placements.values():
        if p.actor == "buffer":
            continue  # one mostly idle I/O thread
        if p.threads > len(p.cores):
            role = p.actor.split()[0]
            out.append(f"{p.actor}: {p.threads} threads on {len(p.cores)} core(s): torch's threads then wait on "
                       f"each other (2 learner threads on 1 core made each step 9x slower, measured); set "
                       f"{role}.threads to at most {len(p.cores)} or give it more cores ({role}.cpus)")
        for c in p.cores:
            load[c] = load.get(c, 0) + p.threads / len(p.cores)
    busy = sorted(c for c, n in load.items() if n > 1.0 + 1e-9)
    if busy:
        out.append(f"core(s) {busy} carry more threads than they have (roles or actors share them)")
    return out


def available_cores(spec: str = "") -> tuple[int, ...]:
    """The cores this process may use (``run.cpus`` narrows them)."""
    return available_cores_of(tuple(os.sched_getaffinity(0)), spec)


def plan_for_config(cfg: Any) -> CpuPlan:
    """The plan of a :class:`async_rlhf.config.Config` on this host."""
    return plan_cpus(available_cores(cfg.run.cpus), cfg.generators, cfg.learners,
                     generator_cpus=cfg.generator.cpus, learner_cpus=cfg.learner.cpus, buffer_cpus=cfg.buffer.cpus,
                     generator_threads=cfg.generator.threads, learner_threads=cfg.learner.threads,
                     generator_nice=cfg.generator.nice)


def pin_this_process(cores: tuple[int, ...], threads: int | None = None, nice: int = 0) -> list[int]:
    """Pin every thread of this process to ``cores`` and lower its priority by ``nice`` (threads started later
    inherit both); optionally resize torch's intra-op pool. Returns the affinity now in effect."""
    target = set(cores)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), target)
            if nice:  # Linux keeps niceness per thread
                os.setpriority(os.PRIO_PROCESS, int(tid), os.getpriority(os.PRIO_PROCESS, int(tid)) + nice)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import sys

        torch = sys.modules.get("torch")  # only if already loaded: never import torch here
        if torch is not None:
            torch.set_num_threads(threads)
    return sorted(os.sched_getaffinity(0))


def pin_actor(_actor: object, cores: list[int], threads: int | None = None, nice: int = 0) -> list[int]:
    """For ``actor.__ray_call__.remote(pin_actor, cores)``: pins the actor's process from inside it."""
    return pin_this_process(tuple(cores), threads, nice)


def plan_nodes(cfg: Any, nodes: dict[str, dict[str, Any]]) -> CpuPlan:
    """A plan for roles on one node or several: each node's actors are placed on that node's own cores
    (``nodes[ip] = {"cores": [...], "generators": [ids], "learners": [ranks], "buffer": bool}``), never on the
    driver's core list (a node with other core ids would refuse it with EINVAL). The node-local plans are
    merged under the run's actor names; ``run.cpus`` and explicit core lists apply on every node."""
    merged = CpuPlan(available=())
    for ip, roles in sorted(nodes.items()):
        gens, ranks = list(roles.get("generators", [])), list(roles.get("learners", []))
        cores = available_cores_of(tuple(roles["cores"]), cfg.run.cpus)
        try:
            local = plan_cpus(cores, len(gens), len(ranks), generator_cpus=cfg.generator.cpus,
                              learner_cpus=cfg.learner.cpus, buffer_cpus=cfg.buffer.cpus,
                              generator_threads=cfg.generator.threads, learner_threads=cfg.learner.threads,
                              generator_nice=cfg.generator.nice)
        except CpuSpecError as exc:
            raise CpuSpecError(f"node {ip}: {exc}") from None
        names = {f"generator {j}": f"generator {g}" for j, g in enumerate(gens)}
        names.update({f"learner {j}": f"learner {r}" for j, r in enumerate(ranks)})
        if roles.get("buffer"):
            names["buffer"] = "buffer"
        for local_name, name in names.items():
            p = local.placements[local_name]
            merged.placements[name] = Placement(name, p.cores, p.threads, p.nice)
        merged.warnings += [f"node {ip}: {w}" for w in local.warnings]
        merged.available = tuple(sorted(set(merged.available) | set(cores)))
    return merged


def available_cores_of(node_cores: tuple[int, ...], spec: str = "") -> tuple[int, ...]:
    """``available_cores`` for another node's core list."""
    own = tuple(sorted(node_cores))
    return own if not spec.strip() or spec.strip() in (AUTO, ALL) else parse_cores(spec, own, "run.cpus")
