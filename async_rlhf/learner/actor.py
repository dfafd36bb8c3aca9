"""Learner rank: one DeepSpeed engine (ZeRO 0-3), the training loop, and (rank 0) the weight push.

    per step s (version v = s // push_every); each line names what it waits for:
      wait_data         get batch_size/M groups from the buffer at version v (stale ones are dropped there)
      collate           pad and stack them
      forward_backward  per micro-batch (learner.max_tokens_per_micro_batch; padded or packed): forward ->
                        policy_loss (+ KL to the reference) over the step's counts -> backward (accumulate);
                        data-parallel ranks all-reduce those counts first (learner/microbatch.py)
      push_wait         rank 0: the push of v (started after the last step) must be out before ...
      optimizer         ... the optimizer writes the parameters it sends from
      ack               tell the buffer which groups were trained
      metrics           build the step's record
      every push_every steps: v += 1; rank 0 hands v to the push thread and goes on with step s + 1:
        push thread:    broadcast the weights to every generator (their receives are already posted),
                        one allreduce of acknowledgements, then tell the buffer v is held everywhere
                        (admission opens one more batch)
      nobody waits for a generator to swap v in: each does at its own step boundary (sync/gen_* metrics)

Under ZeRO-3 the parameters are gathered collectively on every rank, a window of at most
learner.zero3_gather_mb at a time (learner/zero3.py), so that push stays on the training thread (state ``push``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

from async_rlhf.config import Config
from async_rlhf.learner.dpo_update import online_dpo_update
from async_rlhf.learner.pg_update import policy_gradient_update
from async_rlhf.learner.probes import FleetProbes
from async_rlhf.learner.ranks import max_over_ranks, reduce_across_ranks, sum_over_ranks
from async_rlhf.learner.saving import Checkpointing
from async_rlhf.timeline import Timeline

log = logging.getLogger(__name__)

COMPUTE = ("collate", "forward_backward", "optimizer")
"""Learner states that are computation on the batch (``learner_compute_fraction``)."""


class LearnerActor(FleetProbes, Checkpointing):
    """One learner rank (a Ray actor: ``ray.remote(LearnerActor)`` in ``driver/start_roles.py``). Its checkpoint and
    Hugging Face export methods are in ``saving.py``, the fleet measurements in ``probes.py`` (base classes: their
    methods are this actor's, remote-callable the same way); one step's policy-gradient update is ``pg_update.py``."""

    def __init__(self, rank: int, world_size: int, cfg: Config, model_path: str, master_addr: str,
                 master_port: int, buffer_address: str, reference_path: str | None = None) -> None:
        """``model_path``: the policy to start from (a resumed run's checkpoint policy); ``reference_path``: the
        frozen reference (KL, DPO), the model the run first started from (default: ``model_path``)."""
        from async_rlhf.run_logs import to_role_log

        to_role_log(cfg, f"learner-{rank}")  # first: what DeepSpeed prints goes to run.dir/logs, not the console
        from async_rlhf.startup import phases
        from async_rlhf.startup.reporter import StartupReporter

        startup = StartupReporter(f"learner rank {rank}")  # the driver's start-up progress and deadlines
        startup.phase(phases.IMPORTS, "deepspeed")
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM

        from async_rlhf.endpoints import bind_gloo_to_node
        from async_rlhf.prebuild import load_ops

        torch.set_num_threads(cfg.learner.threads)
        load_ops(startup.phase)  # DeepSpeed's shm_comm op, ahead of init_distributed: a build is a phase of its own
        torch.manual_seed(cfg.train.seed + rank)
        bind_gloo_to_node()  # DeepSpeed's and the push group's gloo pairs listen where the other nodes reach them
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        startup.phase(phases.RENDEZVOUS)
        deepspeed.init_distributed(dist_backend=cfg.learner.backend, auto_mpi_discovery=False)
        from async_rlhf.learner.device import Placer, rank_device

        self.placer = Placer(rank_device())  # every input, the reference and reward models go there
        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        many = world_size > 1  # the collectives over the ranks a step's statistics and lockstep need (else None)
        self._sum_ranks = sum_over_ranks if many else None
        self._max_ranks = max_over_ranks if many else None
        self.model_path = model_path
        self.buffer_address = buffer_address
        dtype = getattr(torch, cfg.model.dtype)
        startup.phase(phases.MODEL)
        reference_path = reference_path or model_path
        # LoRA trains adapters on a frozen base that is the reference: it is built from the reference (a resumed
        # policy is a merged export; the checkpoint then restores the adapters)
        model = AutoModelForCausalLM.from_pretrained(reference_path if cfg.train.lora.enabled else model_path,
                                                     dtype=dtype)
        model.config.use_cache = False
        if cfg.learner.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        per_rank = cfg.train.batch_size // world_size * cfg.train.group_size
        ds_config = {
            "train_batch_size": per_rank * world_size,
            "train_micro_batch_size_per_gpu": per_rank,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.train.grad_clip,
            "zero_optimization": {"stage": cfg.learner.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
            "fp16": {"enabled": cfg.model.dtype == "float16"},
            "steps_per_print": 10**9,
        }
        self.merged: Any = None  # train.lora: the merged weights the push sends (learner/lora.py)
        if cfg.train.lora.enabled:
            from async_rlhf.learner.lora import wrap_lora

            model = wrap_lora(model, cfg.train.lora)  # only the adapters train: the optimizer gets only them
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay)
        startup.phase(phases.ENGINE)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        algorithm = cfg.train.algorithm
        self.ref_model = None  # the frozen initial policy: KL in the loss or the PPO reward, DPO's reference
        if cfg.train.lora.enabled:
            from async_rlhf.learner.lora import AdapterOff, MergedWeights

            self.merged = MergedWeights(self.engine.module)
            if cfg.train.objective.kl_coef > 0:  # the base itself: the policy with its adapters off
                self.ref_model = AdapterOff(self.engine.module)
        elif (cfg.train.objective.kl_coef > 0 or algorithm == "online_dpo"
                or (algorithm == "ppo" and cfg.train.ppo.kl_coef > 0)):
            self.ref_model = self.placer.module(AutoModelForCausalLM.from_pretrained(reference_path,
                                                                                     dtype=dtype).eval())
            self.ref_model.requires_grad_(False)
        self._reference_sha256: str | None = None
        if self.ref_model is not None and rank == 0:  # what summary.json and every resume's check compare
            from async_rlhf.learner.weights_digest import weights_sha256

            self._reference_sha256 = weights_sha256(getattr(self.ref_model, "model", self.ref_model))
        self.ppo: Any = None  # critic engine + reward models, beside the actor on this rank
        if algorithm == "ppo":
            from async_rlhf.learner.ppo import PPOTrainer

            self.ppo = PPOTrainer(cfg, model_path, ds_config, self.placer)
        self.version = 0
        self.step = 0
        self.metrics: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._pusher: Any = None  # rank 0: learner/push.py
        self._push_metrics: dict[str, float] = {}  # of the pushes completed during the current step
        self._step_times: defaultdict[str, float] = defaultdict(float)
        self.timeline = Timeline(f"learner {rank}")
        self._trained_by_step: dict[int, dict[str, list[str]]] = {}
        self._stop_at: int | None = None
        self._agreement: Any = None
        """The training/inference agreement of the current step (learner/agreement.py), made by ``_update``."""
        startup.phase(phases.STARTED)

    def ready(self) -> int:
        return self.rank

    def reference_sha256(self) -> str | None:
        """The digest of the frozen reference's weights this rank loaded (rank 0; None without a reference)."""
        return self._reference_sha256

    # -- weight push (rank 0) ----------------------------------------------------------------
    def weight_layout(self) -> list[dict[str, Any]]:
        from async_rlhf.learner.push import push_layout
        from async_rlhf.sync.layout import layout_to_wire

        lc = self.cfg.learner
        if self.merged is not None:  # frozen base tensors and the merged buffers: kept flat at any ZeRO stage
            self._buckets = push_layout(self.merged.tensors, self.cfg.sync.bucket_mb << 20, 0)
        elif lc.zero_stage == 3:  # shapes without gathering; each push gathers a window at a time (learner/zero3.py)
            from async_rlhf.learner.zero3 import windowed_gather

            self._buckets = push_layout(dict(self.engine.module.named_parameters()), self.cfg.sync.bucket_mb << 20, 3)
            self._windows = windowed_gather(self.engine.module, self._buckets, lc.zero3_gather_mb << 20,
                                            self.placer.device)
        else:  # ZeRO 0-2: every rank holds the full parameters
            params = dict(self.engine.module.named_parameters())
            self._buckets = push_layout(params, self.cfg.sync.bucket_mb << 20, lc.zero_stage)
        return layout_to_wire(self._buckets)

    def open_weight_sync(self, host: str) -> int:
        """Rank 0 hosts the push group's TCPStore on a port the system gives it (a port chosen free earlier
        can be taken meanwhile); returns that port, which the generators dial."""
        from async_rlhf.learner.push import WeightPusher

        self._pusher = WeightPusher(self.cfg, self._buckets, host, 0, self.buffer_address)
        return self._pusher.sender.port

    def form_weight_sync(self, member_ids: list[str]) -> None:
        """Form the first epoch with every generator (each joins through ``init_weight_sync`` meanwhile)."""
        # start-up, not a push: the start-up phase's budget (generators may still be joining), see init_weight_sync
        self._pusher.sender.form(list(member_ids), max(self.cfg.sync.timeout_s, self.cfg.run.startup_phase_s))

    def drop_generators(self, member_ids: list[str]) -> None:
        """The driver saw these generators' processes die: a push in flight aborts at once instead of waiting
        ``sync.timeout_s`` for them, and the next push leaves them out (any thread)."""
        if self._pusher is not None:
            self._pusher.members_died(member_ids)

    def _start_push(self, version: int) -> None:
        """Hand ``version`` to the push thread (rank 0) and return at once; under ZeRO-3 gather and push
        here (every rank takes part in the gather). Metrics of finished pushes go to ``_push_metrics``."""
        self._push_metrics.update(self._await_push())
        if self.cfg.learner.zero_stage == 3:  # every rank gathers along, a window at a time
            with self._phase("push"):
                if self.rank == 0:
                    params = dict(self.engine.module.named_parameters())
                    self._push_metrics.update(self._pusher.push(params, version, self._windows))
                else:
                    self._windows.follow()
        elif self.merged is not None and self.rank == 0:  # LoRA: base + scaled B @ A, merged before the push reads it
            t0 = time.perf_counter()
            params = self.merged.refresh()
            self._push_metrics["sync/lora_merge_s"] = time.perf_counter() - t0
            self._pusher.start(params, version)
        elif self.rank == 0:
            self._pusher.start(dict(self.engine.module.named_parameters()), version)

    def _await_push(self) -> dict[str, float]:
        """Wait for the push in flight, if any (state ``push_wait``: the only time the learner waits on the
        fleet); returns its metrics. Raises what the push raised."""
        if self._pusher is None or not self._pusher.in_flight:
            return {}
        with self._phase("push_wait"):
            return self._pusher.wait()

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a phase of the step (its timeline state and ``time/<name>_s`` in the step's record)."""
        self.timeline.enter(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._step_times[name] += time.perf_counter() - t0

    def _optimizer_step(self) -> None:
        """The optimizer writes the parameters the push thread sends from: that push must be out first."""
        self._push_metrics.update(self._await_push())
        with self._phase("optimizer"):
            self.engine.step()

    # -- training ----------------------------------------------------------------------------
    def train(self, steps: int) -> dict[str, Any]:
        from async_rlhf.buffer.build import make_client
        from async_rlhf.buffer.client import with_retry
        from async_rlhf.checkpoint_layout import staging_dir
        from async_rlhf.learner.checkpoint_trigger import CheckpointTrigger
        from async_rlhf.learner.lease import LeaseKeeper, take_share
        from async_rlhf.learner.objectives import correction_saturated

        cfg = self.cfg
        client = make_client(cfg, self.buffer_address, consumer=f"learner-{self.rank}")
        # renews the groups this rank holds while its step runs: a step longer than the visibility timeout must
        # not see them handed to another learner and trained twice (async_rlhf/learner/lease.py)
        lease = LeaseKeeper(lambda: make_client(cfg, self.buffer_address, consumer=f"learner-{self.rank}"),
                            cfg.buffer.visibility_timeout_s / 4)
        patience = cfg.buffer.redis_retry_s + cfg.buffer.request_timeout_s
        share = cfg.train.batch_size // self.world_size
        ckpt = CheckpointTrigger(cfg.run.checkpoint_every, cfg.run.checkpoint_every_s, any_rank=(
            (lambda due: max_over_ranks(int(due)) > 0) if self._max_ranks else None))
        self.engine.train()
        try:
            for _ in range(steps):
                if self._stop_at is not None and self.step >= self._stop_at:
                    break
                t0 = time.perf_counter()
                self._step_times.clear()
                trained_at = self.version
                with self._phase("wait_data"):  # a group whose lease lapsed meanwhile is another learner's: left out
                    groups, lease_lost = take_share(lambda n: with_retry(
                        lambda: client.get(n, self.version, wait_s=2.0), "get", patience), lease, share)
                with self._phase("collate"):
                    batch = self.collate(groups)
                m = self._update(batch, [len(g.samples) for g in groups])
                with self._phase("ack"):
                    skipped = with_retry(lambda: client.ack_consumed(batch.group_ids), "ack", patience)
                    lease.done()
                self.step += 1
                with self._lock:
                    self._trained_by_step[self.step] = {"group_ids": list(batch.group_ids), "skipped_ids": skipped}
                if self.step % cfg.train.push_every == 0:
                    self.version += 1  # these weights are version v + 1; the push thread sends them
                    self._start_push(self.version)
                push, self._push_metrics = self._push_metrics, {}
                with self._phase("metrics"):
                    stale = trained_at - batch.versions[batch.loss_mask > 0]
                    if correction_saturated(m):
                        log.warning("step %d: importance weights saturate the correction (%s); samples are too "
                                    "off-policy for is_cap=%s", self.step, m, cfg.train.objective.is_cap)
                    record = {
                        "step": self.step, "version": self.version, "rank": self.rank, "time": time.time(),
                        "optim/lr": cfg.train.lr,
                        "rollout/reward_mean": float(batch.rewards.mean().item()),
                        "rollout/samples": len(batch.rewards), "rollout/tokens": batch.num_tokens,
                        "rollout/observation_tokens": batch.observation_tokens, "buffer/lease_lost": lease_lost,
                        "staleness/mean": float(stale.float().mean().item()) if stale.numel() else 0.0,
                        "staleness/max": int(stale.max().item()) if stale.numel() else 0,
                        **m, **push,
                    }
                    agreement = self._agreement  # the training/inference agreement monitor of this step
                    if self.world_size > 1:  # with the agreement's sums: token-weighted over every rank
                        reduce_across_ranks(record, agreement)
                    record.update(agreement.metrics())
                if ckpt.due(self.step) or _ == steps - 1 or self.step == self._stop_at:  # due(): on every rank
                    with self._phase("checkpoint"):
                        record["checkpoint/step"] = self.step
                        record["checkpoint/save_s"] = self.save_checkpoint(str(staging_dir(cfg.run.dir, self.step)))
                    ckpt.saved()
                times = self._step_times
                record.update({f"time/{k}_s": v for k, v in times.items()})
                record.update({"time/data_wait_s": times["wait_data"], "time/train_s": sum(
                    times[k] for k in COMPUTE), "time/push_s": times["push_wait"] + times["push"],
                    "time/step_s": time.perf_counter() - t0})
                with self._lock:
                    self.metrics.append(record)
            self._await_push()  # the last version is out before train() returns
        finally:
            self.timeline.stop()
            lease.close()
            client.close()
            if self._pusher is not None:
                self._pusher.close()
        return {"step": self.step, "version": self.version}

    def timeline_dict(self) -> dict[str, Any]:
        return self.timeline.to_dict()

    def collate(self, groups: list[Any]) -> Any:
        """This rank's groups as one padded batch on its device, with their advantages (batch statistics over
        the whole step: every rank's groups)."""
        from async_rlhf.learner.batch import collate

        return self.placer.batch(collate(groups, self.pad_id, self.cfg.train.advantage, self._sum_ranks))

    def _update(self, batch: Any, group_sizes: list[int] | None = None) -> dict[str, float]:
        """``train.minibatches`` optimizer steps on one batch; returns metrics averaged over them (max of maxima).

        ``train.algorithm`` picks the update: policy gradient with group baselines (grpo) or GAE with the critic
        (ppo), ``pg_update.py``; or no policy gradient at all (online_dpo, its own loss), ``dpo_update.py``.
        """
        from async_rlhf.learner.agreement import Agreement

        # the agreement monitor (learner/agreement.py): right after a push the weights are exactly that version
        agreement = self._agreement = Agreement(self.version if self.step % self.cfg.train.push_every == 0 else None)
        agreement.observe_sampled(batch.behav_logp, batch.loss_mask)
        if self.cfg.train.algorithm == "online_dpo":
            sizes = group_sizes or [batch.input_ids.shape[0]]
            return online_dpo_update(self.engine, self.ref_model, self.cfg, batch, sizes, self._phase,
                                     self._optimizer_step, self._max_ranks, self._sum_ranks, agreement)
        return policy_gradient_update(self.engine, self.ref_model, self.ppo, self.cfg, batch, self.version,
                                      self.world_size, self._phase, self._optimizer_step, self._max_ranks,
                                      self._sum_ranks, agreement)

    def metrics_since(self, index: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.metrics[index:]

    def current_step(self) -> int:
        return self.step

    def current_state(self) -> str:
        """What this rank is doing now (its timeline state, e.g. wait_data or push_wait) and for how long."""
        totals = self.timeline.totals()
        state = self.timeline.state
        return f"{state or 'idle'} at step {self.step}" + (f" ({totals.get(state, 0.0):.0f} s in it overall)"
                                                          if state else "")

    def request_stop(self, at_step: int) -> None:
        """End train() after step ``at_step`` (the same on every rank: steps are collective), checkpointed."""
        self._stop_at = int(at_step)

    def trained_ids(self, first_step: int, last_step: int) -> dict[int, dict[str, list[str]]]:
        """Per step ``first_step..last_step``: the group ids this rank trained (``group_ids``) and those the
        buffer reported dropped as uninformative with that ack (``skipped_ids``); older steps are forgotten."""
        with self._lock:
            out = {s: ids for s, ids in self._trained_by_step.items() if first_step <= s <= last_step}
            for s in [s for s in self._trained_by_step if s < first_step]:
                del self._trained_by_step[s]
        return out
