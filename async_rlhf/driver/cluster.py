"""The roles of a run on Ray, started by a pipeline of stages, each handing its result to the next; then the
handle to the running roles (:class:`Cluster`).

    driver (this process)
      |-- BufferActor        ZeroMQ ROUTER on its node, memory or Redis store, staleness rule, ledger
      |                      (Redis: restarted by Ray on the same port, recovers its state; see buffer_watch.py)
      |-- RewardModelServer x K  (rewards.sources=model) owned by the driver, found by name by the generators
      |-- GeneratorActor x N vLLM engine + loop            --put--> buffer
      |-- LearnerActor   x M DeepSpeed engine              <--get-- buffer
      |        rank 0 ==broadcast (own TCPStore, gloo/nccl)==> every generator's vLLM worker
      '-- (runner.py) progress: polls learners, generators and buffer; metrics, checkpoints, plots

Start-up, top to bottom (``../shared/STYLE.md`` item 13); no stage reaches back into an earlier one:

    plan        pure, no Ray: the config and the cluster's resources
                launch/cluster.py        config, PlacementPlan (driver/placement.py), memory plan, fits, address
                policy_source.py         the model to start from (resolve_model), its held-out figure
                driver/role_env.py       every role's environment, whether roles fork, the Ray to join
                driver/runner.py run()   the run directory, the early fork servers, the model; then Cluster(...)
                  | cfg, PlacementPlan, model_path, reference_path, address, early fork servers
                  v
    provision   driver/provision.py      Ray started or joined, keys, the start-up watch's board, fork
                                         servers, placement groups, every node checked
                  | Provisioned(placement, own_ray, across_nodes, role_env, startup, groups, nodes, done_at)
                  |   (Cluster.heldout: the start policy's held-out task in learner rank 0's bundle, beside)
                  v
    start       driver/start_roles.py    buffer, reward models, generators, learners, pinned to their cores,
                                         the first push's group
                  | Roles(buffer, generators, learners, push host/port, layout, cpu_plan, ...)
                  v
    watch       driver/startup_watch.py  each rank's start-up phases against their deadlines (during start);
                Cluster + driver/runner.py   then the running roles: progress, deaths, late joiners, the end

``Cluster(cfg, model_path, ...)`` runs provision and start and holds what they handed on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from async_rlhf.config import Config
from async_rlhf.driver.placement import plan_placement
from async_rlhf.driver.provision import Provisioned, provision
from async_rlhf.driver.role_env import generator_env, learner_env
from async_rlhf.driver.start_roles import Roles, start_roles
from async_rlhf.policy_source import resolve_model as resolve_model  # for bench/scale_job.py, which takes it here
from async_rlhf.policy_source import timed_heldout_accuracy
from async_rlhf.sync.protocol import tp_member_ids


class Cluster:
    """Handles to the started roles (the integration tests inspect them after a run)."""

    def __init__(self, cfg: Config, model_path: str, address: str | None = None, early: Any = None,
                 heldout: bool = False, reference_path: str | None = None) -> None:
        """Provision, then start (the module's doc). ``early``: the fork servers started before Ray
        (``provision.start_early_fork_servers``); ``heldout``: start :meth:`heldout` of ``model_path`` once the
        node check passed, beside the rest of the start-up (its ref is :attr:`heldout_start`);
        ``reference_path``: the learners' frozen reference, the model the run first started from (default
        ``model_path``; a resumed run's policy is never it)."""
        t0 = time.time()  # the start-up clock: "ray start" counts from here
        self.cfg = cfg
        self.model_path = model_path
        self.reference_path = reference_path or model_path
        self.plan = plan_placement(cfg)
        self.provisioned: Provisioned = provision(cfg, self.plan, address, early, model_path, self.reference_path,
                                                  t0)
        prov = self.provisioned
        self.own_ray, self.across_nodes, self.role_env = prov.own_ray, prov.across_nodes, prov.role_env
        self.startup, self.groups, self.nodes = prov.startup, prov.groups, prov.nodes
        self.heldout_start = self.heldout(model_path) if heldout else None
        self.roles: Roles = start_roles(cfg, prov, model_path, self.reference_path)
        roles = self.roles
        self.buffer, self.buffer_address, self.reward_models = roles.buffer, roles.buffer_address, roles.reward_models
        self.generators, self.learners = roles.generators, roles.learners
        self.added: list[Any] = []
        self.master, self.push_host, self.push_port, self.layout = (roles.master, roles.push_host, roles.push_port,
                                                                    roles.layout)
        self.cpu_plan, self.core_claim = roles.cpu_plan, roles.core_claim
        self.startup_s_by_phase = self.startup.figures()
        """Seconds per start-up phase and role (summary.json's ``startup_s_by_phase``)."""

    def generator_env(self) -> dict[str, Any]:
        return generator_env(self.cfg, self.role_env)

    def learner_env(self) -> dict[str, Any]:
        return learner_env(self.cfg, self.role_env)

    def _in_group(self, role: str, index: int) -> Any:
        return self.provisioned.in_group(role, index)

    def pin_buffer(self) -> None:
        """Pin a restarted buffer actor's new process as the CPU plan says (the old one was pinned at start)."""
        import ray

        from async_rlhf.driver.cpu_plan import pin_actor

        place = self.cpu_plan.placements["buffer"]
        ray.get(self.buffer.__ray_call__.remote(pin_actor, list(place.cores), None, place.nice), timeout=10.0)

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
        handle = self.roles.gen_cls.options(**self.roles.gen_opts).remote(gen_id, self.cfg, self.model_path,
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


