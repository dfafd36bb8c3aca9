"""What bench/vs_trl.py prints and draws: a task's single-run table (:func:`report`), one seed's line
(:func:`seed_line`), the seeds' table with the CPU per generated sample by kind of process (:func:`report_seeds`),
and the curves (:func:`plot`: seed 0's two; :func:`plot_seeds`: every seed's, against time and samples trained)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.process_cpu import KINDS  # noqa: E402
from bench.vs_trl_stats import SAMPLES_NOTE, TARGET_RATIO, WINDOW, target_ratio, time_to  # noqa: E402


def plot(task: str, trl: dict[str, Any], ours: dict[str, Any], path: Path, generators: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ours_name = f"async_rlhf ({generators} generator(s) + 1 learner)"
    for name, run in (("TRL GRPOTrainer (synchronous)", trl), (ours_name, ours)):
        ax.plot([p["time_s"] for p in run["curve"]], [p["accuracy"] for p in run["curve"]], marker="o", label=name)
    ax.set_xlabel("RL training time (s)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"{task}: same start, hyperparameters and budget")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_seeds(task: str, rows: list[dict[str, Any]], path: Path, generators: int, target: float) -> None:
    """Every seed's two curves (a thin line each, one colour per side), against training time and samples trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    sides = (("trl", "C0", "TRL GRPOTrainer (synchronous)"),
             ("ours", "C1", f"async_rlhf ({generators} generator(s) + 1 learner)"))
    for side, colour, name in sides:
        for i, row in enumerate(rows):
            curve = row[f"{side}_curve"]
            for ax, key in zip(axes, ("time_s", "samples")):
                ax.plot([p[key] for p in curve], [p["accuracy"] for p in curve], color=colour, lw=0.9, alpha=0.7,
                        label=name if i == 0 else None)
    for ax, label in zip(axes, ("RL training time (s)", "samples trained")):
        ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"{task}: {len(rows)} seed(s), same start, hyperparameters and budget (dashed: target {target})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x: float | None) -> str:
    return "never" if x is None else f"{x:.0f} s"


def report(row: dict[str, Any]) -> None:
    print(f"\n## {row['task']}\n")
    print("| | TRL GRPOTrainer | async_rlhf |\n| --- | --- | --- |")
    print(f"| held-out accuracy at the end | {row['trl_accuracy_end']:.3f} after {row['trl_time_s']:.0f} s | "
          f"{row['ours_accuracy_end']:.3f} after {row['ours_time_s']:.0f} s |")
    print(f"| time to TRL's end accuracy | {row['trl_time_s']:.0f} s (first reached at "
          f"{fmt(row['trl_first_at_its_end_accuracy_s'])}) | {fmt(row['time_to_trl_accuracy_s'])} |")
    for t, v in row["time_to_threshold_s"].items():
        print(f"| time to {t} | {fmt(v['trl'])} | {fmt(v['ours'])} |")
    print(f"| learner steps | {row['trl_steps']} | {row['ours_steps']} |")
    print(f"| samples trained per second | {row['trl_samples_per_s']:.0f} | {row['ours_samples_per_s']:.0f} "
          f"(generated {row['ours_generated_samples_per_s']:.0f}; {row['zero_advantage_share']:.0%} of groups "
          "dropped as zero_advantage) |")
    if row.get("trl_cpu_ms_per_sample") is not None:
        print(f"| cores kept busy (CPU s per training s) | {row['trl_cores_busy']:.2f} | "
              f"{row['ours_cores_busy']:.2f} |")
        gen = row["ours_cpu_ms_per_generated_sample"]
        print(f"| CPU ms per sample trained | {row['trl_cpu_ms_per_sample']:.2f} | "
              f"{row['ours_cpu_ms_per_sample']:.2f} ({'-' if gen is None else f'{gen:.2f}'} per sample generated) |")
    pw, cf = row["learner_push_wait_fraction"], row["learner_compute_fraction"]
    print(f"| learner push wait / compute fraction | - | {pw if pw is None else f'{pw:.3f}'} / "
          f"{cf if cf is None else f'{cf:.2f}'} |")
    print(f"| held in the second half (mean of its evaluations) | {row['trl_accuracy_held']:.3f} | - |")
    print(f"| time to hold that (mean of {WINDOW} evaluations in a row) | "
          f"{fmt(row['trl_time_to_its_held_accuracy_s'])} | {fmt(row['time_to_trl_held_accuracy_s'])} |")
    for t, v in row["time_to_hold_threshold_s"].items():
        print(f"| time to hold {t} ({WINDOW} evaluations) | {fmt(v['trl'])} | {fmt(v['ours'])} |")
    ratio = target_ratio(row)
    held = (row["time_to_trl_held_accuracy_s"] or float("inf")) / row["trl_time_s"]
    print(f"\ntime to TRL's end accuracy, ours / TRL: {ratio:.2f} (target: at most {TARGET_RATIO} with a 600 s budget)")
    print(SAMPLES_NOTE)
    print(f"time to hold what TRL holds in its second half, ours / TRL's budget: {held:.2f}")
    own = row["trl_time_to_its_held_accuracy_s"]
    if own:  # when TRL holds it early, the budget flatters us: this is the ratio the target speaks of
        mine = row["time_to_trl_held_accuracy_s"] or float("inf")
        print(f"time to hold it, ours / TRL's own time to hold it ({own:.0f} s): {mine / own:.2f}")


