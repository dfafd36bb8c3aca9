"""One row of bench/scale.py: N generators and M learner ranks trained from node 0 of a Ray cluster, then the
fleet's figures, taken before its actors stop.

    python bench/scale_job.py --address HEAD:PORT --generators N --learners M --run-dir D --out row.json [key=value]

Runs inside node 0's network namespace (bench/scale.py and tests/cluster start it there). It does what
launch/cluster.py's run does up to the end of training (async_rlhf/driver/runner.py): resolve the policy, start
the Cluster (which prints the start-up progress lines), train() with a raw broadcast of the push's bytes during it
(async_rlhf/driver/push_timing.py, which also logs each generator's engine steps, loads and fetches); then, every
actor still up and idle: raw broadcasts and pushes in alternating blocks (push against raw on the quiet fleet), the
learners' all-reduce (async_rlhf/driver/fleet_figures.py), each role's peak RSS and PSS. Writes
``--out``: the row (``startup_s`` and ``startup_s_by_phase`` measured as summary.json's: from before the policy is
resolved until every role started and the push group formed), where every role ran, the generators' final
versions and what keeps "every version reached every generator" from holding (nothing, when it holds); and
``<run dir>/push_timeline.json``: per push and generator, quiet and during training, from the push's start to the
generator serving it (served_timeline's rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ["resources.placement=spread", "generator.eval_every=0", "generator.kv_cache_gib=0.05",
            "run.log_every_s=5", "run.checkpoint_every=0"]
"""Every row: one bundle per node where possible; no held-out evaluation; 54 MB of KV cache per engine (plenty for
the tiny model; 1 GiB each would not let 8 + 8 fit 24 GiB); the final checkpoint only."""


def steps_per_s(records: list[dict[str, Any]]) -> float:
    """Steps per second between the first step's record and the last one's (the first step's warm-up and the
    final checkpoint left out); 0 with fewer than two steps."""
    if len(records) < 2:
        return 0.0
    span = float(records[-1]["time"]) - float(records[0]["time"])
    return (len(records) - 1) / span if span > 0 else 0.0


def step_times(records: list[dict[str, Any]]) -> dict[str, float]:
    """Learner rank 0's mean seconds per step phase (``time/<phase>_s``), the first step (warm-up) left out."""
    steady = records[1:] or records
    keys = sorted({k for r in steady for k in r if k.startswith("time/") and k.endswith("_s")})
    return {k[len("time/"):-2]: round(sum(float(r.get(k, 0.0)) for r in steady) / len(steady), 4) for k in keys}


def actor_pss_mb(_actor: Any) -> float:
    """For ``actor.__ray_call__``: the proportional set size of the actor's process and its descendants now, MB
    (async_rlhf/process_memory.py's ``pss_mb`` where it exists, else /proc/<pid>/smaps_rollup read here)."""
    import os
    from pathlib import Path

    from async_rlhf import process_memory as pm

    def own_pss_mb(pid: int) -> float:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            return 0.0
        return next((int(line.split()[1]) * 1024 / 1e6 for line in text.splitlines() if line.startswith("Pss:")), 0.0)

    pss = getattr(pm, "pss_mb", own_pss_mb)
    pid = os.getpid()
    return round(sum(pss(p) for p in [pid, *pm.descendants(pid)]), 1)


def fleet_pss(cluster: Any) -> dict[str, Any]:
    """Per role, each actor's PSS now (after training, every actor still up), the largest of each role and the sum
    (shared pages counted once over the machine)."""
    import ray

    roles = {"generators": cluster.generators, "learners": cluster.learners, "buffer": [cluster.buffer]}
    per_role = {role: ray.get([a.__ray_call__.remote(actor_pss_mb) for a in actors]) for role, actors in roles.items()}
    return {"pss_mb": per_role, "pss_mb_generator": max(per_role["generators"]),
            "pss_mb_learner": max(per_role["learners"]),
            "pss_mb_sum": round(sum(sum(v) for v in per_role.values()), 1)}


