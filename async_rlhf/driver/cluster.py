"""The roles of a run on Ray: placement groups, every actor started and wired to the others' addresses.

    driver (this process)
      |-- BufferActor        ZeroMQ ROUTER on its node, memory or Redis store, staleness rule, ledger
      |                      (Redis: restarted by Ray on the same port, recovers its state; see buffer_watch.py)
      |-- RewardModelServer x K  (rewards.sources=model) owned by the driver, found by name by the generators
      |-- GeneratorActor x N vLLM engine + loop            --put--> buffer
      |-- LearnerActor   x M DeepSpeed engine              <--get-- buffer
      |        rank 0 ==broadcast (own TCPStore, gloo/nccl)==> every generator's vLLM worker
      '-- (runner.py) progress: polls learners, generators and buffer; metrics, checkpoints, plots
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from async_rlhf.config import Config
from async_rlhf.generator.engine_args import engine_env
from async_rlhf.sync.protocol import tp_member_ids

log = logging.getLogger(__name__)


def resolve_model(cfg: Config, cache_root: Path) -> str:
    """The policy to start from: ``model.path``, or the tiny model with its SFT warm start (cached)."""
    if cfg.model.path:
        return str(Path(cfg.model.path).resolve())
    from async_rlhf.tiny.cache import cached_policy

    task = cfg.task
    if task.name not in ("addition", "longtail"):  # guess_number, reward_model, custom: the addition warm start
        task = task.model_copy(update={"name": "addition"})
    cached = cached_policy(cache_root, task, seed=cfg.train.seed)  # without importing torch and transformers
    if cached is not None:
        return str(cached)
    from async_rlhf.tiny.sft import prepare_tiny_policy

    return str(prepare_tiny_policy(cache_root, task, seed=cfg.train.seed))


def heldout_accuracy(model_dir: str, cfg: Config) -> float:
    """Greedy held-out accuracy of a Hugging Face model directory, with transformers (independent of vLLM)."""
    from async_rlhf.env.registry import make_task
    from async_rlhf.eval_model import load_eval_model
    from async_rlhf.tiny.sft import greedy_accuracy
    from async_rlhf.tokenizer import load_tokenizer

    model = load_eval_model(model_dir, cfg.model.dtype)  # the GPU in the model's dtype if there is one
    task = make_task(cfg.task)
    return greedy_accuracy(model, load_tokenizer(model_dir), task.heldout(), cfg.generator.max_new_tokens)


def timed_heldout_accuracy(model_dir: str, cfg: Config) -> tuple[float, float]:
    """:func:`heldout_accuracy` and the seconds it took (what ``Cluster.heldout`` runs as a Ray task: its worker's
    output, the "nanobind: leaked ..." lines of its exit included, goes to run.dir/logs/heldout.log)."""
    from async_rlhf.run_logs import to_role_log

    to_role_log(cfg, "heldout")
    t0 = time.time()
    return heldout_accuracy(model_dir, cfg), time.time() - t0


def pin_roles(cfg: Config, buffer: Any, generators: list[Any], learners: list[Any],
              nodes: dict[str, list[dict[str, Any]]]) -> tuple[Any, Any]:
    """Pin every actor's process to its cores of the CPU plan (``async_rlhf.driver.cpu_plan``); returns the plan
    and the claim on this host's cores (``async_rlhf.driver.core_claims``; None when nothing was claimed).

    ``nodes``: where each role's bundles are (``Cluster._probe_nodes``). On one host the plan uses this host's
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


def role_runtime_env(cfg: Config, env_vars: dict[str, str]) -> dict[str, Any]:
    """A generator's or learner rank's Ray runtime environment: ``env_vars``, and on a CPU run with
    ``run.fork_workers`` the worker forked from its node's preloaded process (startup/forkserver.py; the buffer
    and the node probe import little and start as Ray starts them)."""
    out: dict[str, Any] = {"env_vars": dict(env_vars)}
    if forks_roles(cfg):
        from async_rlhf.startup import forkserver

        out["py_executable"] = forkserver.command()
    return out


def forks_roles(cfg: Config) -> bool:
    """Whether the generators and learner ranks are forked from their node's fork server (``run.fork_workers``
    on a CPU run)."""
    res = cfg.resources
    return cfg.run.fork_workers and res.generator_gpus == 0 and res.learner_gpus == 0


