"""The largest fleet this machine holds, rehearsed across network-namespace nodes (issue 32).

    flock /tmp/heavy.lock python bench/scale.py [--quick] [--ns 1,2,4,8] [--nodes 4] [--steps 8] --out FILE

Builds one Ray cluster of ``--nodes`` nodes on this machine, once (tests/cluster/nodes.py, the cluster tier's
fixture: one network namespace per node on a bridge, the Ray head on node 0, a worker on each other node), then
for each N runs bench/scale_job.py on node 0: the RL loop with N generators and N learner ranks spread over the
nodes (``resources.placement=spread``), ``--steps`` steps of the tiny model with 54 MB of KV cache per engine.
Needs root and iproute2, like tests/cluster. The driver's start-up progress lines are printed as the job runs.

Per row (``--out`` JSON ``{"machine", "commit", "rows": [...], "target", "holds"}``, bench/machine.py):

    startup_s            from before the policy is resolved until every role started and the push group formed
                         (summary.json's startup_s); startup_s_by_phase: per role the slowest rank's seconds per phase
    steps_per_s          learner steps per second between the first step and the last (warm-up and the final
                         checkpoint left out)
    push_s               median over the run's pushes of sync/push_s (start to every generator's acknowledgement),
                         overlapping the learners' next step and the generators' work on the same cores;
                         push_broadcast_s: until the sender's chunks are out (sync/broadcast_s), push_ack_wait_s:
                         then until every generator received them and acknowledged (sync/ack_wait_s)
    raw_broadcast_s      the same bytes broadcast from learner rank 0 to the same generator workers on the push's
                         own store and transport, after training on the quiet fleet (async_rlhf/sync/raw.py: the
                         broadcast plus a 1-element allreduce, every receive posted first: bench/weight_sync's raw)
    allreduce_s          the learners' all-reduce of as many elements as the trainable parameters (their gradients'
                         size) over their group, after training: per repetition the slowest rank, the median
    rss_mb_generator     peak resident MB of the largest generator actor process and its children (the CPU vLLM
    rss_mb_learner       engine runs inside it), likewise of a learner rank; rss_mb: every role's, rss_mb_sum: all
    versions_complete    every push acknowledged by every generator (an acknowledgement means the member holds that
                         version byte-exact) and every generator ending on the final version

``--quick``: N in 1, 2, 4 (a few minutes); the full run adds 8 + 8 (about as long again: 16 roles start on 2
cores). Target: every row's versions complete and the sum of its peak memory within this machine's. Prints a
table, where the start-up time goes, and writes a plot beside ``--out``.
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
sys.path.insert(0, str(ROOT / "tests" / "cluster"))  # the namespace nodes of the cluster tier

from bench.machine import describe, finish, git_commit, machine_record, stamp  # noqa: E402

TARGET = ("every row: every version reached every generator (versions_complete), and the sum of the roles' peak "
          "resident memory within this machine's")
ROW_TIMEOUT_S = 1800.0
PROGRESS = ("start-up", "step ", "scale:", "stopping", "stalled", "Traceback", "Error")
"""Lines of the job's output printed while it runs (its log file keeps all of them, the actors' too)."""


def machine_memory_mb() -> float:
    import psutil

    return psutil.virtual_memory().total / 1e6


class UsedMemory:
    """The machine's used memory (psutil: total minus available), sampled every ``every_s`` on a thread while a row
    runs: its peak includes Ray's own processes, which the per-role figures leave out (and anything else running)."""

    def __init__(self, every_s: float = 0.5) -> None:
        import threading

        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)

    def _sample(self, every_s: float) -> None:
        import psutil

        while True:
            vm = psutil.virtual_memory()
            self.peak_mb = max(self.peak_mb, (vm.total - vm.available) / 1e6)
            if self._stop.wait(every_s):
                return

    def __enter__(self) -> UsedMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def holds(rows: list[dict[str, Any]], memory_mb: float) -> bool:
    return bool(rows) and all(r["versions_complete"] and r["rss_mb_sum"] <= memory_mb for r in rows)


