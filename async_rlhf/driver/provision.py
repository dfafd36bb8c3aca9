"""The provision stage of a start-up (``driver/cluster.py`` draws the stages): Ray started or joined, the run's
keys across nodes, the start-up watch's board, the fork servers, one placement group per role, and every node
checked. It starts no role; it hands the start stage (``driver/start_roles.py``) a :class:`Provisioned`.

    provision(cfg, placement, address, early, model_path, reference_path, t0) -> Provisioned
      connect          start a local Ray (room for the plan) or join ``address``      driver phase "ray start"
      keys, watch      CURVE keys across nodes; the StartupWatch's board in every role's environment
      fork servers     on a Ray of our own: name the early ones, start the rest
      placement        one placement group per role, waited for in order              driver phase "placement"
      node checks      each node: a free port per bundle, run dir and model visible   driver phase "node checks"
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rlhf.config import Config
from async_rlhf.driver.placement import PlacementPlan, local_ray_cpus
from async_rlhf.driver.role_env import ROLE_ENV, forks_roles, generator_env, joined_address, learner_env
from async_rlhf.driver.startup_watch import StartupWatch


class NodeSetupError(RuntimeError):
    """A node cannot take part as placed (a path it cannot see, a rendezvous it cannot reach): one line says
    which node and what to check."""


@dataclass
class Provisioned:
    """What the provision stage hands the start stage: the Ray it runs on, the placement, the checked nodes."""

    placement: PlacementPlan
    own_ray: bool
    """Whether this driver started the Ray it runs on (one node, this host: its processes inherit this one's
    environment, files and cores)."""
    across_nodes: bool
    role_env: dict[str, str]
    """Every role's environment: ROLE_ENV, the network mode and keys across nodes, the watch's board."""
    startup: StartupWatch
    groups: dict[str, Any]
    """One placement group per role."""
    nodes: dict[str, list[dict[str, Any]]]
    """Each role's bundles' node answers (:func:`probe_nodes`): node id, host, a free port, cores."""
    done_at: float
    """When the stage ended (time.time()): the start stage's first phase counts from here."""

    def in_group(self, role: str, index: int) -> Any:
        """The scheduling strategy of bundle ``index`` of ``role``'s placement group."""
        return in_group(self.groups, role, index)


def make_run_keys() -> dict[str, str]:
    """Fresh server and client key pairs for one run (z85); handed to the actors through Ray only."""
    from async_rlhf.buffer.curve import keypair

    server_public, server_secret = keypair()
    client_public, client_secret = keypair()
    return {"server_public": server_public, "server_secret": server_secret,
            "client_public": client_public, "client_secret": client_secret}


def start_early_fork_servers(cfg: Config, address: str | None = None) -> Any:
    """For a driver that will start a Ray of its own (no Ray in this process, no address): the fork servers its
    generators and learner ranks will ask for, started now, first thing (``forkserver.EarlyServers``), so that
    their imports overlap the driver's model and Ray's start; :func:`provision` names them once Ray is up. None
    where the driver joins a Ray (its nodes' servers are theirs) or the roles are not forked."""
    import sys

    ray = sys.modules.get("ray")
    if joined_address(address) or (ray is not None and ray.is_initialized()) or not forks_roles(cfg):
        return None
    envs = [generator_env(cfg, ROLE_ENV), learner_env(cfg, ROLE_ENV)]
    from async_rlhf.startup.forkserver import EarlyServers

    return EarlyServers([e["env_vars"] for e in envs])


