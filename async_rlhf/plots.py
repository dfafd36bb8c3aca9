"""Pictures of a run: the learning curve and the timeline of every role (a Gantt chart)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_rlhf.timeline import busy_fraction

BUSY = {"generator": ("generate", "reward_and_put"),
        "learner": ("collate", "forward_backward", "optimizer", "push", "metrics", "checkpoint")}
"""States that are work; waiting (wait_data, ack, push_wait, wait_admission, ...) never counts as busy."""
COLORS = {"generate": "tab:green", "reward_and_put": "tab:olive", "wait_admission": "lightgray",
          "paused_for_push": "tab:red", "collate": "tab:cyan", "forward_backward": "tab:blue",
          "optimizer": "navy", "push": "tab:purple", "push_wait": "tab:red", "wait_data": "tab:gray",
          "ack": "silver", "metrics": "tab:pink", "wait_env_or_reward": "tab:cyan", "checkpoint": "tab:brown"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def role_busy_fraction(timeline: dict[str, Any]) -> float:
    kind = str(timeline["role"]).split()[0]
    return busy_fraction(timeline["totals"], BUSY.get(kind, ()))


def plot_timeline(timelines: list[dict[str, Any]], t0: float, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(timelines) + 1.5))
    seen: set[str] = set()
    for row, tl in enumerate(timelines):
        by_state: dict[str, list[tuple[float, float]]] = {}
        for state, start, end in tl["intervals"]:
            by_state.setdefault(state, []).append((start - t0, end - start))
        for state, spans in by_state.items():
            label = state if state not in seen else None
            seen.add(state)
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS.get(state, "tab:orange"), label=label)
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels([f"{tl['role']} (busy {role_busy_fraction(tl):.0%})" for tl in timelines])
    ax.set_xlabel("seconds since training started")
    ax.set_title("where each role's time goes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_learning_curve(records: list[dict[str, Any]], evals: list[dict[str, float]], path: Path,
                        start_acc: float | None = None, end_acc: float | None = None) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in records]
    ax[0].plot(steps, [r["rollout/reward_mean"] for r in records], lw=0.8, alpha=0.5, label="batch reward")
    k = 10
    if len(records) >= k:
        smooth = [sum(r["rollout/reward_mean"] for r in records[i - k:i]) / k for i in range(k, len(records) + 1)]
        ax[0].plot(steps[k - 1:], smooth, lw=2, label=f"reward ({k}-step mean)")
    if evals:
        ax[0].plot([e["version"] for e in evals], [e["accuracy"] for e in evals], "o-",
                   label="held-out greedy (vLLM)")
    if start_acc is not None and end_acc is not None and steps:
        ax[0].plot([0, steps[-1]], [start_acc, end_acc], "k*", ms=10, label="held-out greedy (transformers)")
    ax[0].set_xlabel("learner step")
    ax[0].set_ylabel("reward / accuracy")
    ax[0].set_ylim(0, 1)
    ax[0].legend(loc="lower right")
    ax[0].set_title("learning curve")
    t0 = records[0]["time"] if records else 0
    ax[1].plot([r["time"] - t0 for r in records], [r["rollout/reward_mean"] for r in records], lw=0.8)
    ax[1].set_xlabel("wall time since first step (s)")
    ax[1].set_ylabel("batch reward")
    ax[1].set_ylim(0, 1)
    ax[1].set_title("reward against wall time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_accuracy_per_sample(curves: dict[str, list[list[float]]], path: Path) -> None:
    """Held-out greedy accuracy against samples trained, one line per run (e.g. ``longtail async``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in curves.items():
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], "o-" if "async" in label else "s--", label=label)
    ax.set_xlabel("samples trained")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("accuracy per sample trained: asynchronous against synchronous")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
