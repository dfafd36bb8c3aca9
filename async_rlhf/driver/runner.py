"""One training run: start the cluster (:mod:`async_rlhf.driver.cluster`), train while polling every role, and
finish: checkpoints, metrics.jsonl, TensorBoard, plots, the policy and summary.json."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from async_rlhf.agent.environment import agent_summary
from async_rlhf.config import Config, parse_report_to
from async_rlhf.driver.agreement import agreement_summary, mismatch_failure, mismatch_note
from async_rlhf.driver.beside import Beside, TaskResult, final_figure
from async_rlhf.driver.cluster import Cluster
from async_rlhf.driver.provision import start_early_fork_servers
from async_rlhf.driver.role_env import forks_roles
from async_rlhf.driver.timeline_figures import write_timeline
from async_rlhf.policy_source import heldout_accuracy, resolve_model


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


def stop_stalled(cluster: Cluster, gen_stats: list[dict[str, Any]], buf: dict[str, Any], stalled_s: float) -> None:
    """Print what every role is doing and raise :class:`RunFailure` with the likely cause."""
    import ray

    from async_rlhf.driver.fleet import RunFailure
    from async_rlhf.driver.stall import diagnose_stall, role_lines

    refs = [lr.current_state.remote() for lr in cluster.learners]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
    states = [ray.get(r) if r in ready else "not answering" for r in refs]
    for line in role_lines(gen_stats, buf, states):
        print(f"stalled: {line}", flush=True)
    raise RunFailure(diagnose_stall(gen_stats, buf, states, stalled_s))


def _progress_line(rec: dict[str, Any], steps: int, acc: str, tok_s: float, depth: int, elapsed: float) -> str:
    return (f"step {rec['step']:>4}/{steps} | v{rec['version']:<4} | reward {rec['rollout/reward_mean']:.3f} | "
            f"{acc} | gen {tok_s:7.0f} tok/s | staleness {rec['staleness/mean']:.2f} | "
            f"buffer {depth:>3} | {elapsed:5.0f}s{mismatch_note(rec)}")


def train(cfg: Config, cluster: Cluster, run_dir: Path, resume: Path | None = None,
          on_fleet: Any = None, stop: threading.Event | None = None) -> dict[str, Any]:
    """Run the learners for ``train.steps`` while the generators stream rollouts; returns run figures.

    ``resume``: a committed checkpoint to continue from (model, optimizer, version, data position);
    ``on_fleet``: called with the :class:`async_rlhf.driver.fleet.Fleet` once it runs (tests scale through it);
    ``stop``: set (by a signal handler) to end the run early like a stop request, also ``train.max_time_s``.
    """
    import ray

    from async_rlhf.buffer.build import make_client
    from async_rlhf.driver.buffer_watch import BufferWatch
    from async_rlhf.driver.control import ControlServer
    from async_rlhf.driver.fleet import Fleet
    from async_rlhf.driver.metrics import MetricsWriter
    from async_rlhf.driver.progress import TrainProgress
    from async_rlhf.driver.progress_rates import TokenRate, fresh_evals
    from async_rlhf.driver.stopping import stop_reason
    from async_rlhf.evaluation import eval_label, eval_record, heldout_label
    from async_rlhf.generator.prompt_fit import context_len, rollout_figures, too_long_warning

    run_dir.mkdir(parents=True, exist_ok=True)  # a bench's run in a fresh directory
    progress = TrainProgress.start(cfg, cluster, run_dir, resume)
    # metrics.jsonl, and run.report_to's trackers (given config.json's content: no secrets)
    writer = MetricsWriter(run_dir, parse_report_to(cfg.run.report_to), json.loads(cfg.to_json()))
    buffer = make_client(cfg, cluster.buffer_address, consumer="launcher")
    watch = BufferWatch(cluster, buffer)
    t_start = time.time()
    fleet = Fleet(cluster, progress.ledger, buffer, progress.version, rolled_back=progress.rolled_back)
    fleet.start()
    control = ControlServer(fleet, run_dir) if cfg.run.control else None
    if on_fleet is not None:
        on_fleet(fleet)
    train_refs = [lr.train.remote(cfg.train.steps - progress.step) for lr in cluster.learners]
    records: list[dict[str, Any]] = []
    written_versions: set[int] = set()
    last_print = 0.0
    rate = TokenRate()
    tok_s = 0.0
    acc = heldout_label(cfg)
    evals: list[dict[str, float]] = []  # every held-out evaluation written, in version order
    stopping = False
    warned_too_long = False
    why: str | None = None
    try:
        pending = list(train_refs)
        last_progress = last_buffer_check = time.time()
        while pending:
            done, pending = ray.wait(pending, timeout=0.5)
            ray.get(done)  # surfaces a learner failure at once
            fleet.poll()
            if not stopping and why is None:
                why = stop_reason(cfg, time.time() - t_start, stop is not None and stop.is_set(),
                                  fleet.stop_requested.is_set())
                if why is not None:
                    fleet.request_stop()
                    print(f"stopping on {why}: the learners finish their step and write a checkpoint", flush=True)
            if fleet.stop_requested.is_set() and not stopping:
                stopping = True  # ranks are within a step of each other: stop them all a few steps ahead
                at = max(ray.get([lr.current_step.remote() for lr in cluster.learners])) + 3
                ray.get([lr.request_stop.remote(at) for lr in cluster.learners])
            gen_stats = progress.generator_stats(fleet)
            if not warned_too_long and (line := too_long_warning(gen_stats, context_len(cfg))) is not None:
                print(line, flush=True)  # once: prompts the context window has no room for are never trained
                warned_too_long = True
            if records:
                fleet.heal(records[-1]["version"])
            new = ray.get(cluster.learners[0].metrics_since.remote(len(records)))
            if time.time() - last_buffer_check > 2.0:
                watch.check()  # a dead buffer actor: one clear error; a restarting one is waited for
                last_buffer_check = time.time()
            buf = watch.stats()
            now = time.time()
            # per generator: a restarted one's counters start again from 0 (never a negative rate)
            tok_s = rate.update(now, {int(s["gen_id"]): float(s["tokens"]) for s in gen_stats})
            evaluator = [s for s in gen_stats if s.get("gen_id") == 0]  # generator 0 evaluates
            for ev in fresh_evals(written_versions, evaluator[0]["evals"] if evaluator else []):
                writer.write(eval_record(ev), int(ev["version"]))
                evals.append(ev)
                acc = eval_label(ev)
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
                    rec["rollout/prompts_skipped"] = sum(float(s.get("prompts_skipped", 0.0)) for s in gen_stats)
                    rec.update(rollout_figures(gen_stats))  # prompts_too_long, truncated (prompt_fit.py)
                progress.before_write(rec)
                writer.write(rec, rec["step"])
                progress.after_write(rec)
                disagreement = mismatch_failure(rec, cfg.run.max_logp_mismatch)  # written first, then stopped on
                if disagreement is not None:
                    from async_rlhf.driver.fleet import RunFailure

                    raise RunFailure(disagreement)
            records += new
            if new:
                last_progress = now
            elif cfg.run.stall_timeout_s and now - last_progress > cfg.run.stall_timeout_s:
                stop_stalled(cluster, gen_stats, buf, now - last_progress)
            if records and now - last_print >= cfg.run.log_every_s:
                last_print = now
                print(_progress_line(records[-1], cfg.train.steps, acc, tok_s, buf.get("buffer/depth", 0),
                                     now - t_start),
                      flush=True)
        wall = time.time() - t_start
    except ray.exceptions.RayError as exc:
        # any call to a dead learner fails (its train() ref, metrics, trained ids): name the rank, stop the job;
        # only checkpoints whose every rank finished saving were committed, the newest is the one to resume
        failed = failed_learners(train_refs)
        if not failed:
            raise
        print(progress.failure_hint(), flush=True)
        from async_rlhf.run_logs import role_log_note

        raise LearnerFailure({r: f"{why}; {role_log_note(run_dir, f'learner-{r}')}" for r, why in failed.items()}
                             ) from exc
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
        "evals": evals + fresh_evals(written_versions, [e for s in gen_final if s.get("gen_id") == 0
                                                        for e in s.get("evals", [])]),
        "wall_time_s": wall,
        "t_start": t_start,
        "generated_tokens_per_s": tokens / wall,
        "learner_samples_per_s": sum(r["rollout/samples"] for r in records) / wall,
        "weight_push_s": sum(push_times) / len(push_times) if push_times else 0.0,
        "generator_stats": gen_final,
        "prompts_skipped": sum(int(s.get("prompts_skipped", 0)) for s in gen_final),
        "groups_generated": sum(int(s.get("groups", 0)) for s in gen_final),
        "prompts_too_long": sum(int(s.get("prompts_too_long", 0)) for s in gen_final),
        "timelines": timelines,
        "fleet": {"events": fleet.events, **fleet.status()},
        "prompt_ledger": progress.ledger,
        "first_step": progress.step,
        "stop_reason": why or "train.steps",
    }


def run(cfg: Config, address: str | None = None, cache_root: Path = Path("runs/cache"),
        resume: Path | None = None, stop: threading.Event | None = None, lock: Any = None,
        console: bool = False) -> dict[str, Any]:
    """Everything ``launch/cluster.py`` does after validation; returns the summary it writes.

    ``resume``: a committed checkpoint (``async_rlhf.driver.checkpoints.resolve_resume``) to continue from;
    ``stop``: set to end the run early (the launcher's SIGINT/SIGTERM handler), with a checkpoint and summary;
    ``lock``: the run directory's lock the caller already holds (:func:`async_rlhf.driver.run_lock.hold_run_dir`),
    else this call takes it, and releases it at its end; ``console``: this process is the launcher's, its terminal
    keeps only the launcher's own lines once run.dir exists (:func:`async_rlhf.run_logs.quiet_driver`).
    """
    from async_rlhf.config import make_paths_absolute
    from async_rlhf.driver.run_lock import hold_run_dir

    make_paths_absolute(cfg)  # the learners write checkpoints here from their own working directories
    own_lock = lock is None
    lock = hold_run_dir(cfg.run.dir) if own_lock else lock  # before anything in the directory changes
    try:
        return _run_locked(cfg, address, cache_root, resume, stop, console)
    finally:
        if own_lock:
            lock.release()


def _run_locked(cfg: Config, address: str | None, cache_root: Path, resume: Path | None,
                stop: threading.Event | None, console: bool = False) -> dict[str, Any]:
    from async_rlhf.config import ConfigError
    from async_rlhf.driver.checkpoints import check_run_dir, clear_run_dir, run_dir_of, set_aside_newer
    from async_rlhf.driver.reference import REFERENCE_FILE, check_reference, read_reference, write_reference
    from async_rlhf.driver.stopping import catch_stop_signals
    from async_rlhf.evaluation import BUILTIN_HELDOUT, eval_figures, eval_summary, eval_text

    run_dir = Path(cfg.run.dir)
    cache_root = cache_root.resolve()
    check_run_dir(run_dir, resume is not None, cfg.run.overwrite)  # (the launcher refused it already)
    if resume is None and cfg.run.overwrite:
        clear_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    from async_rlhf.buffer.run_scope import new_run_id, run_id_for

    # a checkpoint of another run directory continued here (a fork): that run is neither touched nor shared
    source_dir = run_dir_of(resume) if resume is not None else None
    forked = source_dir is not None and source_dir != run_dir.resolve()
    # issue 44, defect 4: a fresh run (or a fork) a new id, a resume its own (read before config.json is rewritten);
    # a Redis buffer's keys and a Redis prompt stream's positions are scoped by it
    cfg.run.id = new_run_id() if forked else run_id_for(run_dir, resume)
    if forked and "redis" in (cfg.buffer.store, cfg.prompts.source):
        print(f"continuing {source_dir}'s checkpoint in another run directory: this run has Redis keys of its own "
              f"(run.id {cfg.run.id}); the groups that run's buffer held and the Redis prompts it had in flight "
              "stay with it", flush=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    t0 = time.time()
    if console:  # the first line names run.dir/logs; from here the roles' and libraries' output goes there
        from async_rlhf.run_logs import quiet_driver

        quiet_driver(cfg)
    early = start_early_fork_servers(cfg, address)  # their imports overlap the model's resolution and Ray's start
    recorded = None
    if resume is not None:
        # the reference the run (or the run forked) started from
        recorded = read_reference(run_dir) or (read_reference(source_dir) if forked else None)
        # a copy: pruning deletes old checkpoints, and restarted actors (and save_hf's tokenizer files) still
        # read the directory they started from
        import shutil

        model_path = str(run_dir / "resumed_policy")
        shutil.rmtree(model_path, ignore_errors=True)
        shutil.copytree(resume / "policy", model_path)
        # the frozen reference (KL anchor, DPO's reference) stays the model the run started from, never the
        # checkpoint's policy
        reference_path = recorded["path"] if recorded else resolve_model(cfg, cache_root)
        if not Path(reference_path).is_dir():
            raise ConfigError(f"the run's reference model {reference_path} (named in {REFERENCE_FILE} of the run "
                              "directory) is gone: restore it there; the KL term of a resumed run must anchor to "
                              "the model the run started from")
    else:
        model_path = resolve_model(cfg, cache_root)
        reference_path = model_path
    builtin = cfg.task.name in BUILTIN_HELDOUT
    start_acc = end_acc = None
    model_s = time.time() - t0
    # the built-in task's held-out accuracy before RL, computed while the roles start: by a task forked from learner
    # rank 0's fork server where the roles are forked (Cluster.heldout, submitted once the node check passed), else
    # in a thread of this driver
    remote_eval = builtin and forks_roles(cfg)
    start_eval: Beside | TaskResult | None = (Beside(heldout_accuracy, model_path, cfg)
                                               if builtin and not remote_eval else None)
    if not builtin and not cfg.prompts.eval_path:
        print(f"task.name={cfg.task.name} has no held-out set of its own: no held-out figure is reported; give "
              "one with prompts.eval_path=FILE (JSONL or Parquet, scored by rewards.sources)", flush=True)
    try:
        cluster = Cluster(cfg, model_path, address, early, heldout=remote_eval, reference_path=reference_path)
        if remote_eval:
            start_eval = TaskResult(cluster.heldout_start)
    finally:
        if early is not None:
            early.close()  # those not named by now end
    by_phase = cluster.startup_s_by_phase
    by_phase["driver"] = {"model": round(model_s, 3), **by_phase.get("driver", {})}
    if stop is not None:
        catch_stop_signals(stop)  # ray.init replaced the SIGTERM handler
    try:
        reference_sha256 = cluster.reference_sha256
        if recorded is not None:
            check_reference(recorded, reference_path, reference_sha256)  # the same weights, or refused
        if recorded is None or forked:
            write_reference(run_dir, reference_path, reference_sha256)
        if resume is not None and not forked:  # only once the run has started: a failed start moves nothing
            moved = set_aside_newer(resume)
            if moved:  # a rollback: the newer checkpoints are an abandoned branch, kept aside
                print(f"resuming from {resume.name}, older than the run's newest: "
                      f"{', '.join(p.name for p in moved)} moved to {moved[0].parent} (nothing deleted)", flush=True)
        if cfg.buffer.store == "redis":
            from async_rlhf.buffer.run_scope import redis_warnings

            for line in redis_warnings(cfg.buffer.redis_url):  # (also in the buffer's log; this console is the user's)
                print(f"warning: {line}", flush=True)
        if start_eval is not None:
            start_acc = start_eval.result()
            # not a phase of its own: it ran beside the others (the seconds it kept the driver waiting are in
            # startup_s only if it outlasted them)
            by_phase["driver"]["held-out eval (beside)"] = round(start_eval.seconds, 3)
            print(f"policy {model_path}: held-out greedy accuracy {start_acc:.3f} before RL", flush=True)
        startup_s = time.time() - t0
        (run_dir / "cpu_plan.json").write_text(json.dumps(cluster.cpu_plan.to_dict(), indent=2))
        print(f"started {cfg.generators} generator(s), {cfg.learners} learner(s), buffer at "
              f"{cluster.buffer_address} in {startup_s:.0f}s", flush=True)
        # the user's held-out set, scored while the cluster is up (a reward model's actors run on Ray)
        eval_start = eval_figures(model_path, cfg)
        if eval_start is not None:
            print(f"policy {model_path}: {eval_text(eval_start)} on {cfg.prompts.eval_path} before RL", flush=True)
        figures = train(cfg, cluster, run_dir, resume=resume, stop=stop)
        policy_dir = cluster.save_policy(run_dir / "policy")
        end_task = TaskResult(cluster.heldout(policy_dir)) if remote_eval else None  # beside eval_figures
        eval_end = final_figure(lambda: eval_figures(policy_dir, cfg))
        # the task's worker ends with the run's actors: waited for before the shutdown; the driver's own thread
        # runs beside the shutdown
        end_acc = final_figure(end_task.result) if end_task is not None else None
        end_thread = Beside(heldout_accuracy, policy_dir, cfg) if builtin and not remote_eval else None
    finally:
        cluster.shutdown()
    if end_thread is not None:
        end_acc = final_figure(end_thread.result)
    from async_rlhf.plots import plot_learning_curve

    curve = [{"version": e["version"], "accuracy": e.get("accuracy", e.get("reward_mean", 0.0))}
             for e in figures["evals"]]
    first, last = ((eval_start["reward_mean"], eval_end["reward_mean"]) if eval_start and eval_end
                   else (start_acc, end_acc))
    plot_learning_curve(figures["records"], curve, run_dir / "learning_curve.png", first, last)
    busy = write_timeline(figures, run_dir)
    records = figures["records"]
    summary = {
        **({"accuracy_start": start_acc, "accuracy_end": end_acc} if builtin else {}),
        **eval_summary(eval_start, eval_end),
        "wall_time_s": time.time() - t0,
        "startup_s": startup_s,  # from the launch to every role started and the push group formed
        "startup_s_by_phase": by_phase,  # per role, the slowest rank's seconds per phase
        "train_wall_time_s": figures["wall_time_s"],
        "generated_tokens_per_s": figures["generated_tokens_per_s"],
        "learner_samples_per_s": figures["learner_samples_per_s"],  # every rank's samples (records are reduced)
        "learner_ranks": cfg.learners,
        "weight_push_s": figures["weight_push_s"],
        **busy,
        # prompts passed over before generation (prompts.skip_uninformative), against groups generated
        "prompts_skipped": figures["prompts_skipped"],
        "groups_generated": figures["groups_generated"],
        "prompts_too_long": figures["prompts_too_long"],  # no room in the context window (prompt_fit.py)
        **agent_summary(figures["generator_stats"]),  # task.name=agent: episodes, turns, token_mismatch (0) ...
        "steps": int(records[-1]["step"]) if records else figures["first_step"],
        "steps_configured": cfg.train.steps,
        # the training/inference agreement monitor (learner/agreement.py) over the whole run
        **agreement_summary(records),
        "stop_reason": figures["stop_reason"],
        "final_version": records[-1]["version"] if records else 0,
        "policy_dir": policy_dir,
        # the frozen reference the learner loaded (null without one) and where this run resumed from
        "reference_sha256": reference_sha256,
        "resumed_from": str(resume) if resume is not None else None,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    held = [f"held-out greedy accuracy {start_acc:.3f} -> "
            f"{'(failed)' if end_acc is None else format(end_acc, '.3f')}"] if builtin else []
    if eval_start and eval_end:
        acc = (f", accuracy {eval_start['accuracy']:.3f} -> {eval_end['accuracy']:.3f}"
               if "accuracy" in eval_start and "accuracy" in eval_end else "")
        held.append(f"held-out eval reward {eval_start['reward_mean']:.3f} -> {eval_end['reward_mean']:.3f}{acc}")
    print(f"{'; '.join(held) or 'no held-out figure'}; {summary['steps']} steps in {summary['wall_time_s']:.0f}s "
          f"({summary['generated_tokens_per_s']:.0f} generated tok/s, {summary['learner_samples_per_s']:.1f} "
          f"samples/s trained, {summary['weight_push_s'] * 1000:.0f} ms per weight push); "
          f"run written to {run_dir}", flush=True)
    return summary
