"""Learner rank: one DeepSpeed engine (ZeRO 0-3), the training loop, and (rank 0) the weight push.

    per step s (version v = s // push_every); each line names what it waits for:
      wait_data         get batch_size/M groups from the buffer at version v (stale ones are dropped there)
      collate           pad and stack them
      forward_backward  forward -> policy_loss (+ KL to the reference) -> backward
      push_wait         rank 0: the push of v (started after the last step) must be out before ...
      optimizer         ... the optimizer writes the parameters it sends from
      ack               tell the buffer which groups were trained
      metrics           build the step's record
      every push_every steps: v += 1; rank 0 hands v to the push thread and goes on with step s + 1:
        push thread:    broadcast the weights to every generator (their receives are already posted),
                        one allreduce of acknowledgements, then tell the buffer v is held everywhere
                        (admission opens one more batch)
      nobody waits for a generator to swap v in: each does at its own step boundary (sync/gen_* metrics)

Under ZeRO-3 the parameters are gathered collectively on every rank, so that push stays on the training
thread (state ``push``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from async_rlhf.config import Config
from async_rlhf.timeline import Timeline

log = logging.getLogger(__name__)

COMPUTE = ("collate", "forward_backward", "optimizer")
"""Learner states that are computation on the batch (``learner_compute_fraction``)."""


@contextlib.contextmanager
def full_params(engine: Any, zero_stage: int):
    """Full (gathered under ZeRO-3) parameters of a DeepSpeed engine by Hugging Face name; collective on
    every rank."""
    import deepspeed

    module = engine.module
    ctx = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
           if zero_stage == 3 else contextlib.nullcontext())
    with ctx:
        yield dict(module.named_parameters())


def push_layout(params: dict[str, Any], bucket_cap: int, zero_stage: int) -> list:
    """The buckets of the weight push for these (full) parameters, at most ``bucket_cap`` bytes each.

    Under ZeRO-0 the parameters are also moved into one buffer in push order (``flatten_params``) so that
    every push sends straight from it, in every dtype: the optimizers DeepSpeed builds there (torch's for
    fp32, its unfused fp16/bf16 one, whose fp32 master copies are written back with ``p.data.copy_``) hold
    the Parameter objects, not their storage. ZeRO-1/2 keep parameters as slices of their own flat buffers,
    which the sender uses as they are; ZeRO-3 gathers fresh tensors for each push, sent as they lie when
    they are back to back in push order (DeepSpeed gathers into one buffer), else packed. The sender checks
    at every push where the tensors are, so a wrong guess here costs a copy, never wrong weights.
    """
    from async_rlhf.sync.layout import DTYPE_BYTES, TensorSpec, auto_bucket_bytes, plan_buckets
    from async_rlhf.sync.tensors import dtype_name, flatten_params

    specs = [TensorSpec(n, tuple(p.shape), dtype_name(p)) for n, p in params.items()]
    total = sum(s.numel * DTYPE_BYTES[s.dtype] for s in specs)
    buckets = plan_buckets(specs, auto_bucket_bytes(total, lo=min(4 << 20, bucket_cap), hi=bucket_cap))
    if zero_stage == 0:
        flatten_params(params, buckets)
    return buckets


class LearnerActor:
    def __init__(self, rank: int, world_size: int, cfg: Config, model_path: str, master_addr: str,
                 master_port: int, buffer_address: str) -> None:
        import deepspeed
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(cfg.learner.threads)
        torch.manual_seed(cfg.train.seed + rank)
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        deepspeed.init_distributed(dist_backend=cfg.learner.backend, auto_mpi_discovery=False)
        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        self.model_path = model_path
        self.buffer_address = buffer_address
        dtype = getattr(torch, cfg.model.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        model.config.use_cache = False
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        algorithm = cfg.train.algorithm
        self.ref_model = None  # the frozen initial policy: KL in the loss or the PPO reward, DPO's reference
        if (cfg.train.objective.kl_coef > 0 or algorithm == "online_dpo"
                or (algorithm == "ppo" and cfg.train.ppo.kl_coef > 0)):
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
            self.ref_model.requires_grad_(False)
        self.ppo: Any = None  # critic engine + reward models, beside the actor on this rank
        if algorithm == "ppo":
            from async_rlhf.learner.ppo import PPOTrainer

            self.ppo = PPOTrainer(cfg, model_path, ds_config)
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

    def ready(self) -> int:
        return self.rank

    # -- weight push (rank 0) ----------------------------------------------------------------
    def weight_layout(self) -> list[dict[str, Any]]:
        from async_rlhf.sync.layout import layout_to_wire

        with self._full_params() as params:
            self._buckets = push_layout(params, self.cfg.sync.bucket_mb << 20, self.cfg.learner.zero_stage)
        return layout_to_wire(self._buckets)

    def init_weight_sync(self, host: str, port: int, member_ids: list[str]) -> None:
        """Rank 0 hosts the push group's TCPStore and forms the first epoch with every generator."""
        from async_rlhf.learner.push import WeightPusher

        self._pusher = WeightPusher(self.cfg, self._buckets, host, port, self.buffer_address)
        self._pusher.sender.form(list(member_ids))

    def drop_generators(self, member_ids: list[str]) -> None:
        """The driver saw these generators' processes die: a push in flight aborts at once instead of waiting
        ``sync.timeout_s`` for them, and the next push leaves them out (any thread)."""
        if self._pusher is not None:
            self._pusher.members_died(member_ids)

    def _full_params(self):
        return full_params(self.engine, self.cfg.learner.zero_stage)

    def _start_push(self, version: int) -> None:
        """Hand ``version`` to the push thread (rank 0) and return at once; under ZeRO-3 gather and push
        here (every rank takes part in the gather). Metrics of finished pushes go to ``_push_metrics``."""
        self._push_metrics.update(self._await_push())
        if self.cfg.learner.zero_stage == 3:
            with self._phase("push"), self._full_params() as params:
                if self.rank == 0:
                    self._push_metrics.update(self._pusher.push(params, version))
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
        from async_rlhf.checkpoint import staging_dir
        from async_rlhf.learner.batch import collate
        from async_rlhf.learner.objectives import correction_saturated

        cfg = self.cfg
        client = make_client(cfg, self.buffer_address, consumer=f"learner-{self.rank}")
        patience = cfg.buffer.redis_retry_s + cfg.buffer.request_timeout_s
        share = cfg.train.batch_size // self.world_size
        self.engine.train()
        try:
            for _ in range(steps):
                if self._stop_at is not None and self.step >= self._stop_at:
                    break
                t0 = time.perf_counter()
                self._step_times.clear()
                trained_at = self.version
                groups = []
                with self._phase("wait_data"):
                    while len(groups) < share:
                        want = share - len(groups)
                        groups += with_retry(lambda: client.get(want, self.version, wait_s=2.0), "get", patience)
                with self._phase("collate"):
                    batch = collate(groups, self.pad_id, cfg.train.advantage)
                m = self._update(batch, [len(g.samples) for g in groups])
                with self._phase("ack"):
                    skipped = with_retry(lambda: client.ack_consumed(batch.group_ids), "ack", patience)
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
                        "rollout/observation_tokens": batch.observation_tokens,
                        "staleness/mean": float(stale.float().mean().item()) if stale.numel() else 0.0,
                        "staleness/max": int(stale.max().item()) if stale.numel() else 0,
                        **m, **push,
                    }
                every = cfg.run.checkpoint_every
                if (every and self.step % every == 0) or _ == steps - 1 or self.step == self._stop_at:
                    with self._phase("checkpoint"):
                        record["checkpoint/step"] = self.step
                        record["checkpoint/save_s"] = self.save_checkpoint(str(staging_dir(cfg.run.dir, self.step)))
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
            client.close()
            if self._pusher is not None:
                self._pusher.close()
        return {"step": self.step, "version": self.version}

    def timeline_dict(self) -> dict[str, Any]:
        return self.timeline.to_dict()

    def _update(self, batch: Any, group_sizes: list[int] | None = None) -> dict[str, float]:
        """``train.minibatches`` optimizer steps on one batch; returns metrics averaged over them (max of maxima).

        ``train.algorithm`` picks the advantages: group baselines (grpo), GAE with the critic (ppo, which
        also trains the critic once per minibatch), or no policy gradient at all (online_dpo, its own loss).

        The proximal policy is the weights at the start of the step: exactly the current weights (detached)
        with one minibatch, a no-grad forward with several, or interpolated by version for
        ``decoupled_ppo_interp``.
        """
        import torch

        from async_rlhf.learner.batch import token_logprobs
        from async_rlhf.learner.objectives import entropy_from_logits, kl_penalty, masked_mean, policy_loss

        obj = self.cfg.train.objective
        if self.cfg.train.algorithm == "online_dpo":
            return self._dpo_update(batch, group_sizes or [batch.input_ids.shape[0]])
        k = min(self.cfg.train.minibatches, batch.input_ids.shape[0])

        def forward(model: Any, idx: Any) -> tuple[Any, Any]:
            logits = model(input_ids=batch.input_ids[idx], attention_mask=batch.attention_mask[idx]).logits
            return logits, token_logprobs(logits, batch.input_ids[idx])

        prox_all = None
        if k > 1 and obj.kind not in ("ppo", "decoupled_ppo_interp"):
            with self._phase("forward_backward"), torch.no_grad():
                prox_all = forward(self.engine, slice(None))[1]
        adv = batch.advantages.unsqueeze(1).expand_as(batch.behav_logp)
        targets = None
        if self.ppo is not None:
            ref = self.ref_model
            with self._phase("forward_backward"):
                targets = self.ppo.prepare(batch, (lambda: forward(ref, slice(None))[1]) if ref is not None else None)
            adv = targets.advantages
        per_step: list[dict[str, float]] = []
        for j, idx in enumerate(torch.arange(batch.input_ids.shape[0]).chunk(k)):
            with self._phase("forward_backward"):
                logits, logp = forward(self.engine, idx)
                mask = batch.loss_mask[idx]
                prox = prox_all[idx] if prox_all is not None else (logp.detach() if k == 1 else None)
                loss, m = policy_loss(logp, prox, batch.behav_logp[idx], adv[idx], mask, obj,
                                      token_versions=batch.versions[idx], current_version=self.version + j / k,
                                      prox_version=self.version)
                if self.ref_model is not None and obj.kl_coef > 0:
                    with torch.no_grad():
                        ref_logp = forward(self.ref_model, idx)[1]
                    kl = masked_mean(kl_penalty(logp, ref_logp, mask, obj.kl_estimator), mask)
                    loss = loss + obj.kl_coef * kl
                    m["ppo/kl_ref"] = float(kl.item())
                self.engine.backward(loss)
            self._optimizer_step()
            with self._phase("forward_backward"):
                if targets is not None:
                    m.update(self.ppo.train_critic(batch, idx, targets))
            with self._phase("metrics"), torch.no_grad():
                m["ppo/entropy"] = float(entropy_from_logits(logits[:, :-1], mask).item())
                m["optim/loss"] = float(loss.item())
            per_step.append(m)
        merged: dict[str, float] = {}
        for key in per_step[0]:
            values = [m[key] for m in per_step]
            merged[key] = max(values) if key.endswith("/max") else sum(values) / len(values)
        if targets is not None:
            merged.update(targets.metrics)
        return merged

    def _dpo_update(self, batch: Any, group_sizes: list[int]) -> dict[str, float]:
        """Online DPO: best against worst completion of every prompt group, ``train.minibatches`` steps.

        Only the rows that are in a pair are forwarded; a batch without any pair (every group a tie) still
        takes one zero-gradient step, so data-parallel ranks stay in lockstep.
        """
        import torch

        from async_rlhf.learner.batch import token_logprobs
        from async_rlhf.learner.online_dpo import online_dpo_loss, select_pairs

        dpo = self.cfg.train.dpo
        pairs = select_pairs(batch.rewards, group_sizes)
        k = max(1, min(self.cfg.train.minibatches, len(pairs)))
        chunks = [pairs[j::k] for j in range(k)]
        per_step: list[dict[str, float]] = []
        for chunk in chunks:
            rows = sorted({i for pair in chunk for i in pair}) or [0]
            local = {row: j for j, row in enumerate(rows)}
            ids, attn = batch.input_ids[rows], batch.attention_mask[rows]
            with self._phase("forward_backward"):
                with torch.no_grad():
                    ref_logp = token_logprobs(self.ref_model(input_ids=ids, attention_mask=attn).logits, ids)
                logp = token_logprobs(self.engine(input_ids=ids, attention_mask=attn).logits, ids)
                loss, m = online_dpo_loss(logp, ref_logp, batch.loss_mask[rows],
                                          [(local[c], local[r]) for c, r in chunk], dpo.beta, dpo.label_smoothing)
                self.engine.backward(loss)
            self._optimizer_step()
            m["optim/loss"] = float(loss.item())
            if chunk:  # the margin on the same pairs after the step: the step's own progress (a no-grad forward)
                with torch.no_grad():
                    after = token_logprobs(self.engine(input_ids=ids, attention_mask=attn).logits, ids)
                    _, m_after = online_dpo_loss(after, ref_logp, batch.loss_mask[rows],
                                                 [(local[c], local[r]) for c, r in chunk], dpo.beta)
                m["dpo/margin_after_step"] = m_after["dpo/reward_margin"]
            per_step.append(m)
        merged = {key: sum(m.get(key, 0.0) for m in per_step) / len(per_step) for key in per_step[0]}
        merged["dpo/pairs"] = float(len(pairs))
        merged["dpo/groups_with_pair"] = len(pairs) / max(1, len(group_sizes))
        return merged

    def metrics_since(self, index: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.metrics[index:]

    # -- checkpoints (the driver commits them: manifest, rename, prune; see async_rlhf/checkpoint.py) ----
    def save_checkpoint(self, out_dir: str) -> float:
        """Model, optimizer, step and version (DeepSpeed, collective on every rank) and, from rank 0, the
        policy as a Hugging Face directory, all under ``out_dir``; returns the seconds it took."""
        t0 = time.perf_counter()
        out = Path(out_dir)
        self.engine.save_checkpoint(str(out / "deepspeed"), tag="state",
                                    client_state={"step": self.step, "version": self.version})
        self.save_hf(str(out / "policy"))
        return time.perf_counter() - t0

    def load_checkpoint(self, ckpt_dir: str) -> dict[str, int]:
        """Restore model, optimizer, step and version from a committed checkpoint before train()."""
        _, client = self.engine.load_checkpoint(str(Path(ckpt_dir) / "deepspeed"), tag="state")
        if client is None:
            raise RuntimeError(f"{ckpt_dir}: DeepSpeed found no state to load")
        self.step, self.version = int(client["step"]), int(client["version"])
        return {"step": self.step, "version": self.version}

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

    def save_hf(self, out_dir: str) -> str:
        """Write the policy as a Hugging Face model directory (tokenizer files copied from the input)."""
        out = Path(out_dir)
        with self._full_params():
            if self.rank == 0:
                tmp = out.with_name(out.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                self.engine.module.save_pretrained(tmp)
                for f in Path(self.model_path).iterdir():
                    if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                        shutil.copy(f, tmp / f.name)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
        return str(out)