def joined_address(address: str | None) -> str | None:
    """The Ray a driver joins: ``address``, else ``RAY_ADDRESS`` (under ``ray job submit``: the job's cluster);
    None: it starts its own (unless this process has one already)."""
    return address or os.environ.get("RAY_ADDRESS") or None


ROLE_ENV = {"TOKENIZERS_PARALLELISM": "false"}
"""What every role's environment holds (a run across nodes adds its network mode and keys, the start-up watch its
board)."""


def generator_env(cfg: Config, role_env: dict[str, str]) -> dict[str, Any]:
    return role_runtime_env(cfg, {**role_env, **engine_env(cfg)})


def learner_env(cfg: Config, role_env: dict[str, str]) -> dict[str, Any]:
    return role_runtime_env(cfg, {**role_env, "OMP_NUM_THREADS": str(cfg.learner.threads)})


def start_early_fork_servers(cfg: Config, address: str | None = None) -> Any:
    """For a driver that will start a Ray of its own (no Ray in this process, no address): the fork servers its
    generators and learner ranks will ask for, started now, first thing (``forkserver.EarlyServers``), so that
    their imports overlap the driver's model and Ray's start; ``Cluster`` names them once Ray is up. None where
    the driver joins a Ray (its nodes' servers are theirs) or the roles are not forked."""
    ray = sys.modules.get("ray")
    if joined_address(address) or (ray is not None and ray.is_initialized()) or not forks_roles(cfg):
        return None
    envs = [generator_env(cfg, ROLE_ENV), learner_env(cfg, ROLE_ENV)]
    from async_rlhf.startup.forkserver import EarlyServers

    return EarlyServers([e["env_vars"] for e in envs])


