"""One row of bench/scale.py: N generators and M learner ranks trained from node 0 of a Ray cluster, then the
fleet's figures, taken before its actors stop.

    python bench/scale_job.py --address HEAD:PORT --generators N --learners M --run-dir D --out row.json [key=value]

Runs inside node 0's network namespace (bench/scale.py and tests/cluster start it there). It does what
launch/cluster.py's run does up to the end of training (async_rlhf/driver/runner.py): resolve the policy, start
the Cluster (which prints the start-up progress lines), train(); then async_rlhf/driver/fleet_figures.py measures
the raw broadcast, the learners' all-reduce and each role's peak memory while every actor is still up. Writes
``--out``: the row (``startup_s`` and ``startup_s_by_phase`` measured as summary.json's: from before the policy is
resolved until every role started and the push group formed), where every role ran, the generators' final
versions and what keeps "every version reached every generator" from holding (nothing, when it holds).
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True)
    p.add_argument("--generators", type=int, required=True)
    p.add_argument("--learners", type=int, required=True)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--reps", type=int, default=5, help="repetitions of the raw broadcast and of the all-reduce")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    t0 = time.time()
    from async_rlhf.config import load_config, make_paths_absolute
    from async_rlhf.driver.cluster import Cluster, resolve_model
    from async_rlhf.driver.fleet_figures import learner_allreduce, peak_rss, push_figures, raw_broadcast, version_gaps
    from async_rlhf.driver.memory_plan import estimate_memory, model_parameters
    from async_rlhf.driver.runner import train

    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"run.dir={run_dir}", f"generators={args.generators}", f"learners={args.learners}",
                             *SETTINGS, *args.overrides])
    make_paths_absolute(cfg)
    model = resolve_model(cfg, ROOT / "runs" / "cache")
    memory = estimate_memory(cfg, model_parameters(model))
    print(f"scale: {args.generators} generator(s) + {args.learners} learner rank(s); {memory.table()}", flush=True)
    model_s = time.time() - t0
    cluster = Cluster(cfg, model, args.address)
    startup_s = time.time() - t0
    by_phase = cluster.startup_s_by_phase
    by_phase["driver"] = {"model": round(model_s, 3), **by_phase.get("driver", {})}
    where = {role: [n["node"] for n in found] for role, found in cluster.nodes.items()}
    nodes = len({ip for ips in where.values() for ip in ips})
    print(f"scale: started {args.generators} generator(s) and {args.learners} learner rank(s) on {nodes} node(s) "
          f"in {startup_s:.0f} s", flush=True)
    try:
        figures = train(cfg, cluster, run_dir)
        print("scale: trained; measuring the raw broadcast, the all-reduce and peak memory", flush=True)
        raw = raw_broadcast(cluster, args.reps)
        allreduce = learner_allreduce(cluster, args.reps)
        rss = peak_rss(cluster)
    finally:
        cluster.shutdown()
    records = figures["records"]
    versions = [int(s["version"]) for s in figures["generator_stats"]]
    members = args.generators * cfg.resources.tensor_parallel
    gaps = version_gaps(records, versions, members)
    row = {
        "generators": args.generators, "learners": args.learners,
        "nodes": nodes,
        "startup_s": round(startup_s, 2), "startup_s_by_phase": by_phase,
        "steps": len(records), "steps_per_s": steps_per_s(records), "train_s": figures["wall_time_s"],
        "step_time_s": step_times(records),
        **push_figures(records),
        "raw_broadcast_s": raw["raw_broadcast_s"], "raw_broadcast_reps_s": raw["seconds"], "raw_bytes": raw["bytes"],
        "allreduce_s": allreduce["allreduce_s"], "allreduce_reps_s": allreduce["seconds"],
        "allreduce_bytes": allreduce["bytes"],
        "rss_mb_generator": rss["rss_mb_generator"], "rss_mb_learner": rss["rss_mb_learner"],
        "rss_mb": rss["rss_mb"], "rss_mb_sum": rss["rss_mb_sum"], "memory_estimate": memory.to_dict(),
        "versions_complete": not gaps, "version_gaps": gaps, "generator_versions": versions,
        "final_version": int(records[-1]["version"]) if records else 0,
        "role_nodes": where, "learner_ranks": int(records[-1].get("learner_ranks", 1)) if records else 0,
        "samples_per_s": figures["learner_samples_per_s"], "generated_tokens_per_s": figures["generated_tokens_per_s"],
        "wall_s": round(time.time() - t0, 2),
    }
    args.out.write_text(json.dumps(row, indent=2))
    print(f"scale: row written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
