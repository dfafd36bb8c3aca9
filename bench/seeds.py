"""The demo's configuration over seeds: does it learn on every one, or only on lucky ones?

``make demo`` is one run of ``launch/cluster.py --generators 2 --learners 1`` on the embedded defaults, and one
run says little: whether RL finds the carry within the demo's steps depends on the seed (issue 47). This bench
runs that command once per seed, one after the other, with ``train.seed=S`` (which seeds the tiny model's
initialisation, its SFT warm start, the prompt order, sampling and the learner), and reports the distribution:
held-out greedy accuracy before and after RL, training time, and the step at which each run first reached 0.9.

    python bench/seeds.py [--seeds 10] [--first-seed 0] [--set train.lr=3e-4 ...] [--out runs/seeds/results.json]

Each seed's warm start is built once and cached (runs/cache, as ``make setup`` builds seed 0's); the time it takes
is not training time. Writes ``--out``: ``{"machine", "commit", "settings", "rows": [{"seed", "accuracy_start",
"accuracy_end", "train_s", "startup_s", "steps", "step_to_0.9", "curve"}], "share_at_least_0.9", ...}`` and
``seeds.png`` (every seed's held-out curve) beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import describe, finish, git_commit, machine_record, stamp  # noqa: E402
from bench.vs_trl import read_jsonl  # noqa: E402  (a metrics.jsonl that may be half written)

DEMO = ["--generators", "2", "--learners", "1"]
"""The demo's command line (Makefile ``demo``) without its run directory."""
GOAL = 0.9
"""Held-out accuracy a demo run should end at (issue 47: on at least 9 seeds of 10)."""


def eval_curve(run_dir: Path) -> list[dict[str, float]]:
    """Held-out evaluations of the run: ``[{"version", "accuracy"}]`` in the order they were made."""
    return [{"version": int(r["version"]), "accuracy": float(r["eval/heldout_accuracy"])}
            for r in read_jsonl(run_dir / "metrics.jsonl")
            if r.get("kind") == "eval" and "eval/heldout_accuracy" in r]


def first_reaching(curve: list[dict[str, float]], goal: float) -> int | None:
    return next((int(e["version"]) for e in curve if e["accuracy"] >= goal), None)


