"""The start stage of a start-up (``driver/cluster.py`` draws the stages): every role started in the bundles the
provision stage placed and checked, wired to the others' addresses, pinned to its cores, and the first weight
push's group formed. It hands the running handle (``Cluster``) a :class:`Roles`.

    start_roles(cfg, provisioned, model_path, reference_path) -> Roles
      buffer           BufferActor in its bundle (Redis store: a port chosen now, kept across restarts)
                                                                              driver phase "buffer start"
      reward models    rewards.sources=model: owned by the driver, found by name by the generators
      generators       GeneratorActor x N, each in its bundle; the watch follows each one's phases
      learners         LearnerActor x M, rank 0's node hosts both rendezvous; a port taken meanwhile: again
      ready, pinned    every generator ready; every actor pinned to its cores of the CPU plan
      first push       learner rank 0 opens the push store, every generator joins: the watch's last phase
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any

from async_rlhf.config import Config
from async_rlhf.driver.provision import Provisioned, driver_phase
from async_rlhf.driver.role_env import generator_env, learner_env
from async_rlhf.sync.protocol import tp_member_ids

log = logging.getLogger(__name__)


@dataclass
class Roles:
    """What the start stage hands the running handle: the started actors and where they meet."""

    buffer: Any
    buffer_address: str
    reward_models: Any
    generators: list[Any]
    learners: list[Any]
    master: tuple[str, int]
    """Learner rank 0's DeepSpeed rendezvous (host, port)."""
    push_host: str
    push_port: int
    layout: Any
    """The weight layout every generator receives pushes in (learner rank 0's)."""
    cpu_plan: Any
    core_claim: Any
    """The claim on this host's cores (``driver/core_claims.py``); None when nothing was claimed."""
    gen_cls: Any
    gen_opts: dict[str, Any] = field(default_factory=dict)
    """How a generator actor is made (a late joiner added by ``scale`` too, outside the placement group)."""


def start_roles(cfg: Config, prov: Provisioned, model_path: str, reference_path: str) -> Roles:
    """The stage, top to bottom (the module's doc)."""
    import ray

    from async_rlhf.generator.actor import GeneratorActor
    from async_rlhf.rewards.model import start_reward_models
    from async_rlhf.startup.phases import FIRST_PUSH

    res, startup = cfg.resources, prov.startup
    buffer = start_buffer(cfg, prov)
    buffer_address = ray.get(buffer.address.remote())
    driver_phase(startup, "buffer start", prov.done_at)  # from the node checks' end (the held-out task's submission)
    # the reward model's actors: created here, so owned by this driver and not by the generator that first
    # scores (Ray ends an actor with its owner); the generators find them by name
    reward_models = start_reward_models(cfg)
    gen_cls = ray.remote(GeneratorActor)
    gen_opts = {"num_cpus": res.generator_cpus, "num_gpus": res.generator_gpus, "max_concurrency": 4,
                "resources": prov.placement.role("generators").custom(),  # a late joiner's too
                "max_restarts": cfg.run.generator_max_restarts,
                "runtime_env": generator_env(cfg, prov.role_env)}
    generators = [gen_cls.options(**gen_opts, scheduling_strategy=prov.in_group("generators", i)).remote(
        i, cfg, model_path, buffer_address) for i in range(cfg.generators)]
    for i in range(cfg.generators):
        startup.add(f"generator {i}", "generators", prov.nodes["generators"][i]["node"])
    # learner rank 0's node hosts both rendezvous: DeepSpeed's and the weight push's store
    rank0 = prov.nodes["learners"][0]
    learners, master = start_learners(cfg, prov, model_path, reference_path, buffer_address,
                                      (rank0["host"], rank0["port"]))
    startup.wait({f"generator {i}": g.ready.remote() for i, g in enumerate(generators)})
    cpu_plan, core_claim = pin_roles(cfg, buffer, generators, learners, prov.nodes)
    # the push group: learner rank 0 and every generator, on a TCPStore of its own
    layout = ray.get([lr.weight_layout.remote() for lr in learners])[0]
    ids = [f"gen{i}" for i in range(cfg.generators)]
    members = [m for g in ids for m in tp_member_ids(g, res.tensor_parallel)]  # every TP worker receives
    push_host = rank0["host"]
    startup.enter(FIRST_PUSH)
    push_port = ray.get(learners[0].open_weight_sync.remote(push_host))
    startup.wait({"learner rank 0": learners[0].form_weight_sync.remote(members),
                  **{f"generator {i}": g.init_weight_sync.remote(push_host, push_port, mid, layout)
                     for i, (mid, g) in enumerate(zip(ids, generators))}}, then=FIRST_PUSH)
    startup.finish()
    return Roles(buffer, buffer_address, reward_models, generators, learners, master, push_host, push_port,
                 layout, cpu_plan, core_claim, gen_cls, gen_opts)