def push_rows(quiet: list[dict[str, Any]], pushes: list[dict[str, Any]], raw_quiet: dict[str, Any],
              raw_training: dict[str, Any], records: list[dict[str, Any]], quiet_timeline: dict[str, Any],
              training_timeline: dict[str, Any]) -> dict[str, Any]:
    """The push against the raw broadcast, like with like: ``push_quiet_s`` / ``raw_quiet_s`` on the quiet fleet
    after training, ``push_training_s`` / ``raw_training_s`` while it trains (medians; the raw broadcast during
    training counts when it ended before the last step did: ``raw_training_during``), and when generators serve."""

    def median_of(rows: list[dict[str, Any]], key: str) -> float:
        values = sorted(float(r[key]) for r in rows if key in r)
        return statistics.median(values) if values else 0.0

    end = float(records[-1]["time"]) if records else 0.0
    return {
        "push_quiet_s": median_of(quiet, "sync/push_s"), "push_quiet_broadcast_s": median_of(quiet, "sync/broadcast_s"),
        "push_quiet_ack_wait_s": median_of(quiet, "sync/ack_wait_s"),
        "push_quiet_sender_run_delay_s": median_of(quiet, "sync/sender_run_delay_s"),
        "raw_quiet_s": raw_quiet.get("raw_s", 0.0),
        "raw_quiet_idle_s": raw_quiet.get("idle_s", 0.0), "raw_quiet_at_once_s": raw_quiet.get("at_once_s", 0.0),
        "raw_quiet_at_once_reps_s": raw_quiet.get("at_once_seconds", []),
        "push_training_s": median_of(pushes, "sync/push_s"),
        "push_training_broadcast_s": median_of(pushes, "sync/broadcast_s"),
        "push_training_ack_wait_s": median_of(pushes, "sync/ack_wait_s"),
        "raw_training_s": raw_training.get("raw_s", 0.0), "raw_training_reps_s": raw_training.get("seconds", []),
        "raw_training_during": bool(raw_training.get("t_end", float("inf")) <= end),
        "raw_training_error": raw_training.get("error", ""),
        "serve_quiet": quiet_timeline, "serve_training": training_timeline,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--generators", type=int, required=True)
    p.add_argument("--learners", type=int, required=True)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--reps", type=int, default=5, help="repetitions of the raw broadcast (during training, and per "
                   "quiet round), the quiet push (per round; 2 rounds) and the all-reduce")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    t0 = time.time()
    from async_rlhf.config import load_config, make_paths_absolute
    from async_rlhf.driver import push_timing as pt
    from async_rlhf.driver.cluster import Cluster, resolve_model
    from async_rlhf.driver.fleet_figures import learner_allreduce, peak_rss, push_figures, version_gaps
    from async_rlhf.driver.memory_plan import estimate_memory, model_parameters
    from async_rlhf.driver.runner import train
    from async_rlhf.generator.loop_phases import update_poll_s

    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"run.dir={run_dir}", f"generators={args.generators}", f"learners={args.learners}",
                             *SETTINGS, *args.overrides])
    make_paths_absolute(cfg)
    model = resolve_model(cfg, ROOT / "runs" / "cache")
    print(f"scale: {args.generators} generator(s) + {args.learners} learner rank(s)", flush=True)
    model_s = time.time() - t0
    cluster = Cluster(cfg, model, args.address)
    startup_s = time.time() - t0
    import ray

    ray_nodes = sum(1 for n in ray.nodes() if n.get("Alive"))  # each pays its own Ray (and fork server): the plan's
    memory = estimate_memory(cfg, model_parameters(model), nodes=ray_nodes)
    print(f"scale: over {ray_nodes} Ray node(s), {memory.table()}", flush=True)
    by_phase = cluster.startup_s_by_phase
    by_phase["driver"] = {"model": round(model_s, 3), **by_phase.get("driver", {})}
    where = {role: [n["node"] for n in found] for role, found in cluster.nodes.items()}
    nodes = len({ip for ips in where.values() for ip in ips})
    print(f"scale: started {args.generators} generator(s) and {args.learners} learner rank(s) on {nodes} node(s) "
          f"in {startup_s:.0f} s", flush=True)
    try:
        pt.instrument(cluster)  # engine steps and loads logged: when each generator served each push
        during = pt.RawDuringTraining(cluster, args.reps)
        figures = train(cfg, cluster, run_dir, on_fleet=during.start)
        raw_training = during.result(cfg.sync.timeout_s)
        print("scale: trained; on the quiet fleet: the raw broadcast, the push, the all-reduce, memory", flush=True)
        records = figures["records"]
        # alternating blocks of 3 (--reps rounds): the quiet figures are a few ms, a drift of the shared machine's
        # load between two blocks of 5 moved the ratio by 0.3-3x
        compared = pt.quiet_rounds(cluster, 3, rounds=max(args.reps, 2), timeout_s=cfg.sync.timeout_s)
        raw, quiet = compared["raw"], compared["pushes"]
        pushes = pt.training_pushes(records)
        lives = pt.training_live(cluster, pushes)
        intervals = pt.generator_intervals(cluster)
        allreduce = learner_allreduce(cluster, args.reps)
        rss = peak_rss(cluster)
        pss = fleet_pss(cluster)
    finally:
        cluster.shutdown()
    members = args.generators * cfg.resources.tensor_parallel
    quiet_lives = [q["live"] for q in quiet]
    timelines = {name: pt.served_timeline(ps, ls, intervals, update_poll_s(cfg.resources.tensor_parallel))
                 for name, ps, ls in (("quiet", quiet, quiet_lives), ("training", pushes, lives))}
    (run_dir / "push_timeline.json").write_text(json.dumps(timelines))
    like = push_rows(quiet, pushes, raw, raw_training, records,
                     pt.timeline_summary(timelines["quiet"], quiet, quiet_lives, members),
                     pt.timeline_summary(timelines["training"], pushes, lives, members))
    versions = [int(s["version"]) for s in figures["generator_stats"]]
    gaps = version_gaps(records, versions, members)
    row = {
        "generators": args.generators, "learners": args.learners,
        "nodes": nodes, "ray_nodes": ray_nodes,
        "startup_s": round(startup_s, 2), "startup_s_by_phase": by_phase,
        "steps": len(records), "steps_per_s": steps_per_s(records), "train_s": figures["wall_time_s"],
        "step_time_s": step_times(records),
        **push_figures(records),
        **like,
        "raw_broadcast_s": raw["raw_s"], "raw_broadcast_reps_s": raw["seconds"], "raw_bytes": raw["bytes"],
        "allreduce_s": allreduce["allreduce_s"], "allreduce_reps_s": allreduce["seconds"],
        "allreduce_bytes": allreduce["bytes"],
        "rss_mb_generator": rss["rss_mb_generator"], "rss_mb_learner": rss["rss_mb_learner"],
        "rss_mb": rss["rss_mb"], "rss_mb_sum": rss["rss_mb_sum"], **pss, "memory_estimate": memory.to_dict(),
        "plan_mb": round(memory.to_dict()["total_gb"] * 1e3),
        "versions_complete": not gaps, "version_gaps": gaps, "generator_versions": versions,
        # generator 0's held-out greedy accuracy, first and last evaluation (with generator.eval_every=K given)
        **({"accuracy_start": figures["evals"][0]["accuracy"], "accuracy_end": figures["evals"][-1]["accuracy"],
            "accuracy_versions": [int(figures["evals"][0]["version"]), int(figures["evals"][-1]["version"])]}
           if figures["evals"] and "accuracy" in figures["evals"][0] else {}),
        "final_version": int(records[-1]["version"]) if records else 0,
        "role_nodes": where, "learner_ranks": int(records[-1].get("learner_ranks", 1)) if records else 0,
        "samples_per_s": figures["learner_samples_per_s"], "generated_tokens_per_s": figures["generated_tokens_per_s"],
        "wall_s": round(time.time() - t0, 2),
    }
    args.out.write_text(json.dumps(row, indent=2))
    print(f"scale: row written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
