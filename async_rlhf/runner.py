"""One training run: place the roles on Ray, wire their addresses, train, report.

    driver (this process)
      |-- BufferActor        ZeroMQ ROUTER on loopback, memory store, staleness rule, ledger
      |-- GeneratorActor x N vLLM engine + loop            --put--> buffer
      |-- LearnerActor   x M DeepSpeed engine              <--get-- buffer
      |        rank 0 ==broadcast (own TCPStore, gloo/nccl)==> every generator's vLLM worker
      '-- progress: polls learners, generators and buffer; writes metrics.jsonl, TensorBoard, plots
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from async_rlhf.config import Config

log = logging.getLogger(__name__)


def resolve_model(cfg: Config, cache_root: Path) -> str:
    """The policy to start from: ``model.path``, or the tiny model with its SFT warm start (cached)."""
    if cfg.model.path:
        return str(Path(cfg.model.path).resolve())
    from async_rlhf.tiny.sft import prepare_tiny_policy

    task = cfg.task
    if task.name not in ("addition", "longtail"):  # guess_number, reward_model, custom: the addition warm start
        task = dataclasses.replace(task, name="addition")
    return str(prepare_tiny_policy(cache_root, task, seed=cfg.train.seed))


def heldout_accuracy(model_dir: str, cfg: Config) -> float:
    """Greedy held-out accuracy of a Hugging Face model directory, with transformers (independent of vLLM)."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_rlhf.env.registry import make_task
    from async_rlhf.tiny.sft import greedy_accuracy
    from async_rlhf.tiny.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    task = make_task(cfg.task)
    return greedy_accuracy(model, load_tokenizer(model_dir), task.heldout(), cfg.generator.max_new_tokens)


def _generator_env(cfg: Config) -> dict[str, str]:
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.generator.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(cfg.generator.threads),
        "VLLM_LOGGING_LEVEL": "ERROR",
        "TOKENIZERS_PARALLELISM": "false",
    }


def pin_roles(cfg: Config, buffer: Any, generators: list[Any], learners: list[Any]) -> Any:
    """Pin every actor's process to its cores of the CPU plan (``async_rlhf.cpus``); returns the plan."""
    import ray

    from async_rlhf.cpus import pin_actor, plan_for_config

    plan = plan_for_config(cfg)
    actors = {"buffer": buffer, **{f"generator {i}": g for i, g in enumerate(generators)},
              **{f"learner {r}": lr for r, lr in enumerate(learners)}}
    ray.get([a.__ray_call__.remote(pin_actor, list(plan.placements[name].cores), None, plan.placements[name].nice)
             for name, a in actors.items()])
    for warning in plan.warnings:
        log.warning("CPU plan: %s", warning)
    return plan