def build_warm_start(seed: int, overrides: list[str]) -> tuple[float, dict[str, Any]]:
    """Seconds spent building (or finding) this seed's warm start before the timed run, and what its build
    measured (``tiny_info.json``: held-out greedy and sampled accuracy; empty for a ``model.path``)."""
    t0 = time.perf_counter()
    code = ("import sys\nfrom pathlib import Path\nfrom async_rlhf.config import load_config\n"
            "from async_rlhf.policy_source import resolve_model\n"
            "print(resolve_model(load_config(None, sys.argv[2:]), Path(sys.argv[1])))")
    path = subprocess.run([sys.executable, "-c", code, str(ROOT / "runs" / "cache"), f"train.seed={seed}",
                           *overrides], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    info_file = Path(path.splitlines()[-1]) / "tiny_info.json" if path else None
    info = json.loads(info_file.read_text()) if info_file is not None and info_file.is_file() else {}
    return time.perf_counter() - t0, {k: info[k] for k in ("heldout_greedy_accuracy", "heldout_sampled_accuracy")
                                      if k in info}


def run_seed(seed: int, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    run_dir = out_dir / f"seed-{seed}"
    warm_s, warm = build_warm_start(seed, overrides)
    cmd = [sys.executable, "launch/cluster.py", *DEMO, f"run.dir={run_dir}", "run.overwrite=true",
           f"train.seed={seed}", *overrides]
    t0 = time.perf_counter()
    with (out_dir / f"seed-{seed}.log").open("w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - t0
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        return {"seed": seed, "failed": f"exit {proc.returncode}, see {out_dir / f'seed-{seed}.log'}"}
    summary = json.loads(summary_path.read_text())
    curve = eval_curve(run_dir)
    return {"seed": seed, "accuracy_start": summary["accuracy_start"], "accuracy_end": summary["accuracy_end"],
            "train_s": round(summary["train_wall_time_s"], 1), "startup_s": round(summary["startup_s"], 1),
            "wall_s": round(wall_s, 1), "warm_start_s": round(warm_s, 1), "steps": summary["steps"],
            "warm_start_sampled_accuracy": warm.get("heldout_sampled_accuracy"),
            f"step_to_{GOAL}": first_reaching(curve, GOAL), "curve": curve}


def spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"mean": round(statistics.fmean(values), 4), "std": round(statistics.pstdev(values), 4),
            "min": round(min(values), 4), "max": round(max(values), 4)}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "failed" not in r]
    ends = [r["accuracy_end"] for r in done]
    return {"share_at_least_0.9": round(sum(a >= GOAL for a in ends) / len(rows), 3) if rows else 0.0,
            "failed_runs": len(rows) - len(done), "accuracy_end": spread(ends),
            "accuracy_start": spread([r["accuracy_start"] for r in done]),
            "train_s": spread([r["train_s"] for r in done])}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r.get("curve"):  # the evaluations during the run, then the end policy's at its last step
            ax.plot([e["version"] for e in r["curve"]] + [r["steps"]],
                    [e["accuracy"] for e in r["curve"]] + [r["accuracy_end"]],
                    label=f"seed {r['seed']}: {r['accuracy_end']:.3f}", alpha=0.8)
    ax.axhline(GOAL, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("policy version (learner steps)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'seed':>4} | {'start':>5} | {'end':>5} | {'train s':>7} | {'step to ' + str(GOAL):>10}"]
    for r in rows:
        if "failed" in r:
            lines.append(f"{r['seed']:>4} | failed: {r['failed']}")
            continue
        reach = r[f"step_to_{GOAL}"]
        lines.append(f"{r['seed']:>4} | {r['accuracy_start']:5.3f} | {r['accuracy_end']:5.3f} | "
                     f"{r['train_s']:7.1f} | {reach if reach is not None else '-':>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=10, help="how many seeds (consecutive from --first-seed)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="overrides on top of the demo's defaults (the same for every seed)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "seeds" / "results.json")
    args = ap.parse_args(argv)
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    machine, commit = machine_record(), git_commit()
    print(describe(machine, commit), flush=True)
    rows: list[dict[str, Any]] = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = run_seed(seed, list(args.set), out_dir)
        rows.append(row)
        if "failed" in row:
            print(f"seed {seed}: failed ({row['failed']})", flush=True)
        else:
            print(f"seed {seed}: {row['accuracy_start']:.3f} -> {row['accuracy_end']:.3f} in {row['train_s']:.0f} s "
                  f"of training ({row['steps']} steps; warm start {row['warm_start_s']:.0f} s)", flush=True)
        result = stamp({"settings": {"command": DEMO, "overrides": list(args.set)}, "rows": rows,
                        **summarise(rows)}, machine, commit)
        args.out.write_text(json.dumps(result, indent=1))  # after every seed: a long bench keeps what it has
    finish(machine)
    result = stamp({"settings": {"command": DEMO, "overrides": list(args.set)}, "rows": rows, **summarise(rows)},
                   machine, commit)
    args.out.write_text(json.dumps(result, indent=1))
    plot(rows, out_dir / "seeds.png", f"make demo over {len(rows)} seeds {' '.join(args.set)}\n{commit[:12]}")
    print(table(rows))
    s = summarise(rows)
    print(f"held-out >= {GOAL} at the end: {s['share_at_least_0.9']:.0%} of {len(rows)} seeds; end accuracy "
          f"{s['accuracy_end'].get('mean', 0):.3f} +- {s['accuracy_end'].get('std', 0):.3f} "
          f"(min {s['accuracy_end'].get('min', 0):.3f}); training {s['train_s'].get('mean', 0):.0f} s mean")
    print(describe(machine, commit))
    print(f"wrote {args.out} and {out_dir / 'seeds.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