def phase_line(row: dict[str, Any]) -> str:
    """Where a row's start-up went: the driver's phases, then each role's (its slowest rank's) phases."""
    parts = []
    for role, phases in row["startup_s_by_phase"].items():
        top = sorted(phases.items(), key=lambda kv: -kv[1])
        parts.append(f"{role} " + ", ".join(f"{name} {s:.0f}" for name, s in top if s >= 0.5))
    return f"  {row['generators']}+{row['learners']} start-up {row['startup_s']:.0f} s: " + "; ".join(parts)


def step_line(row: dict[str, Any]) -> str:
    """Where a row's training step went: the learner's mean seconds per phase (the first step left out)."""
    t = row.get("step_time_s", {})
    parts = [f"{name} {t[name]:.2f}" for name in ("wait_data", "forward_backward", "optimizer", "push_wait", "push",
                                                  "ack") if t.get(name, 0.0) >= 0.005]
    return f"  {row['generators']}+{row['learners']} step {t.get('step', 0.0):.2f} s: " + ", ".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'gen':>4} {'lrn':>4} {'nodes':>5} {'startup_s':>9} {'steps/s':>8} {'push_ms':>8} {'sent_ms':>8} "
            f"{'ack_ms':>8} "
            f"{'raw_ms':>8} {'allred_ms':>9} {'rss_gen':>8} {'rss_lrn':>8} {'rss_sum':>8} {'used_mb':>8} {'est_gb':>7} "
            "versions")
    lines = [head]
    for r in rows:
        lines.append(f"{r['generators']:>4} {r['learners']:>4} {r['nodes']:>5} {r['startup_s']:>9.1f} "
                     f"{r['steps_per_s']:>8.2f} {r['push_s'] * 1e3:>8.1f} {r['push_broadcast_s'] * 1e3:>8.1f} "
                     f"{r.get('push_ack_wait_s', 0.0) * 1e3:>8.1f} "
                     f"{r['raw_broadcast_s'] * 1e3:>8.1f} {r['allreduce_s'] * 1e3:>9.2f} "
                     f"{r['rss_mb_generator']:>8.0f} {r['rss_mb_learner']:>8.0f} {r['rss_mb_sum']:>8.0f} "
                     f"{r.get('machine_used_mb_peak', 0):>8.0f} "
                     f"{r['memory_estimate']['total_gb']:>7.1f} "
                     f"{'complete' if r['versions_complete'] else 'GAPS: ' + '; '.join(r['version_gaps'])}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Start-up and steps/s, push against raw broadcast and all-reduce, peak memory per role, against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["generators"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(ns, [r["startup_s"] for r in rows], "o-", label="start-up (s)")
    ax.set_xlabel("N generators + N learner ranks")
    ax.set_ylabel("seconds")
    twin = ax.twinx()
    twin.plot(ns, [r["steps_per_s"] for r in rows], "s--", color="tab:green", label="steps/s")
    twin.set_ylabel("learner steps/s")
    ax.legend(loc="upper center")
    twin.legend(loc="center right")
    ax.set_title("start-up and training rate")
    ax = axes[1]
    for key, label in (("push_s", "push (in the run)"), ("push_broadcast_s", "push: chunks sent"),
                       ("raw_broadcast_s", "raw broadcast (quiet)"), ("allreduce_s", "learner all-reduce")):
        ax.plot(ns, [max(r[key], 1e-6) * 1e3 for r in rows], "o-", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel("ms (median)")
    ax.legend()
    ax.set_title(f"push of {rows[0]['raw_bytes'] / 1e6:.1f} MB vs raw broadcast")
    ax = axes[2]
    ax.plot(ns, [r["rss_mb_generator"] for r in rows], "o-", label="largest generator")
    ax.plot(ns, [r["rss_mb_learner"] for r in rows], "o-", label="largest learner rank")
    ax.plot(ns, [r["rss_mb_sum"] for r in rows], "o-", label="all roles (sum of RSS peaks)")
    ax.plot(ns, [r.get("machine_used_mb_peak", 0) for r in rows], "s:", label="machine used (peak, Ray too)")
    ax.plot(ns, [r["memory_estimate"]["total_gb"] * 1e3 for r in rows], "x--", label="memory plan (estimate)")
    ax.set_xlabel("N")
    ax.set_ylabel("peak MB")
    ax.legend()
    ax.set_title("peak memory")
    for ax in axes:
        ax.set_xticks(ns)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_row(nodes: Any, n: int, steps: int, reps: int, work: Path, overrides: list[str]) -> dict[str, Any]:
    from nodes import PY

    row_dir = work / f"n{n}"
    out = row_dir / "row.json"
    row_dir.mkdir(parents=True, exist_ok=True)
    cmd = [PY, str(ROOT / "bench" / "scale_job.py"), "--address", nodes.address, "--generators", str(n),
           "--learners", str(n), "--run-dir", str(row_dir / "run"), "--out", str(out), "--reps", str(reps),
           f"train.steps={steps}", *overrides]
    print(f"== {n} generator(s) + {n} learner rank(s) on {nodes.count} nodes (log {row_dir / 'job.log'})", flush=True)
    with UsedMemory() as used:
        code, output = nodes.run_streamed(nodes.head_ns, cmd, row_dir / "job.log",
                                          lambda line: line.startswith(PROGRESS), ROW_TIMEOUT_S)
    if code != 0 or not out.is_file():
        tail = "\n".join(output.splitlines()[-40:])
        raise RuntimeError(f"the {n}+{n} row failed (exit {code}); the end of {row_dir / 'job.log'}:\n{tail}")
    return {**json.loads(out.read_text()), "machine_used_mb_peak": round(used.peak_mb)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in 1, 2, 4 (a few minutes)")
    ap.add_argument("--ns", default="", help="comma-separated N (default 1,2,4,8; --quick 1,2,4)")
    ap.add_argument("--nodes", type=int, default=4, help="namespace nodes of the cluster")
    ap.add_argument("--cpus-per-node", type=int, default=6, help="logical CPUs each Ray node offers")
    ap.add_argument("--steps", type=int, default=8, help="learner steps per row")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the raw broadcast and the all-reduce")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("overrides", nargs="*", help="key=value for every row's job (e.g. model.path=DIR)")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.ns.split(",") if x] or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    from nodes import namespace_cluster

    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.parent / (out.stem + "_rows")
    machine, commit = machine_record(), git_commit()
    print(describe(machine, commit), flush=True)
    memory_mb = machine_memory_mb()
    rows: list[dict[str, Any]] = []
    t0 = time.time()

    def write() -> dict[str, Any]:
        result = stamp({"quick": args.quick, "nodes": args.nodes, "steps": args.steps, "machine_memory_mb":
                        round(memory_mb), "rows": rows, "target": TARGET, "holds": holds(rows, memory_mb)},
                       machine, commit)
        out.write_text(json.dumps(result, indent=2))
        return result

    t_cluster = time.time()
    with namespace_cluster(args.nodes, work / "ray_logs", cpus=args.cpus_per_node, subnet_base=150) as nodes:
        print(f"{args.nodes} namespace nodes with Ray up in {time.time() - t_cluster:.0f} s (head {nodes.address})",
              flush=True)
        for n in ns:
            rows.append(run_row(nodes, n, args.steps, args.reps, work, args.overrides))
            write()  # partial results
    finish(machine)
    result = write()
    if rows:
        plot(rows, out.with_suffix(".png"))
    print("\n" + table(rows))
    print("\nwhere the start-up time goes (seconds; per role its slowest rank's phases):")
    for r in rows:
        print(phase_line(r))
    print("where a training step goes (learner rank 0's mean seconds per phase; wait_data: for generated groups):")
    for r in rows:
        print(step_line(r))
    print(f"\npush_ms: the run's pushes (median, overlapping training on the same cores), of which sent_ms: until the "
          f"learner's chunks are out, ack_ms: until every generator has them and acknowledged; raw_ms: the same "
          f"{rows[-1]['raw_bytes'] / 1e6:.2f} MB to the same generators after training; "
          "allred_ms: the learners' all-reduce of their gradients' size; rss_*: peak MB per process (with children), "
          "rss_sum: of every role and the driver; used_mb: the machine's peak used memory during the row (Ray's "
          "processes too); est_gb: the memory plan's estimate of the whole fleet")
    print(f"target: {TARGET}: {'holds' if result['holds'] else 'does not hold'}")
    print(f"all: {time.time() - t0:.0f} s; {describe(machine, commit)}\nwritten {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
