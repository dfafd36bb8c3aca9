"""The placement plan: which resources every role asks Ray for, as a pure function of config and sizes.

    placement group "generators"  strategy pack|spread   N bundles of {CPU: generator_cpus, GPU: generator_gpus}
    placement group "learners"    strategy pack|spread   M bundles of {CPU: learner_cpus,   GPU: learner_gpus}
    placement group "buffer"      strategy pack          1 bundle  of {CPU: buffer_cpus}

One placement group per role: ``pack`` keeps a role on as few nodes as possible (DeepSpeed ranks talk to
each other), ``spread`` puts one bundle per node where it can (a lost node then takes fewer generators
with it). The totals per resource are what the cluster must offer before anything starts;
``--dry-run`` prints this plan and starts nothing (no Ray needed). No ray import here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rlhf.config import Config, ConfigError, parse_custom_resources


@dataclass(frozen=True)
class RolePlan:
    role: str
    count: int
    bundle: dict[str, float]
    """Resources of one bundle (one actor), e.g. {"CPU": 1.0, "GPU": 0.0}."""
    strategy: str
    note: str = ""

    def totals(self) -> dict[str, float]:
        return {k: v * self.count for k, v in self.bundle.items()}

    def custom(self) -> dict[str, float]:
        """The custom Ray resources of one bundle (``resources.*_custom``)."""
        return {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}

    def ray_bundles(self) -> list[dict[str, float]]:
        """Bundles as Ray wants them: zero amounts left out, an empty bundle (Ray refuses those) asks for 1 MiB of
        memory, never a sliver of CPU: 8 + 8 roles of 1 CPU and a buffer of 0 must fit 16 CPUs."""
        one = {k: float(v) for k, v in self.bundle.items() if v > 0} or {"memory": float(1 << 20)}
        return [dict(one) for _ in range(self.count)]


@dataclass(frozen=True)
class PlacementPlan:
    roles: list[RolePlan] = field(default_factory=list)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {"CPU": 0.0, "GPU": 0.0}
        for role in self.roles:
            for k, v in role.totals().items():
                out[k] = out.get(k, 0.0) + v
        return out

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    def shortfall(self, available: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Resources the plan needs beyond ``available``: name -> (needed, available)."""
        return {k: (v, float(available.get(k, 0.0))) for k, v in self.totals().items()
                if v > float(available.get(k, 0.0)) + 1e-9}

    def to_dict(self) -> dict[str, object]:
        return {"roles": [{"role": r.role, "count": r.count, "bundle": r.bundle, "strategy": r.strategy,
                           "totals": r.totals(), "note": r.note} for r in self.roles],
                "totals": self.totals()}


def plan_placement(cfg: Config, generators: int | None = None, learners: int | None = None) -> PlacementPlan:
    """The plan for ``generators`` x ``learners`` (default: the config's sizes)."""
    res = cfg.resources
    n = cfg.generators if generators is None else generators
    m = cfg.learners if learners is None else learners
    if n < 1 or m < 1:
        raise ConfigError(f"a plan needs at least 1 generator and 1 learner, got {n} and {m}")
    tp_note = f"vLLM tensor_parallel={res.tensor_parallel}" if res.tensor_parallel > 1 else "vLLM engine"
    def custom(key: str) -> dict[str, float]:
        return parse_custom_resources(getattr(res, key), f"resources.{key}")

    return PlacementPlan([
        RolePlan("generators", n, {"CPU": float(res.generator_cpus), "GPU": float(res.generator_gpus),
                                   **custom("generator_custom")},
                 res.placement, f"{tp_note}, {'GPU' if res.generator_gpus else 'CPU'} backend"),
        RolePlan("learners", m, {"CPU": float(res.learner_cpus), "GPU": float(res.learner_gpus),
                                 **custom("learner_custom")},
                 res.placement, f"DeepSpeed ZeRO-{cfg.learner.zero_stage}, {cfg.learner.backend}"),
        RolePlan("buffer", 1, {"CPU": float(res.buffer_cpus), "GPU": 0.0, **custom("buffer_custom")}, "pack",
                 f"{cfg.buffer.store} store"),
    ])


def _fmt(x: float) -> str:
    return f"{x:g}"


def local_ray_cpus(cfg: Config, plan: PlacementPlan, cores: int) -> int:
    """The logical CPUs of the Ray a run starts on this machine (async_rlhf/driver/provision.py): ``run.num_cpus``
    when set, else room for the plan plus 4 generators added by ``scale``, and never fewer than the ``cores``.
    Logical CPUs are Ray's bookkeeping: on one host the roles share the cores whatever their count."""
    if cfg.run.num_cpus:
        return int(cfg.run.num_cpus)
    return max(cores, int(plan.totals()["CPU"] + 0.999) + 4 * int(cfg.resources.generator_cpus + 0.999))