def fmt_list(values: Sequence[float | None], acc: bool = False) -> str:
    return ", ".join("-" if v is None and acc else f"{v:.3f}" if acc else fmt(v) for v in values)


def fmt_spread(summary: dict[str, Any], key: str, acc: bool = False) -> str:
    mean, std = summary[f"{key}_mean"], summary[f"{key}_std"]
    if mean is None:
        return "-"
    unit, digits = ("", 3) if acc else (" s", 1)
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}") + unit


def seed_line(row: dict[str, Any], target: float) -> str:
    """One seed's comparison in a line (printed after each seed of a run over several)."""
    def side(name: str) -> str:
        reached = time_to(row[f"{name}_curve"], target)
        return (f"{row[f'{name}_accuracy_end']:.3f} after {row[f'{name}_time_s']:.0f} s, "
                + (f"{target} never" if reached is None else f"{target} at {reached:.0f} s"))

    def pair(key: str) -> str:
        a, b = row[f"trl_{key}"], row[f"ours_{key}"]
        return f"{'-' if a is None else f'{a:.3f}'} / {'-' if b is None else f'{b:.3f}'}"

    return (f"[{row['task']}] seed {row['seed']}: TRL {side('trl')}; ours {side('ours')}; TRL / ours at equal time "
            f"({row['equal_time_s']:.0f} s) {pair('accuracy_at_equal_time')}, at equal samples trained "
            f"({row['equal_samples']:.0f}) {pair('accuracy_at_equal_samples')}")


KIND_NOTES = {"trl": "trl (TRL's process: generation and training, evaluations left out)",
              "engine": "engine (generator actors: vLLM engine, rewards)", "learner": "learner",
              "buffer": "buffer", "ray": "ray (raylet, gcs_server, agents, log monitor, idle workers)",
              "driver": "driver (launch/cluster.py)", "forkserver": "forkserver (role fork server, wrappers)",
              "other": "other (start-up and evaluation tasks, helpers)", "total": "total"}


def report_seeds(entry: dict[str, Any]) -> None:
    """The seeds' readings of a task, per seed and as mean ± sample std, and the CPU per sample by process."""
    trl, ours, k = entry["trl"], entry["ours"], len(entry["seeds"])
    start = "each seed's own warm start" if entry["vary_start"] else "the same start for every seed"
    print(f"\n### {entry['task']} over {k} seed(s) ({start}); target accuracy {entry['target_accuracy']}\n")
    print("| | TRL GRPOTrainer | async_rlhf |\n| --- | --- | --- |")
    for key, label in (("time_to_target_s", "time to the target (first evaluation at or above)"),
                       ("time_to_hold_target_s", f"time to hold it ({WINDOW} evaluations in a row)")):
        never = "never_reached" if key == "time_to_target_s" else "never_held"
        print(f"| {label}, per seed | {fmt_list(trl[key])} | {fmt_list(ours[key])} |")
        print(f"| mean ± std of the seeds that reached it; never reached | {fmt_spread(trl, key)}; "
              f"{trl[never]} of {k} | {fmt_spread(ours, key)}; {ours[never]} of {k} |")
    equal_s = ", ".join(f"{r['equal_time_s']:.0f}" for r in entry["per_seed"])
    equal_n = ", ".join(f"{r['equal_samples']:.0f}" for r in entry["per_seed"])
    for key, label in (("accuracy_end", "end accuracy"),
                       ("accuracy_at_equal_time", f"accuracy at equal training time ({equal_s} s)"),
                       ("accuracy_at_equal_samples", f"accuracy at equal samples trained ({equal_n})")):
        print(f"| {label}, per seed | {fmt_list(trl[key], True)} | {fmt_list(ours[key], True)} |")
        print(f"| mean ± std | {fmt_spread(trl, key, True)} | {fmt_spread(ours, key, True)} |")
    print("\n(std: sample standard deviation, n - 1, over the seeds with a value)")
    by = entry["cpu_ms_per_generated_sample_by_process"]
    print(f"\n| CPU ms per generated sample, by process (mean of {k} seed(s)) | TRL | async_rlhf |")
    print("| --- | --- | --- |")
    for kind in ("trl", *KINDS, "total"):
        a, b = by["trl"].get(kind), by["ours"].get(kind)
        if a is None and b is None:
            continue
        print(f"| {KIND_NOTES[kind]} | {'-' if a is None else f'{a:.3f}'} | {'-' if b is None else f'{b:.3f}'} |")