class Cluster:
    """Handles to the started roles (the integration tests inspect them after a run)."""

    def __init__(self, cfg: Config, model_path: str, address: str | None = None, early: Any = None,
                 heldout: bool = False, reference_path: str | None = None) -> None:
        """``heldout``: start :meth:`heldout` of ``model_path`` once the node check passed, beside the rest of the
        start-up (its ref is :attr:`heldout_start`); ``reference_path``: the learners' frozen reference, the
        model the run first started from (default ``model_path``; a resumed run's policy is never it)."""
        import ray

        from async_rlhf.buffer.actor import BufferActor
        from async_rlhf.driver.local_ray import start_local_ray
        from async_rlhf.driver.placement import plan_placement
        from async_rlhf.driver.startup_watch import StartupWatch
        from async_rlhf.endpoints import NETWORK_ENV, make_run_keys, run_keys_env, use_node_addresses
        from async_rlhf.generator.actor import GeneratorActor
        from async_rlhf.rewards.model import start_reward_models
        from async_rlhf.run_logs import forward_role_output
        from async_rlhf.startup.phases import FIRST_PUSH

        t0 = time.time()
        self.cfg = cfg
        self.core_claim: Any = None
        self.model_path = model_path
        self.reference_path = reference_path or model_path
        self.plan = plan_placement(cfg)
        res = cfg.resources
        address = joined_address(address)
        self.own_ray = False
        """Whether this driver started the Ray it runs on (one node, this host: its processes inherit this one's
        environment, files and cores)."""
        if not ray.is_initialized():
            if address:  # joining: Ray refuses resource arguments for a cluster it did not start
                ray.init(address=address, log_to_driver=forward_role_output(cfg))
            else:  # locally, room for the plan plus a few generators added by `scale` (roles share the cores)
                local_cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, int(self.plan.totals()["CPU"] + 0.999)
                                                     + 4 * int(res.generator_cpus + 0.999))
                start_local_ray(local_cpus, {"TOKENIZERS_PARALLELISM": "false"}, log_to_driver=forward_role_output(cfg))
                self.own_ray = True
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        self.across_nodes = use_node_addresses(cfg.run.network, alive)
        self.role_env: dict[str, str] = dict(ROLE_ENV)
        if self.across_nodes:  # every actor (and this driver's own buffer client) learns the mode and the keys
            self.role_env.update({NETWORK_ENV: "node", **run_keys_env(make_run_keys())})
            os.environ.update(self.role_env)
        # every rank reports its start-up phases to the watch's board (progress line, deadlines per phase)
        self.startup = StartupWatch(cfg, t0, error=NodeSetupError)
        self.role_env.update(self.startup.env)
        if self.own_ray:
            self._prestart_fork_servers(early)
        t = self._driver_phase("ray start", t0)
        self.groups = self._placement_groups()
        t = self._driver_phase("placement", t)
        self.nodes = self._probe_nodes()
        t = self._driver_phase("node checks", t)
        self.heldout_start = self.heldout(model_path) if heldout else None
        buffer_cfg, restarts = cfg, 0
        if cfg.buffer.store == "redis" and cfg.run.buffer_max_restarts:
            # a restarted actor binds the same address (its clients reconnect to it): choose the port now, one
            # free on the buffer's node
            buffer_cfg, restarts = copy.deepcopy(cfg), cfg.run.buffer_max_restarts
            buffer_cfg.buffer.port = cfg.buffer.port or self.nodes["buffer"][0]["port"]
        self.buffer = ray.remote(BufferActor).options(
            num_cpus=res.buffer_cpus, max_restarts=restarts, scheduling_strategy=self._in_group("buffer", 0),
            runtime_env={"env_vars": self.role_env}).remote(buffer_cfg)
        self.buffer_address = ray.get(self.buffer.address.remote())
        self._driver_phase("buffer start", t)
        # the reward model's actors: created here, so owned by this driver and not by the generator that first
        # scores (Ray ends an actor with its owner); the generators find them by name
        self.reward_models = start_reward_models(cfg)
        self._gen_cls = ray.remote(GeneratorActor)
        self._gen_opts = {"num_cpus": res.generator_cpus, "num_gpus": res.generator_gpus, "max_concurrency": 4,
                          "resources": self.plan.role("generators").custom(),  # a late joiner's too
                          "max_restarts": cfg.run.generator_max_restarts,
                          "runtime_env": self.generator_env()}
        self.generators = [self._gen_cls.options(**self._gen_opts, scheduling_strategy=self._in_group(
            "generators", i)).remote(i, cfg, model_path, self.buffer_address) for i in range(cfg.generators)]
        for i in range(cfg.generators):
            self.startup.add(f"generator {i}", "generators", self.nodes["generators"][i]["node"])
        self.added: list[Any] = []
        # learner rank 0's node hosts both rendezvous: DeepSpeed's and the weight push's store
        rank0 = self.nodes["learners"][0]
        self.master = (rank0["host"], rank0["port"])
        self.push_host = rank0["host"]
        self._start_learners(model_path)
        self.startup.wait({f"generator {i}": g.ready.remote() for i, g in enumerate(self.generators)})
        self.cpu_plan, self.core_claim = pin_roles(cfg, self.buffer, self.generators, self.learners, self.nodes)
        # the push group: learner rank 0 and every generator, on a TCPStore of its own
        layout = ray.get([lr.weight_layout.remote() for lr in self.learners])[0]
        self.layout = layout
        ids = [f"gen{i}" for i in range(cfg.generators)]
        members = [m for g in ids for m in tp_member_ids(g, res.tensor_parallel)]  # every TP worker receives
        self.startup.enter(FIRST_PUSH)
        self.push_port = ray.get(self.learners[0].open_weight_sync.remote(self.push_host))
        self.startup.wait({"learner rank 0": self.learners[0].form_weight_sync.remote(members),
                           **{f"generator {i}": g.init_weight_sync.remote(self.push_host, self.push_port, mid, layout)
                              for i, (mid, g) in enumerate(zip(ids, self.generators))}}, then=FIRST_PUSH)
        self.startup.finish()
        self.startup_s_by_phase = self.startup.figures()
        """Seconds per start-up phase and role (summary.json's ``startup_s_by_phase``)."""

    def generator_env(self) -> dict[str, Any]:
        return generator_env(self.cfg, self.role_env)

    def learner_env(self) -> dict[str, Any]:
        return learner_env(self.cfg, self.role_env)

    def _prestart_fork_servers(self, early: Any) -> None:
        """On the Ray this driver started (one node, this host): name the fork servers started before Ray
        (``start_early_fork_servers``) and start any other the generators and learner ranks will use now, so that
        their imports overlap the placement, the node check and the buffer's start."""
        import psutil
        import ray

        envs = [e["env_vars"] for e in (self.generator_env(), self.learner_env()) if "py_executable" in e]
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

        self.startup.helpers = servers_cpu

    def _driver_phase(self, phase: str, since: float) -> float:
        now = time.time()
        self.startup.driver_phase(phase, now - since)
        return now

    def _probe_nodes(self) -> dict[str, list[dict[str, Any]]]:
        """Ask every bundle's node where it would listen and whether it sees the run directory and the model
        (a task on each node that holds bundles, before the roles start; on a Ray this driver started, the driver
        itself); refuse a node that does not, with one line."""
        import uuid

        import ray

        from async_rlhf.endpoints import SHARED_TOKEN, probe_node

        run_dir = Path(self.cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        (run_dir / SHARED_TOKEN).write_text(token)

        def args(bundles: list[tuple[str, int]]) -> tuple[str, str, tuple[str, ...]]:
            # the run directory matters where learners run (their checkpoints go there)
            learners = any(role == "learners" for role, _ in bundles)
            models = (self.model_path, self.reference_path) if learners else (self.model_path,)
            return str(run_dir) if learners else "", token, tuple(dict.fromkeys(models))

        bundles = [(r.role, i) for r in self.plan.roles for i in range(r.count)]
        if self.own_ray:  # every bundle is on this host, in workers of the raylet this process started (its
            # environment, files and cores): the driver answers for them (a task per bundle started a worker
            # process each: 1.5-2.4 s of a 1 + 1 start-up on 2 cores)
            groups = [bundles]
            answers = [probe_node(*args(bundles), ports=len(bundles))]
        else:  # one task per node, in its first bundle there, answering for all of them (a task per bundle
            # started a worker process per bundle: 17 of them and 22 s of an 8 + 8 start-up over 4 nodes)
            from ray.util import placement_group_table

            probe = ray.remote(num_cpus=0)(probe_node)
            env = {"env_vars": self.role_env}
            node_of = {r.role: placement_group_table(self.groups[r.role])["bundles_to_node_id"]
                       for r in self.plan.roles}
            groups = bundles_by_node({(role, i): node_of[role][i] for role, i in bundles})
            refs = [probe.options(scheduling_strategy=self._in_group(*group[0]), runtime_env=env).remote(
                *args(group), ports=len(group)) for group in groups]
            answers = ray.get(refs, timeout=self.cfg.run.rendezvous_timeout_s)
        nodes = answers_per_bundle(groups, answers, [(r.role, r.count) for r in self.plan.roles])
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

    def _start_learners(self, model_path: str, attempts: int = 3) -> None:
        """Start the learner ranks. Rank 0 listens for DeepSpeed's rendezvous on a port its node found free
        when probed; if another process took that port meanwhile, start them again on a fresh one."""
        import ray

        from async_rlhf.endpoints import free_port
        from async_rlhf.learner.actor import LearnerActor

        cfg, res = self.cfg, self.cfg.resources
        learner_cls = ray.remote(LearnerActor)
        opts = {"num_cpus": res.learner_cpus, "num_gpus": res.learner_gpus, "max_concurrency": 3,
                "runtime_env": self.learner_env()}
        for attempt in range(attempts):
            self.learners = [learner_cls.options(**opts, scheduling_strategy=self._in_group("learners", r)).remote(
                r, cfg.learners, cfg, model_path, *self.master, self.buffer_address, self.reference_path)
                for r in range(cfg.learners)]
            for r in range(cfg.learners):
                self.startup.add(f"learner rank {r}", "learners", self.nodes["learners"][r]["node"])
            self.startup.set_rendezvous(*self.master)
            try:
                self._await_learners()
                return
            except ray.exceptions.RayActorError as exc:
                if attempt == attempts - 1 or not port_taken(exc):
                    raise
            log.warning("the DeepSpeed rendezvous port %d was taken before rank 0 bound it: starting the learner "
                        "ranks again on a fresh port", self.master[1])
            for actor in self.learners:
                ray.kill(actor)
            probe = ray.remote(num_cpus=0)(free_port).options(scheduling_strategy=self._in_group("learners", 0))
            self.master = (self.master[0], ray.get(probe.remote(self.master[0]), timeout=60))

    def _await_learners(self) -> None:
        """Every learner rank starts, each phase within its deadline, or the run stops with one line naming the rank,
        its node and the phase (for the rendezvous, counted from the last rank reaching it, the address it
        dialled): see async_rlhf/startup/phases.py. A rank that fails (rank 0's bind) raises at once."""
        self.startup.wait({f"learner rank {r}": lr.ready.remote() for r, lr in enumerate(self.learners)})

    def pin_buffer(self) -> None:
        """Pin a restarted buffer actor's new process as the CPU plan says (the old one was pinned at start)."""
        import ray

        from async_rlhf.driver.cpu_plan import pin_actor

        place = self.cpu_plan.placements["buffer"]
        ray.get(self.buffer.__ray_call__.remote(pin_actor, list(place.cores), None, place.nice), timeout=10.0)

    def _placement_groups(self) -> dict[str, Any]:
        """One placement group per role, pack or spread (resources.placement); waits until placed."""
        import ray
        from ray.util.placement_group import placement_group

        from async_rlhf.driver.placement import unplaced_message

        groups = {r.role: placement_group(r.ray_bundles(), strategy=r.strategy.upper(), name="")
                  for r in self.plan.roles}
        waited = self.cfg.run.startup_phase_s
        deadline = time.monotonic() + waited
        for role in self.plan.roles:  # in order: a group that cannot be placed is named with what is left
            try:
                ray.get(groups[role.role].ready(), timeout=max(deadline - time.monotonic(), 1.0))
            except ray.exceptions.GetTimeoutError:
                nodes = {n["NodeManagerAddress"]: dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")}
                raise NodeSetupError(unplaced_message(role, waited, ray.available_resources(),
                                                      ray.cluster_resources(), nodes)) from None
        return groups

    def _in_group(self, role: str, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.groups[role],
                                                placement_group_bundle_index=index)

    def heldout(self, model_dir: str) -> Any:
        """A ref of ``timed_heldout_accuracy(model_dir, cfg)`` computed by a Ray task in learner rank 0's bundle
        and runtime environment: on a run that forks its roles (:func:`forks_roles`) the task's worker is a fork
        of that node's server, past the imports of torch and transformers, so the driver never imports them (~5
        CPU-s of every launch's start-up on 2 cores, when it evaluated in a thread of its own). The task takes
        no CPU of the bundle (the rank's are its own). Rank 0's node has the model (the node check saw to that)
        and is where :meth:`save_policy` writes the final policy; a run whose rank 0 is gone has failed."""
        import ray

        return ray.remote(timed_heldout_accuracy).options(
            num_cpus=0, runtime_env=self.learner_env(),
            scheduling_strategy=self._in_group("learners", 0)).remote(model_dir, self.cfg)

    def new_generator(self, gen_id: int) -> Any:
        """A generator added while training runs (outside the placement group, which has a fixed size)."""
        handle = self._gen_cls.options(**self._gen_opts).remote(gen_id, self.cfg, self.model_path,
                                                                self.buffer_address)
        self.added.append(handle)
        return handle

    def join_late(self, member_id: str, handle: Any) -> None:
        """Admit a started (or restarted) generator to the push group; it takes the next version first (its
        join request reaches the sender through the push group's store, admitted at the next push)."""
        import ray

        ray.get(handle.init_weight_sync.remote(self.push_host, self.push_port, member_id, self.layout, late=True))

    @property
    def reference_sha256(self) -> str | None:
        """The digest of the frozen reference weights learner rank 0 loaded (None without a reference)."""
        import ray

        return ray.get(self.learners[0].reference_sha256.remote())

    def save_policy(self, out_dir: str | Path) -> str:
        """The policy as a Hugging Face directory, written by rank 0; every rank takes part (under ZeRO-3 the
        parameters are gathered collectively, so asking rank 0 alone would wait forever)."""
        import ray

        return ray.get([lr.save_hf.remote(str(Path(out_dir).resolve())) for lr in self.learners])[0]

    def generator_died(self, member_id: str) -> None:
        """Tell the pushing learner that this member is gone, so no push waits for it (fire and forget)."""
        self.learners[0].drop_generators.remote(tp_member_ids(member_id, self.cfg.resources.tensor_parallel))

    def close(self) -> None:
        """Kill this run's actors but keep Ray up (experiments run several clusters in one Ray session)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in [*self.generators, *self.added, *self.learners, self.buffer]:
            ray.kill(actor)
        if self.reward_models is not None:
            self.reward_models.close()
        for pg in self.groups.values():
            remove_placement_group(pg)
        self.startup.close()
        if self.core_claim is not None:
            self.core_claim.release()

    def shutdown(self) -> None:
        import ray

        self.close()
        ray.shutdown()


def port_taken(exc: BaseException) -> bool:
    """Whether a role failed because the port it was to listen on was taken (EADDRINUSE)."""
    text = str(exc).lower()
    return "eaddrinuse" in text or "address already in use" in text


class NodeSetupError(RuntimeError):
    """A node cannot take part as placed (a path it cannot see, a rendezvous it cannot reach): one line says
    which node and what to check."""