def format_plan(plan: PlacementPlan, available: dict[str, float] | None = None, where: str = "this machine",
                cores: int | None = None, ray_cpus: int | None = None) -> str:
    """The plan as a table; with ``available`` (what Ray offers: a cluster joined, or a local Ray of
    ``run.num_cpus``), a line saying whether it can hold the plan; with ``cores`` (one host), a line saying how
    many roles share how many cores (never a refusal: the launcher starts Ray with the logical CPUs the plan
    needs, ``local_ray_cpus``: ``ray_cpus``)."""
    lines = [f"{'role':<11} {'count':>5} {'CPU/each':>8} {'GPU/each':>8} {'CPU':>7} {'GPU':>5}  strategy  note"]
    for r in plan.roles:
        t = r.totals()
        lines.append(f"{r.role:<11} {r.count:>5} {_fmt(r.bundle['CPU']):>8} {_fmt(r.bundle['GPU']):>8} "
                     f"{_fmt(t['CPU']):>7} {_fmt(t['GPU']):>5}  {r.strategy:<8}  {r.note}")
    tot = plan.totals()
    lines.append(f"{'total':<11} {sum(r.count for r in plan.roles):>5} {'':>8} {'':>8} "
                 f"{_fmt(tot['CPU']):>7} {_fmt(tot['GPU']):>5}")
    if available is not None:
        short = plan.shortfall(available)
        have = ", ".join(f"{_fmt(available.get(k, 0.0))} {k}" for k in ("CPU", "GPU"))
        lines.append(f"fits {where} ({have}): " + ("yes" if not short else "no, short of " + ", ".join(
            f"{k} ({_fmt(need)} needed)" for k, (need, _) in short.items())))
    if cores is not None:
        lines.append(cores_line(plan, cores, ray_cpus))
    return "\n".join(lines)


def cores_line(plan: PlacementPlan, cores: int, ray_cpus: int | None = None) -> str:
    """How many generators and learner ranks share this host's ``cores`` (the buffer, mostly waiting on I/O, left
    out): more roles than cores run, each step slower; with ``ray_cpus``, the logical CPUs Ray is started with."""
    roles = sum(r.count for r in plan.roles if r.role != "buffer")
    line = (f"{roles} roles on {cores} cores: one core or more each" if roles <= cores else
            f"{roles} roles on {cores} cores: each step will be slower, see docs/hardware.md")
    if ray_cpus is not None:
        line += (f" (Ray is started with {ray_cpus} logical CPUs, one per role's CPU and room for `scale`: a count "
                 "Ray keeps, not cores)")
    return line


def check_fits(plan: PlacementPlan, available: dict[str, float], where: str) -> None:
    """Refuse a plan larger than the cluster, naming the resource and the fix."""
    short = plan.shortfall(available)
    if short:
        what = "; ".join(f"{k}: the plan needs {_fmt(need)}, {where} has {_fmt(have)}"
                         for k, (need, have) in short.items())
        raise ConfigError(f"more resources than the cluster has ({what}); lower --generators/--learners or "
                          "resources.* per role, or add nodes")


def _amounts(res: dict[str, float]) -> str:
    """``CPU 4, GPU 0, memory 12.3 GB`` (Ray's own bookkeeping resources left out)."""
    out = []
    for k in sorted(res):
        if k.startswith("node:") or k in ("object_store_memory",) or k.startswith("accelerator_type"):
            continue
        out.append(f"{k} {res[k] / 1e9:.1f} GB" if k == "memory" else f"{k} {_fmt(res[k])}")
    return ", ".join(out)


def unplaced_message(role: RolePlan, waited_s: float, available: dict[str, float], total: dict[str, float],
                     nodes: dict[str, dict[str, float]]) -> str:
    """Why a role's placement group is not placed: what it asks and what the cluster offers (free now, after the
    groups placed before it, and in all; per node)."""
    bundle = "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in role.bundle.items() if v > 0) + "}"
    free = ", ".join(f"{k} {_fmt(available.get(k, 0.0))} free of {_fmt(total.get(k, 0.0))}"
                     for k, v in role.bundle.items() if v > 0)
    per_node = "; ".join(f"node {n}: {_amounts(r)}" for n, r in sorted(nodes.items()))
    return (f"the {role.role} placement group was not placed within {waited_s:.0f} s: it asks {role.count} bundle(s) "
            f"of {bundle} ({role.strategy}) and the cluster offers {free} ({per_node}); lower --{role.role} or "
            f"resources.{role.role.rstrip('s')}_* per bundle, or add nodes")


def assign_to_nodes(plan: PlacementPlan, nodes: dict[str, dict[str, float]]) -> dict[str, list[str]]:
    """Where each bundle would go on these nodes (name -> free resources), as Ray's strategies would put it when
    the cluster is otherwise idle: ``pack`` fills the node with the most room first, ``spread`` takes the node
    with the fewest of this role's bundles so far. For ``--dry-run --address``: an estimate, not a reservation;
    a bundle that fits nowhere is ``"(no room)"``."""
    free = {name: dict(res) for name, res in nodes.items()}
    out: dict[str, list[str]] = {}
    for role in plan.roles:
        need = {k: v for k, v in role.bundle.items() if v > 0}
        placed: list[str] = []
        for _ in range(role.count):
            fits = [n for n, res in free.items() if all(res.get(k, 0.0) + 1e-9 >= v for k, v in need.items())]
            if not fits:
                placed.append("(no room)")
                continue
            if role.strategy == "spread":
                node = min(fits, key=lambda n: (placed.count(n), -free[n].get("CPU", 0.0)))
            else:
                node = next((n for n in placed if n in fits), None) or max(fits, key=lambda n: free[n].get("CPU", 0.0))
            for k, v in need.items():
                free[node][k] = free[node].get(k, 0.0) - v
            placed.append(node)
        out[role.role] = placed
    return out


def format_nodes(assignment: dict[str, list[str]]) -> str:
    """``node -> role indices`` lines for ``--dry-run --address``."""
    per_node: dict[str, list[str]] = {}
    for role, placed in assignment.items():
        for i, node in enumerate(placed):
            per_node.setdefault(node, []).append(f"{role.rstrip('s')} {i}")
    return "\n".join(f"node {node}: {', '.join(items)}" for node, items in sorted(per_node.items()))