def provision(cfg: Config, placement: PlacementPlan, address: str | None, early: Any, model_path: str,
              reference_path: str, t0: float) -> Provisioned:
    """The stage, top to bottom (the module's doc); ``t0``: when the start-up began (its clock)."""
    own_ray = connect(cfg, placement, joined_address(address))
    import ray

    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    from async_rlhf.endpoints import NETWORK_ENV, run_keys_env, use_node_addresses

    across_nodes = use_node_addresses(cfg.run.network, alive)
    role_env: dict[str, str] = dict(ROLE_ENV)
    if across_nodes:  # every actor (and this driver's own buffer client) learns the mode and the keys
        role_env.update({NETWORK_ENV: "node", **run_keys_env(make_run_keys())})
        os.environ.update(role_env)
    # every rank reports its start-up phases to the watch's board (progress line, deadlines per phase)
    startup = StartupWatch(cfg, t0, error=NodeSetupError)
    role_env.update(startup.env)
    if own_ray:
        prestart_fork_servers(cfg, role_env, startup, early)
    t = driver_phase(startup, "ray start", t0)
    groups = placement_groups(cfg, placement)
    t = driver_phase(startup, "placement", t)
    nodes = probe_nodes(cfg, placement, groups, role_env, own_ray, model_path, reference_path)
    t = driver_phase(startup, "node checks", t)
    return Provisioned(placement, own_ray, across_nodes, role_env, startup, groups, nodes, t)


def driver_phase(startup: StartupWatch, phase: str, since: float) -> float:
    """Count ``phase`` from ``since`` to now for the driver; returns now (the next phase's start)."""
    now = time.time()
    startup.driver_phase(phase, now - since)
    return now


def connect(cfg: Config, placement: PlacementPlan, address: str | None) -> bool:
    """Join ``address`` or start a Ray on this host (unless this process has one); whether it started one."""
    import ray

    from async_rlhf.driver.local_ray import start_local_ray
    from async_rlhf.run_logs import forward_role_output

    if ray.is_initialized():
        return False
    if address:  # joining: Ray refuses resource arguments for a cluster it did not start
        ray.init(address=address, log_to_driver=forward_role_output(cfg))
        return False
    # locally, room for the plan plus a few generators added by `scale` (roles share the cores)
    local_cpus = local_ray_cpus(cfg, placement, os.cpu_count() or 1)
    start_local_ray(local_cpus, dict(ROLE_ENV), log_to_driver=forward_role_output(cfg))
    return True


def prestart_fork_servers(cfg: Config, role_env: dict[str, str], startup: StartupWatch, early: Any) -> None:
    """On the Ray this driver started (one node, this host): name the fork servers started before Ray
    (:func:`start_early_fork_servers`) and start any other the generators and learner ranks will use now, so that
    their imports overlap the placement, the node check and the buffer's start."""
    import psutil
    import ray

    envs = [e["env_vars"] for e in (generator_env(cfg, role_env), learner_env(cfg, role_env))
            if "py_executable" in e]
    raylets = [p.pid for p in psutil.Process().children(recursive=True) if p.name() == "raylet"]
    if not envs or len(raylets) != 1:
        return  # the early servers end when the runner closes them
    from async_rlhf.startup import forkserver

    node_id = ray.get_runtime_context().get_node_id()
    if early is not None:
        envs = early.bind(node_id, raylets[0], envs)
    pids = (early.pids if early is not None else []) + forkserver.prestart(node_id, raylets[0], envs)
    used: dict[int, float] = {}

    def servers_cpu() -> float:  # a rank waiting for its server to import is not stuck (StartupWatch)
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue  # ended: what it used stays counted
            used[pid] = times.user + times.system
        return sum(used.values())

    startup.helpers = servers_cpu


