"""Generator busy time with rewards that arrive late: a remote scorer answering at once against one answering
after several seconds, in the same run (same Ray session, same policy, same settings but the delay).

Every group is put to the buffer as soon as it is generated (``rewards_pending``) and becomes trainable when
the HTTP scorer's answer arrives, so the engines keep stepping while rewards are outstanding. The staleness
bound is the only thing that can make a generator wait (the learner cannot train a group before its reward
arrives, so a delay of D seconds needs about D x versions/s of extra staleness), so both runs use one large
enough that the learner does not pace admission (``--max-staleness``, default 200, unbounded buffer
capacity); the bench measures what the reward delay costs the generators, nothing else.
Busy fraction = share of a generator's loop time spent generating or putting (not waiting for admission or a
weight push), averaged over generators.

    python bench/delayed_rewards.py [--quick] [--delay 3] [--out FILE] [key=value ...]

``--out FILE`` writes JSON with ``busy_fraction_no_delay``, ``busy_fraction_delayed``, ``delay_s`` and per-run
details; a markdown table is printed.
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


def start_cluster(cluster_cls: Any, cfg: Any, model_path: str, attempts: int = 3) -> Any:
    """Ray's local start gives up after 30 s on an overloaded machine: try again a few times."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            return cluster_cls(cfg, model_path)
        except Exception as exc:
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            print(f"Ray did not start ({exc}); retrying", flush=True)
            ray.shutdown()
            time.sleep(10)
    raise AssertionError("unreachable")


def one_run(delay_s: float, jitter_s: float, steps: int, model_path: str, out_dir: Path, max_staleness: int,
            extra: list[str]) -> dict[str, Any]:
    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train
    from async_rlhf.plots import role_busy_fraction
    from async_rlhf.rewards.scorer_server import ScorerServer

    scorer = ScorerServer(delay_s=delay_s, jitter_s=jitter_s)
    run_dir = out_dir / f"delay_{delay_s:g}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"train.steps={steps}", f"model.path={model_path}", f"run.dir={run_dir}",
                             "rewards.sources=http", f"rewards.http_url={scorer.url}",
                             f"train.max_staleness={max_staleness}", "buffer.capacity=0",
                             "generator.eval_every=0", "run.log_every_s=30", *extra])
    try:
        cluster = start_cluster(Cluster, cfg, model_path)
        try:
            figures = train(cfg, cluster, run_dir)
        finally:
            cluster.close()
    finally:
        scorer.close()
    gens = [tl for tl in figures["timelines"] if str(tl["role"]).startswith("generator")]
    learners = [tl for tl in figures["timelines"] if str(tl["role"]).startswith("learner")]
    stats = figures["generator_stats"]
    records = figures["records"]
    return {
        "delay_s": delay_s,
        "jitter_s": jitter_s,
        "generator_busy_fraction": sum(map(role_busy_fraction, gens)) / len(gens),
        "learner_busy_fraction": sum(map(role_busy_fraction, learners)) / max(1, len(learners)),
        "wall_time_s": figures["wall_time_s"],
        "generated_tokens_per_s": figures["generated_tokens_per_s"],
        "learner_samples_per_s": figures["learner_samples_per_s"],
        "rewards_late": sum(s.get("rewards_late", 0) for s in stats),
        "reward_timeouts": sum(s.get("reward_timeouts", 0) for s in stats),
        "scorer_requests": scorer.requests,
        "max_awaiting_reward": max((r.get("buffer/awaiting_reward", 0) for r in records), default=0),
        "mean_staleness": sum(r["staleness/mean"] for r in records) / max(1, len(records)),
        "reward_mean_last10": sum(r["rollout/reward_mean"] for r in records[-10:]) / max(1, len(records[-10:])),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a few minutes)")
    ap.add_argument("--delay", type=float, default=3.0, help="scorer delay of the delayed run, seconds")
    ap.add_argument("--jitter", type=float, default=1.0, help="extra uniform random delay of the delayed run")
    ap.add_argument("--max-staleness", type=int, default=200,
                    help="staleness bound of both runs; large enough that the learner does not pace admission")
    ap.add_argument("--steps", type=int, default=0, help="learner steps per run (default 40 quick, 150 full)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--dir", type=Path, default=ROOT / "runs" / "bench_delayed_rewards")
    ap.add_argument("--model", default="", help="policy directory (default: the tiny model's SFT warm start)")
    ap.add_argument("overrides", nargs="*", help="config key=value applied to both runs")
    args = ap.parse_args()

    import ray

    from async_rlhf.config import load_config
    from async_rlhf.policy_source import resolve_model

    steps = args.steps or (40 if args.quick else 150)
    base = load_config(None, args.overrides)
    model_path = args.model or resolve_model(base, ROOT / "runs" / "cache")
    t0 = time.time()
    try:
        runs = [one_run(0.0, 0.0, steps, model_path, args.dir, args.max_staleness, args.overrides),
                one_run(args.delay, args.jitter, steps, model_path, args.dir, args.max_staleness, args.overrides)]
    finally:
        ray.shutdown()
    fast, slow = runs
    result = {
        "busy_fraction_no_delay": fast["generator_busy_fraction"],
        "busy_fraction_delayed": slow["generator_busy_fraction"],
        "delay_s": args.delay,
        "jitter_s": args.jitter,
        "ratio_delayed_to_no_delay": slow["generator_busy_fraction"] / max(1e-9, fast["generator_busy_fraction"]),
        "target_busy_fraction_delayed": 0.9,
        "steps": steps,
        "max_staleness": args.max_staleness,
        "bench_wall_time_s": time.time() - t0,
        "runs": runs,
    }
    print("\n| scorer delay | generator busy | learner busy | gen tok/s | trained samples/s | late rewards | "
          "max awaiting | mean staleness | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        label = f"{r['delay_s']:g} s" + (f" + U(0, {r['jitter_s']:g}) s" if r["jitter_s"] else "")
        print(f"| {label} | {r['generator_busy_fraction']:.3f} | {r['learner_busy_fraction']:.3f} | "
              f"{r['generated_tokens_per_s']:.0f} | {r['learner_samples_per_s']:.1f} | {r['rewards_late']} | "
              f"{r['max_awaiting_reward']} | {r['mean_staleness']:.2f} | {r['wall_time_s']:.0f} |")
    print(f"\nbusy fraction with a {args.delay:g} s scorer: {result['busy_fraction_delayed']:.3f} "
          f"({result['ratio_delayed_to_no_delay']:.2f} x the no-delay run; target above 0.9)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