class Cluster:
    """Handles to the started roles (the integration tests inspect them after a run)."""

    def __init__(self, cfg: Config, model_path: str, address: str | None = None) -> None:
        import ray

        from async_rlhf.buffer.actor import BufferActor
        from async_rlhf.generator.actor import GeneratorActor
        from async_rlhf.learner.actor import LearnerActor
        from async_rlhf.sync.group import free_port

        self.cfg = cfg
        self.model_path = model_path
        from async_rlhf.placement import plan_placement

        self.plan = plan_placement(cfg)
        res = cfg.resources
        if not ray.is_initialized():
            # locally, room for the plan plus a few generators added by `scale` (roles share the cores)
            local_cpus = cfg.run.num_cpus or max(os.cpu_count() or 1, int(self.plan.totals()["CPU"] + 0.999)
                                                 + 4 * int(res.generator_cpus + 0.999))
            ray.init(address=address, include_dashboard=False, log_to_driver=True,
                     num_cpus=None if address else local_cpus,
                     runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        self.groups = self._placement_groups()
        self.buffer = ray.remote(BufferActor).options(
            num_cpus=res.buffer_cpus, scheduling_strategy=self._in_group("buffer", 0)).remote(cfg)
        self.buffer_address = ray.get(self.buffer.address.remote())
        self._gen_cls = ray.remote(GeneratorActor)
        self._gen_opts = {"num_cpus": res.generator_cpus, "num_gpus": res.generator_gpus, "max_concurrency": 4,
                          "max_restarts": cfg.run.generator_max_restarts,
                          "runtime_env": {"env_vars": _generator_env(cfg)}}
        self.generators = [self._gen_cls.options(**self._gen_opts, scheduling_strategy=self._in_group(
            "generators", i)).remote(i, cfg, model_path, self.buffer_address) for i in range(cfg.generators)]
        self.added: list[Any] = []
        master_port = free_port()
        learner_cls = ray.remote(LearnerActor)
        learner_opts = {"num_cpus": res.learner_cpus, "num_gpus": res.learner_gpus, "max_concurrency": 3,
                        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(cfg.learner.threads)}}}
        self.learners = [learner_cls.options(**learner_opts, scheduling_strategy=self._in_group("learners", r)).remote(
            r, cfg.learners, cfg, model_path, "127.0.0.1", master_port, self.buffer_address)
            for r in range(cfg.learners)]
        ray.get([g.ready.remote() for g in self.generators] + [lr.ready.remote() for lr in self.learners])
        self.cpu_plan = pin_roles(cfg, self.buffer, self.generators, self.learners)
        # the push group: learner rank 0 and every generator, on a TCPStore of its own
        layout = ray.get([lr.weight_layout.remote() for lr in self.learners])[0]
        port = free_port()
        self.layout, self.push_port = layout, port
        ids = [f"gen{i}" for i in range(cfg.generators)]
        ray.get([self.learners[0].init_weight_sync.remote("127.0.0.1", port, ids)]
                + [g.init_weight_sync.remote("127.0.0.1", port, mid, layout) for mid, g in zip(ids, self.generators)])

    def _placement_groups(self) -> dict[str, Any]:
        """One placement group per role, pack or spread (resources.placement); waits until placed."""
        import ray
        from ray.util.placement_group import placement_group

        groups = {r.role: placement_group(r.ray_bundles(), strategy=r.strategy.upper(), name="")
                  for r in self.plan.roles}
        ray.get([pg.ready() for pg in groups.values()], timeout=120)
        return groups

    def _in_group(self, role: str, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.groups[role],
                                                placement_group_bundle_index=index)

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

        ray.get(handle.init_weight_sync.remote("127.0.0.1", self.push_port, member_id, self.layout, late=True))

    def generator_died(self, member_id: str) -> None:
        """Tell the pushing learner that this member is gone, so no push waits for it (fire and forget)."""
        self.learners[0].drop_generators.remote([member_id])

    def close(self) -> None:
        """Kill this run's actors but keep Ray up (experiments run several clusters in one Ray session)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in [*self.generators, *self.added, *self.learners, self.buffer]:
            ray.kill(actor)
        for pg in self.groups.values():
            remove_placement_group(pg)

    def shutdown(self) -> None:
        import ray

        self.close()
        ray.shutdown()


class LearnerFailure(RuntimeError):
    """A learner rank died or raised: the job stops (the driver names the checkpoint to resume from)."""

    def __init__(self, failed: dict[int, str]) -> None:
        self.ranks = sorted(failed)
        super().__init__("; ".join(f"learner rank {r} failed ({why})" for r, why in sorted(failed.items())))


def failed_learners(train_refs: list[Any], wait_s: float = 10.0) -> dict[int, str]:
    """Ranks whose ``train()`` ended in an error (a killed process included), with the error's first line.

    Waits up to ``wait_s`` for Ray to notice a death (the call that failed first may be another method)."""
    import ray

    deadline = time.monotonic() + wait_s
    failed: dict[int, str] = {}
    while not failed:
        # timeout=0: the ranks that survive block in a collective with the dead one, so waiting for all of
        # them would always take the whole wait_s
        done, _ = ray.wait(train_refs, num_returns=len(train_refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                failed[train_refs.index(ref)] = f"{type(exc).__name__}: {first}"
        if time.monotonic() >= deadline or len(done) == len(train_refs):
            break
        time.sleep(0.2)
    return failed


def check_buffer_alive(cluster: Cluster) -> None:
    """Stop the run with :class:`RunFailure` if the buffer actor is gone (it is not restarted: a memory store's
    groups died with it; a Redis store keeps them for ``--resume``)."""
    import ray

    from async_rlhf.control import RunFailure

    try:
        ray.get(cluster.buffer.address.remote(), timeout=10.0)
    except ray.exceptions.GetTimeoutError:
        return  # busy, not dead
    except ray.exceptions.RayActorError as exc:
        kept = ("the Redis store keeps its groups for --resume" if cluster.cfg.buffer.store == "redis"
                else "the groups it held in memory are lost")
        raise RunFailure(f"the buffer actor died ({type(exc).__name__}); {kept}") from exc


def stop_stalled(cluster: Cluster, gen_stats: list[dict[str, Any]], buf: dict[str, Any], stalled_s: float) -> None:
    """Print what every role is doing and raise :class:`RunFailure` with the likely cause."""
    import ray

    from async_rlhf.control import RunFailure
    from async_rlhf.stall import diagnose_stall, role_lines

    refs = [lr.current_state.remote() for lr in cluster.learners]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
    states = [ray.get(r) if r in ready else "not answering" for r in refs]
    for line in role_lines(gen_stats, buf, states):
        print(f"stalled: {line}", flush=True)
    raise RunFailure(diagnose_stall(gen_stats, buf, states, stalled_s))


def _progress_line(rec: dict[str, Any], steps: int, acc: str, tok_s: float, depth: int, elapsed: float) -> str:
    return (f"step {rec['step']:>4}/{steps} | v{rec['version']:<4} | reward {rec['rollout/reward_mean']:.3f} | "
            f"held-out acc {acc} | gen {tok_s:7.0f} tok/s | staleness {rec['staleness/mean']:.2f} | "
            f"buffer {depth:>3} | {elapsed:5.0f}s")


def train(cfg: Config, cluster: Cluster, run_dir: Path, resume: Path | None = None,
          on_fleet: Any = None) -> dict[str, Any]:
    """Run the learners for ``train.steps`` while the generators stream rollouts; returns run figures.

    ``resume``: a committed checkpoint to continue from (model, optimizer, version, data position);
    ``on_fleet``: called with the :class:`async_rlhf.control.Fleet` once it runs (tests scale through it).
    """
    import ray

    from async_rlhf.buffer.build import make_client
    from async_rlhf.buffer.client import BufferUnavailable
    from async_rlhf.control import ControlServer, Fleet
    from async_rlhf.metrics import MetricsWriter
    from async_rlhf.progress import TrainProgress

    progress = TrainProgress.start(cfg, cluster, run_dir, resume)
    writer = MetricsWriter(run_dir)
    buffer = make_client(cfg, cluster.buffer_address, consumer="launcher")
    t_start = time.time()
    fleet = Fleet(cluster, progress.ledger, buffer, progress.version, rolled_back=progress.rolled_back)
    fleet.start()
    control = ControlServer(fleet, run_dir) if cfg.run.control else None
    if on_fleet is not None:
        on_fleet(fleet)
    train_refs = [lr.train.remote(cfg.train.steps - progress.step) for lr in cluster.learners]
    records: list[dict[str, Any]] = []
    seen_evals = 0
    last_print = 0.0
    last_tok, last_t = 0.0, time.time()
    tok_s = 0.0
    acc = "  -  "
    evals: list[dict[str, float]] = []
    stopping = False
    try:
        pending = list(train_refs)
        last_progress = last_buffer_check = time.time()
        while pending:
            done, pending = ray.wait(pending, timeout=0.5)
            ray.get(done)  # surfaces a learner failure at once
            fleet.poll()
            if fleet.stop_requested.is_set() and not stopping:
                stopping = True  # ranks are within a step of each other: stop them all a few steps ahead
                at = max(ray.get([lr.current_step.remote() for lr in cluster.learners])) + 3
                ray.get([lr.request_stop.remote(at) for lr in cluster.learners])
            gen_stats = progress.generator_stats(fleet)
            if records:
                fleet.heal(records[-1]["version"])
            new = ray.get(cluster.learners[0].metrics_since.remote(len(records)))
            if time.time() - last_buffer_check > 2.0:
                check_buffer_alive(cluster)
                last_buffer_check = time.time()
            try:
                buf = buffer.stats()
            except BufferUnavailable:
                check_buffer_alive(cluster)  # a dead buffer actor: one clear error, not the timeout
                raise
            tokens = sum(s["tokens"] for s in gen_stats)
            now = time.time()
            if now - last_t >= 1.0:
                tok_s, last_tok, last_t = (tokens - last_tok) / (now - last_t), tokens, now
            evals = gen_stats[0]["evals"] if gen_stats else evals
            for ev in evals[seen_evals:]:
                writer.write({"kind": "eval", "version": ev["version"], "eval/heldout_accuracy": ev["accuracy"]},
                             int(ev["version"]))
                acc = f"{ev['accuracy']:.3f}@v{int(ev['version'])}"
            seen_evals = len(evals)
            for rec in new:
                # buffer counters (depth, drops and rejects by reason, ...) and the staleness histogram
                rec.update({k: v for k, v in buf.items() if k.startswith("buffer/") and isinstance(v, (int, float))})
                rec.update({"rollout/gen_tokens_per_s": tok_s, "staleness/hist": buf.get("staleness/hist", {})})
                rec.update(fleet.metrics())
                if gen_stats:  # how long generators stand still per weight update (the slowest one)
                    rec.update({f"sync/gen_{k}": max(float(s.get(f"sync/{k}", 0.0)) for s in gen_stats)
                                for k in ("pause_s_last", "pause_s_mean")})
                    rec["sync/gen_coalesced"] = sum(float(s.get("sync/coalesced", 0.0)) for s in gen_stats)
                    rec["sync/gen_updates"] = sum(float(s.get("updates", 0.0)) for s in gen_stats)
                progress.before_write(rec)
                writer.write(rec, rec["step"])
                progress.after_write(rec)
            records += new
            if new:
                last_progress = now
            elif cfg.run.stall_timeout_s and now - last_progress > cfg.run.stall_timeout_s:
                stop_stalled(cluster, gen_stats, buf, now - last_progress)
            if records and now - last_print >= cfg.run.log_every_s:
                last_print = now
                print(_progress_line(records[-1], cfg.train.steps, acc, tok_s, buf["buffer/depth"], now - t_start),
                      flush=True)
        wall = time.time() - t_start
    except ray.exceptions.RayError as exc:
        # any call to a dead learner fails (its train() ref, metrics, trained ids): name the rank, stop the job;
        # only checkpoints whose every rank finished saving were committed, the newest is the one to resume
        failed = failed_learners(train_refs)
        if not failed:
            raise
        print(progress.failure_hint(), flush=True)
        raise LearnerFailure(failed) from exc
    finally:
        if control is not None:
            control.close()
        gen_final = fleet.stop_all()
        buffer.close()
        writer.close()
        progress.close()
    timelines = ray.get([g.timeline_dict.remote() for g in fleet.handles.values()]
                        + [lr.timeline_dict.remote() for lr in cluster.learners])
    leftover = ray.get(cluster.buffer.drop_held.remote("unconsumed_at_shutdown"))
    if leftover:
        print(f"{leftover} finished prompt group(s) were still in the buffer at the end: counted as dropped "
              "(unconsumed_at_shutdown)", flush=True)
    tokens = sum(s["tokens"] for s in gen_final)
    push_times = [r["sync/push_s"] for r in records if "sync/push_s" in r]
    return {
        "records": records,
        "evals": gen_final[0]["evals"] if gen_final else evals,
        "wall_time_s": wall,
        "t_start": t_start,
        "generated_tokens_per_s": tokens / wall,
        "learner_samples_per_s": sum(r["rollout/samples"] for r in records) / wall,
        "weight_push_s": sum(push_times) / len(push_times) if push_times else 0.0,
        "generator_stats": gen_final,
        "timelines": timelines,
        "fleet": {"events": fleet.events, **fleet.status()},
        "prompt_ledger": progress.ledger,
        "first_step": progress.step,
    }


def write_timeline(figures: dict[str, Any], run_dir: Path) -> dict[str, float]:
    """timeline.json and timeline.png in the run directory; returns busy fractions per role kind."""
    from async_rlhf.plots import plot_timeline, role_busy_fraction

    timelines = figures["timelines"]
    (run_dir / "timeline.json").write_text(json.dumps(timelines))
    plot_timeline(timelines, figures["t_start"], run_dir / "timeline.png")
    fractions: dict[str, list[float]] = {}
    for tl in timelines:
        fractions.setdefault(str(tl["role"]).split()[0], []).append(role_busy_fraction(tl))
    return {**{f"{kind}_busy_fraction": sum(v) / len(v) for kind, v in fractions.items()},
            **learner_fractions([tl for tl in timelines if str(tl["role"]).startswith("learner")])}


def learner_fractions(learners: list[dict[str, Any]]) -> dict[str, float]:
    """Mean over learner ranks of the share of wall time spent computing on batches
    (``learner_compute_fraction``) and waiting for a weight push beyond its own transfer, i.e. for the push
    thread to finish before the optimizer step (``learner_push_wait_fraction``)."""
    from async_rlhf.learner.actor import COMPUTE
    from async_rlhf.timeline import busy_fraction

    if not learners:
        return {}
    n = len(learners)
    return {"learner_compute_fraction": sum(busy_fraction(tl["totals"], COMPUTE) for tl in learners) / n,
            "learner_push_wait_fraction": sum(busy_fraction(tl["totals"], ("push_wait",)) for tl in learners) / n}


def run(cfg: Config, address: str | None = None, cache_root: Path = Path("runs/cache"),
        resume: Path | None = None) -> dict[str, Any]:
    """Everything ``launch/cluster.py`` does after validation; returns the summary it writes.

    ``resume``: a committed checkpoint (``async_rlhf.checkpoint.resolve_resume``) to continue from.
    """
    run_dir = Path(cfg.run.dir).resolve()
    cfg.run.dir = str(run_dir)  # the learners write checkpoints here from their own working directories
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    t0 = time.time()
    if resume is not None:
        # a copy: pruning deletes old checkpoints, and restarted actors (and save_hf's tokenizer files) still
        # read the directory they started from
        import shutil

        model_path = str(run_dir / "resumed_policy")
        shutil.rmtree(model_path, ignore_errors=True)
        shutil.copytree(resume / "policy", model_path)
    else:
        model_path = resolve_model(cfg, cache_root)
    start_acc = heldout_accuracy(model_path, cfg)
    print(f"policy {model_path}: held-out greedy accuracy {start_acc:.3f} before RL", flush=True)
    cluster = Cluster(cfg, model_path, address)
    try:
        (run_dir / "cpu_plan.json").write_text(json.dumps(cluster.cpu_plan.to_dict(), indent=2))
        print(f"started {cfg.generators} generator(s), {cfg.learners} learner(s), buffer at "
              f"{cluster.buffer_address} in {time.time() - t0:.0f}s", flush=True)
        figures = train(cfg, cluster, run_dir, resume=resume)
        import ray

        policy_dir = ray.get(cluster.learners[0].save_hf.remote(str((run_dir / "policy").resolve())))
    finally:
        cluster.shutdown()
    end_acc = heldout_accuracy(policy_dir, cfg)
    from async_rlhf.plots import plot_learning_curve

    plot_learning_curve(figures["records"], figures["evals"], run_dir / "learning_curve.png", start_acc, end_acc)
    busy = write_timeline(figures, run_dir)
    summary = {
        "accuracy_start": start_acc,
        "accuracy_end": end_acc,
        "wall_time_s": time.time() - t0,
        "train_wall_time_s": figures["wall_time_s"],
        "generated_tokens_per_s": figures["generated_tokens_per_s"],
        "learner_samples_per_s": figures["learner_samples_per_s"],
        "weight_push_s": figures["weight_push_s"],
        **busy,
        "steps": cfg.train.steps,
        "final_version": figures["records"][-1]["version"] if figures["records"] else 0,
        "policy_dir": policy_dir,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out greedy accuracy {start_acc:.3f} -> {end_acc:.3f} in {summary['wall_time_s']:.0f}s "
          f"({summary['generated_tokens_per_s']:.0f} generated tok/s, {summary['learner_samples_per_s']:.1f} "
          f"samples/s trained, {summary['weight_push_s'] * 1000:.0f} ms per weight push); "
          f"run written to {run_dir}", flush=True)
    return summary