def start_buffer(cfg: Config, prov: Provisioned) -> Any:
    """The buffer actor in its bundle. With a Redis store that Ray may restart, a restarted actor binds the same
    address (its clients reconnect to it): the port is chosen now, one free on the buffer's node."""
    import ray

    from async_rlhf.buffer.actor import BufferActor

    buffer_cfg, restarts = cfg, 0
    if cfg.buffer.store == "redis" and cfg.run.buffer_max_restarts:
        buffer_cfg, restarts = copy.deepcopy(cfg), cfg.run.buffer_max_restarts
        buffer_cfg.buffer.port = cfg.buffer.port or prov.nodes["buffer"][0]["port"]
    return ray.remote(BufferActor).options(
        num_cpus=cfg.resources.buffer_cpus, max_restarts=restarts, scheduling_strategy=prov.in_group("buffer", 0),
        runtime_env={"env_vars": prov.role_env}).remote(buffer_cfg)


def start_learners(cfg: Config, prov: Provisioned, model_path: str, reference_path: str, buffer_address: str,
                   master: tuple[str, int], attempts: int = 3) -> tuple[list[Any], tuple[str, int]]:
    """Start the learner ranks; returns them and the rendezvous they met at. Rank 0 listens for DeepSpeed's
    rendezvous on a port its node found free when probed; if another process took that port meanwhile, start
    them again on a fresh one.

    Every rank starts, each phase within its deadline, or the run stops with one line naming the rank, its node
    and the phase (for the rendezvous, counted from the last rank reaching it, the address it dialled): see
    async_rlhf/startup/phases.py. A rank that fails (rank 0's bind) raises at once."""
    import ray

    from async_rlhf.endpoints import free_port
    from async_rlhf.learner.actor import LearnerActor

    res, startup = cfg.resources, prov.startup
    learner_cls = ray.remote(LearnerActor)
    opts = {"num_cpus": res.learner_cpus, "num_gpus": res.learner_gpus, "max_concurrency": 3,
            "runtime_env": learner_env(cfg, prov.role_env)}
    for attempt in range(attempts):
        learners = [learner_cls.options(**opts, scheduling_strategy=prov.in_group("learners", r)).remote(
            r, cfg.learners, cfg, model_path, *master, buffer_address, reference_path)
            for r in range(cfg.learners)]
        for r in range(cfg.learners):
            startup.add(f"learner rank {r}", "learners", prov.nodes["learners"][r]["node"])
        startup.set_rendezvous(*master)
        try:
            startup.wait({f"learner rank {r}": lr.ready.remote() for r, lr in enumerate(learners)})
            return learners, master
        except ray.exceptions.RayActorError as exc:
            if attempt == attempts - 1 or not port_taken(exc):
                raise
        log.warning("the DeepSpeed rendezvous port %d was taken before rank 0 bound it: starting the learner "
                    "ranks again on a fresh port", master[1])
        for actor in learners:
            ray.kill(actor)
        probe = ray.remote(num_cpus=0)(free_port).options(scheduling_strategy=prov.in_group("learners", 0))
        master = (master[0], ray.get(probe.remote(master[0]), timeout=60))
    raise AssertionError("unreachable: the last attempt returns or raises")


def port_taken(exc: BaseException) -> bool:
    """Whether a role failed because the port it was to listen on was taken (EADDRINUSE)."""
    text = str(exc).lower()
    return "eaddrinuse" in text or "address already in use" in text


def pin_roles(cfg: Config, buffer: Any, generators: list[Any], learners: list[Any],
              nodes: dict[str, list[dict[str, Any]]]) -> tuple[Any, Any]:
    """Pin every actor's process to its cores of the CPU plan (``async_rlhf.driver.cpu_plan``); returns the plan
    and the claim on this host's cores (``async_rlhf.driver.core_claims``; None when nothing was claimed).

    ``nodes``: where each role's bundles are (``provision.probe_nodes``). On one host the plan uses this host's
    cores; across nodes each node is planned from its own cores. On the driver's own host, cores another run
    claimed are not split again: the roles run unpinned instead."""
    import ray

    from async_rlhf.driver.core_claims import claim_or_unpin
    from async_rlhf.driver.cpu_plan import pin_actor, plan_nodes
    from async_rlhf.endpoints import node_ip

    per_node: dict[str, dict[str, Any]] = {}
    for role in ("generators", "learners", "buffer"):
        for i, node in enumerate(nodes[role]):
            entry = per_node.setdefault(node["node"], {"cores": node["cores"], "generators": [], "learners": []})
            if role == "buffer":
                entry["buffer"] = True
            else:
                entry[role].append(i)
    plan = plan_nodes(cfg, per_node)  # one node too: it may not be the driver's host (--address)
    claim = None
    if list(per_node) == [node_ip()]:  # this host's cores: another run on it may have pinned them
        plan, claim = claim_or_unpin(cfg, plan)
    actors = {"buffer": buffer, **{f"generator {i}": g for i, g in enumerate(generators)},
              **{f"learner {r}": lr for r, lr in enumerate(learners)}}
    ray.get([a.__ray_call__.remote(pin_actor, list(plan.placements[name].cores), None, plan.placements[name].nice)
             for name, a in actors.items()])
    for warning in plan.warnings:
        log.warning("CPU plan: %s", warning)
    return plan, claim