def placement_groups(cfg: Config, placement: PlacementPlan) -> dict[str, Any]:
    """One placement group per role, pack or spread (resources.placement); waits until placed."""
    import ray
    from ray.util.placement_group import placement_group

    from async_rlhf.driver.placement import unplaced_message

    groups = {r.role: placement_group(r.ray_bundles(), strategy=r.strategy.upper(), name="")
              for r in placement.roles}
    waited = cfg.run.startup_phase_s
    deadline = time.monotonic() + waited
    for role in placement.roles:  # in order: a group that cannot be placed is named with what is left
        try:
            ray.get(groups[role.role].ready(), timeout=max(deadline - time.monotonic(), 1.0))
        except ray.exceptions.GetTimeoutError:
            nodes = {n["NodeManagerAddress"]: dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")}
            raise NodeSetupError(unplaced_message(role, waited, ray.available_resources(),
                                                  ray.cluster_resources(), nodes)) from None
    return groups


def in_group(groups: dict[str, Any], role: str, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=groups[role], placement_group_bundle_index=index)


def probe_nodes(cfg: Config, placement: PlacementPlan, groups: dict[str, Any], role_env: dict[str, str],
                own_ray: bool, model_path: str, reference_path: str) -> dict[str, list[dict[str, Any]]]:
    """Ask every bundle's node where it would listen and whether it sees the run directory and the model
    (a task on each node that holds bundles, before the roles start; on a Ray this driver started, the driver
    itself); refuse a node that does not, with one line."""
    import ray

    from async_rlhf.endpoints import SHARED_TOKEN, probe_node

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    (run_dir / SHARED_TOKEN).write_text(token)

    def args(bundles: list[tuple[str, int]]) -> tuple[str, str, tuple[str, ...]]:
        # the run directory matters where learners run (their checkpoints go there)
        learners = any(role == "learners" for role, _ in bundles)
        models = (model_path, reference_path) if learners else (model_path,)
        return str(run_dir) if learners else "", token, tuple(dict.fromkeys(models))

    bundles = [(r.role, i) for r in placement.roles for i in range(r.count)]
    if own_ray:  # every bundle is on this host, in workers of the raylet this process started (its
        # environment, files and cores): the driver answers for them (a task per bundle started a worker
        # process each: 1.5-2.4 s of a 1 + 1 start-up on 2 cores)
        by_node = [bundles]
        answers = [probe_node(*args(bundles), ports=len(bundles))]
    else:  # one task per node, in its first bundle there, answering for all of them (a task per bundle
        # started a worker process per bundle: 17 of them and 22 s of an 8 + 8 start-up over 4 nodes)
        from ray.util import placement_group_table

        probe = ray.remote(num_cpus=0)(probe_node)
        env = {"env_vars": role_env}
        node_of = {r.role: placement_group_table(groups[r.role])["bundles_to_node_id"] for r in placement.roles}
        by_node = bundles_by_node({(role, i): node_of[role][i] for role, i in bundles})
        refs = [probe.options(scheduling_strategy=in_group(groups, *group[0]), runtime_env=env).remote(
            *args(group), ports=len(group)) for group in by_node]
        answers = ray.get(refs, timeout=cfg.run.rendezvous_timeout_s)
    nodes = answers_per_bundle(by_node, answers, [(r.role, r.count) for r in placement.roles])
    (run_dir / SHARED_TOKEN).unlink(missing_ok=True)
    for role, found in nodes.items():
        for i, node in enumerate(found):
            if node["missing"]:
                raise NodeSetupError(f"{role} {i} on node {node['node']} cannot read {node['missing'][0]}: give "
                                     "paths that every node sees at the same place (shared storage)")
            if role == "learners" and not node["sees_run_dir"]:
                raise NodeSetupError(f"learner rank {i} on node {node['node']} does not see the run directory "
                                     f"{run_dir} as the driver does (its checkpoints go there): put run.dir on "
                                     "storage shared by every node, at the same path")
    return nodes


def bundles_by_node(where: dict[tuple[str, int], str]) -> list[list[tuple[str, int]]]:
    """The bundles (role, index) of each node, in the order of ``where`` (bundle -> node id): a node's first
    bundle is where its probe runs."""
    grouped: dict[str, list[tuple[str, int]]] = {}
    for bundle, node in where.items():
        grouped.setdefault(node, []).append(bundle)
    return list(grouped.values())


def answers_per_bundle(groups: list[list[tuple[str, int]]], answers: list[dict[str, Any]],
                       roles: list[tuple[str, int]]) -> dict[str, list[dict[str, Any]]]:
    """Each bundle's probe answer from its group's one answer (``probe_node``): the node's, with a ``port`` of its
    own (the probe found one free port per bundle of the group); ``roles`` gives each role's bundle count, in
    order."""
    per: dict[tuple[str, int], dict[str, Any]] = {}
    for bundles, answer in zip(groups, answers, strict=True):
        node = {k: v for k, v in answer.items() if k != "ports"}
        for bundle, port in zip(bundles, answer["ports"], strict=True):
            per[bundle] = {**node, "port": port}
    return {role: [per[(role, i)] for i in range(count)] for role, count in roles}
