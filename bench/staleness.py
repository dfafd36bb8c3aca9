"""Staleness against correction on the tiny task: does off-policy correction keep async RL learning?

Runs the real stack (Ray, vLLM generators, DeepSpeed learner, ZeroMQ buffer, weight push) once per
(max_staleness, correction) pair with the same seeds, and writes:

- a markdown table (final held-out accuracy, mean staleness actually trained on, samples, wall time),
- PNG plots of held-out accuracy against learner steps and against wall time,
- ``--out FILE``: JSON ``{"runs": [{"max_staleness", "correction", "final_accuracy", "wall_time_s",
  "samples_trained"}, ...]}``.

    python bench/staleness.py [--quick] [--out runs/staleness/results.json] [key=value ...]
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

CORRECTIONS = {"none": "ppo", "truncated_is": "tis_token", "decoupled_ppo": "decoupled_ppo"}


def one_run(staleness: int, correction: str, steps: int, model_path: str, out_dir: Path,
            extra: list[str]) -> dict[str, Any]:

    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train
    from async_rlhf.policy_source import heldout_accuracy

    run_dir = out_dir / f"s{staleness}_{correction}"
    cfg = load_config(None, [f"train.max_staleness={staleness}", f"train.objective.kind={CORRECTIONS[correction]}",
                             f"train.steps={steps}", f"model.path={model_path}", f"run.dir={run_dir}",
                             "run.log_every_s=30", *extra])
    t0 = time.time()
    cluster = Cluster(cfg, model_path)
    try:
        figures = train(cfg, cluster, run_dir)
        policy = cluster.save_policy(run_dir / "policy")
    finally:
        cluster.close()
    records = figures["records"]
    return {
        "max_staleness": staleness,
        "correction": correction,
        "final_accuracy": heldout_accuracy(policy, cfg),
        "wall_time_s": figures["wall_time_s"],
        "samples_trained": sum(r["rollout/samples"] for r in records),
        "mean_staleness": sum(r["staleness/mean"] for r in records) / max(1, len(records)),
        "max_staleness_seen": max((r["staleness/max"] for r in records), default=0),
        "evals": figures["evals"],
        "eval_times": [e["time"] - figures["t_start"] for e in figures["evals"]],
        "setup_s": time.time() - t0 - figures["wall_time_s"],
    }


def write_report(runs: list[dict[str, Any]], start_acc: float, out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = ["| max_staleness | correction | final acc | vs staleness 0 | mean staleness | samples | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["correction"]: r["final_accuracy"] for r in runs if r["max_staleness"] == 0}
    for r in runs:
        ref = base.get(r["correction"])
        delta = f"{100 * (r['final_accuracy'] - ref):+.1f} pts" if ref is not None else "-"
        lines.append(f"| {r['max_staleness']} | {r['correction']} | {r['final_accuracy']:.3f} | {delta} | "
                     f"{r['mean_staleness']:.2f} | {r['samples_trained']} | {r['wall_time_s']:.0f} |")
    table = f"Held-out greedy accuracy before RL: {start_acc:.3f}\n\n" + "\n".join(lines) + "\n"
    (out_dir / "table.md").write_text(table)
    corrections = sorted({r["correction"] for r in runs}, key=list(CORRECTIONS).index)
    fig, axes = plt.subplots(2, len(corrections), figsize=(5 * len(corrections), 8), squeeze=False)
    for col, corr in enumerate(corrections):
        for r in (r for r in runs if r["correction"] == corr):
            label = f"max_staleness={r['max_staleness']}"
            axes[0][col].plot([e["version"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], "o-",
                              label=label)
            axes[1][col].plot(r["eval_times"], [e["accuracy"] for e in r["evals"]], "o-", label=label)
        axes[0][col].set_title(f"correction: {corr}")
        axes[0][col].set_xlabel("learner step (version)")
        axes[1][col].set_xlabel("wall time (s)")
        for row in (0, 1):
            axes[row][col].set_ylabel("held-out greedy accuracy")
            axes[row][col].set_ylim(0, 1)
            axes[row][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=90)
    plt.close(fig)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="staleness {0, 4} x {none, decoupled_ppo}, fewer steps")
    p.add_argument("--steps", type=int, help="learner steps per run")
    p.add_argument("--staleness", help="comma-separated max_staleness values (default: the grid of the mode)")
    p.add_argument("--corrections", help=f"comma-separated subset of {','.join(CORRECTIONS)}")
    p.add_argument("--out", default="runs/staleness/results.json")
    p.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = p.parse_args()

    from async_rlhf.config import load_config
    from async_rlhf.policy_source import heldout_accuracy, resolve_model

    out = Path(args.out)
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    default_s = [0, 4] if args.quick else [0, 1, 2, 4, 8]
    grid_s = [int(s) for s in args.staleness.split(",")] if args.staleness else default_s
    grid_c = (args.corrections.split(",") if args.corrections
              else ["none", "decoupled_ppo"] if args.quick else list(CORRECTIONS))
    unknown = sorted(set(grid_c) - set(CORRECTIONS))
    if unknown:
        p.error(f"unknown correction(s) {unknown}; choose from {', '.join(CORRECTIONS)}")
    steps = args.steps or (60 if args.quick else 200)
    base_cfg = load_config(None, args.overrides)
    model_path = resolve_model(base_cfg, ROOT / "runs" / "cache")
    start_acc = heldout_accuracy(model_path, base_cfg)
    runs = []
    for corr in grid_c:
        for s in grid_s:
            print(f"== max_staleness={s} correction={corr} ({steps} steps)", flush=True)
            runs.append(one_run(s, corr, steps, model_path, out_dir, args.overrides))
            r = runs[-1]
            print(f"   final accuracy {r['final_accuracy']:.3f}, mean staleness {r['mean_staleness']:.2f}, "
                  f"{r['wall_time_s']:.0f}s", flush=True)
            out.write_text(json.dumps({"start_accuracy": start_acc, "runs": runs}, indent=2))
    print(write_report(runs, start_acc, out_dir))
    print(f"wrote {out}, {out_dir / 'table.md'}, {out_dir / 'accuracy.png'}")


if __name__ == "__main__":
    main()
