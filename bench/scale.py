"""The largest fleet this machine holds, rehearsed across network-namespace nodes (issue 32), and how every cost
grows with N: start-up, step, push against raw like with like, all-reduce, memory per role (issue 46).

    flock /tmp/stack.lock python bench/scale.py [--quick | --full] [--ns 1,2,4,8] [--nodes 4] [--steps 8] --out FILE
                                                [--plot docs/scale.png]

Builds one Ray cluster of ``--nodes`` nodes on this machine, once (tests/cluster/nodes.py, the cluster tier's
fixture: one network namespace per node on a bridge, the Ray head on node 0, a worker on each other node), then
for each N runs bench/scale_job.py on node 0: the RL loop with N generators and N learner ranks spread over the
nodes (``resources.placement=spread``), ``--steps`` steps of the tiny model with 54 MB of KV cache per engine.
Needs root and iproute2, like tests/cluster. The driver's start-up progress lines are printed as the job runs.

Per row (``--out`` JSON ``{"machine", "commit", "rows": [...], "target", "holds", "push_target", "push_holds"}``,
bench/machine.py):

    startup_s            from before the policy is resolved until every role started and the push group formed
                         (summary.json's startup_s); startup_s_by_phase: per role the slowest rank's seconds per phase
    steps_per_s          learner steps per second between the first step and the last (warm-up and the final
                         checkpoint left out)
    push_training_s      median over the run's pushes of sync/push_s (start to every generator's acknowledgement:
                         each holds the bytes), overlapping the learners' next step and the generators' work on the
                         same cores; _broadcast_s: until the sender's chunks are out, _ack_wait_s: then until every
                         generator acknowledged (push_s, push_broadcast_s, push_ack_wait_s: the same, older names)
    raw_training_s       the same bytes broadcast from learner rank 0 to the same generator workers on the push's
                         store and transport while the run trains, from its second step (async_rlhf/sync/raw.py:
                         the broadcast plus a 1-element allreduce, every receive posted first: bench/weight_sync's
                         raw); raw_training_during: it ended before the last step did
    push_quiet_s         after training, every role idle: pushes of the same weights as the next versions, each
    raw_quiet_s          generator serving each at once, each push 0.2 s after the last was served; and the raw
                         broadcast (raw_broadcast_s, older name), each sent 0.2 s (raw_quiet_idle_s) after every
                         member posted, as the push: --reps rounds of 3 raw broadcasts sent at once
                         (raw_quiet_at_once_s), 3 sent after the wait and 3 pushes, the medians;
                         push_quiet_sender_run_delay_s: per push the longest any thread of the sender's process
                         waited for a core (schedstat), the median: on shared cores the generators' loads of the
                         version start as each acknowledges and the sender's last hop waits behind them
    serve_training       per push and generator, from the acknowledgement until it serves the version (live),
    serve_quiet          cut at the end of the engine step in progress and the start of the load (the apply):
                         medians, maxima, and how many stayed within one engine step plus the apply plus one poll
                         (async_rlhf/driver/push_timing.py; every pair in <run dir>/push_timeline.json)
    allreduce_s          the learners' all-reduce of as many elements as the trainable parameters (their gradients'
                         size) over their group, after training: per repetition the slowest rank, the median
    rss_mb_generator     peak resident MB of the largest generator actor process and its children (the CPU vLLM
    rss_mb_learner       engine runs inside it), likewise of a learner rank; rss_mb: every role's, rss_mb_sum: all
    pss_mb_generator     the same processes' proportional set size after training (shared pages counted once over
    pss_mb_learner       the machine; the kernel keeps no peak of it); pss_mb_sum: every role's
    machine_used_mb      the machine's peak used memory during the row (total - available, Ray's processes too), less
                         what it used before the namespace cluster was built (other jobs on a shared machine);
                         machine_used_mb_peak: the peak itself, machine_used_mb_before: that baseline
    plan_mb              the memory plan's estimate of the fleet over the cluster's Ray nodes (driver/memory_plan.py)
    versions_complete    every push acknowledged by every generator (an acknowledgement means the member holds that
                         version byte-exact) and every generator ending on the final version

``--quick``: N in 1, 2, 4 (a few minutes); by default 8 + 8 too (about as long again: 16 roles start on 2 cores);
``--full``: 16 + 16 too (``make scale``). Targets: every row's versions complete and the sum of its peak memory
within this machine's; the push within 1.5x the raw broadcast on the quiet fleet, and every generator serving a
version within one engine step plus the apply of its acknowledgement, at every N. Prints a table, where the
start-up and a step's time go, the push's timeline, and writes a plot (``--plot``, default beside ``--out``).
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

TARGET = ("every row: every version reached every generator (versions_complete), and the roles' summed PSS (shared "
          "pages once; the summed RSS peaks where no PSS was taken) within this machine's memory")
PUSH_RATIO = 1.5
PUSH_TARGET = (f"every row: the push within {PUSH_RATIO}x the raw broadcast of its bytes on the quiet fleet, and "
               "every generator serving each pushed version within one engine step plus the apply (plus one poll) "
               "of its acknowledgement")
ROW_TIMEOUT_S = 1800.0
PROGRESS = ("start-up", "step ", "scale:", "stopping", "stalled", "Traceback", "Error")
"""Lines of the job's output printed while it runs (its log file keeps all of them, the actors' too)."""


def machine_memory_mb() -> float:
    import psutil

    return psutil.virtual_memory().total / 1e6


def available_mb() -> float:
    import psutil

    return psutil.virtual_memory().available / 1e6


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
    """:data:`TARGET`. Summed RSS counts the pages forked roles share once per process (16 + 16: 25.7 GB of RSS
    peaks on a 24 GB machine whose used memory peaked at 13 GB), so the summed PSS is what must fit."""
    return bool(rows) and all(r["versions_complete"] and r.get("pss_mb_sum", r["rss_mb_sum"]) <= memory_mb
                              for r in rows)


def push_holds(rows: list[dict[str, Any]]) -> bool:
    """:data:`PUSH_TARGET` over the rows (a row without a quiet push or raw broadcast does not hold it)."""
    return bool(rows) and all(
        r.get("raw_quiet_s", 0) > 0 and r.get("push_quiet_s", 0) > 0
        and r["push_quiet_s"] <= PUSH_RATIO * r["raw_quiet_s"]
        and all(r.get(k, {}).get("bound_held", 0) == r.get(k, {}).get("pairs", -1)
                for k in ("serve_quiet", "serve_training")) for r in rows)


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
    parts = [f"{name} {t[name]:.2f}" for name in ("wait_data", "forward_backward", "optimizer", "metrics", "push_wait",
                                                  "push", "ack", "checkpoint") if t.get(name, 0.0) >= 0.005]
    return f"  {row['generators']}+{row['learners']} step {t.get('step', 0.0):.2f} s: " + ", ".join(parts)


def used_mb(row: dict[str, Any]) -> float:
    return float(row.get("machine_used_mb", row.get("machine_used_mb_peak", 0)))


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'gen':>4} {'lrn':>4} {'nodes':>5} {'startup_s':>9} {'steps/s':>8} {'allred_ms':>9} {'pss_gen':>8} "
            f"{'pss_lrn':>8} {'pss_sum':>8} {'used_mb':>8} {'plan_mb':>8} versions")
    lines = [head]
    for r in rows:
        lines.append(f"{r['generators']:>4} {r['learners']:>4} {r['nodes']:>5} {r['startup_s']:>9.1f} "
                     f"{r['steps_per_s']:>8.2f} {r['allreduce_s'] * 1e3:>9.2f} "
                     f"{r.get('pss_mb_generator', 0):>8.0f} {r.get('pss_mb_learner', 0):>8.0f} "
                     f"{r.get('pss_mb_sum', 0):>8.0f} {used_mb(r):>8.0f} "
                     f"{r.get('plan_mb', r['memory_estimate']['total_gb'] * 1e3):>8.0f} "
                     f"{'complete' if r['versions_complete'] else 'GAPS: ' + '; '.join(r['version_gaps'])}")
    return "\n".join(lines)


def push_table(rows: list[dict[str, Any]]) -> str:
    """The push against the raw broadcast, ms (medians): quiet fleet, then during training (sent / ack wait), then
    from acknowledgement to live (median and max over pushes x generators) and the pairs within the bound."""
    head = (f"{'N+N':>5} {'push_q':>7} {'raw_q':>7} {'ratio':>6} {'raw_0':>6} {'bytes':>6} {'queue':>6} {'push_t':>7} "
            f"{'sent':>6} {'ack':>6} {'raw_t':>7} "
            f"{'serve_q':>8} {'serve_t':>8} {'ack>live':>8} {'max':>7} {'step':>6} {'apply':>6} {'bound':>8} "
            f"{'1 step':>8}")
    lines = [head]
    for r in rows:
        q, t = r.get("serve_quiet", {}), r.get("serve_training", {})
        raw_q, push_q = r.get("raw_quiet_s", 0.0), r.get("push_quiet_s", 0.0)
        raw_t = f"{r.get('raw_training_s', 0.0) * 1e3:>7.1f}" + ("" if r.get("raw_training_during", True) else "*")
        lines.append(
            f"{str(r['generators']) + '+' + str(r['learners']):>5} {push_q * 1e3:>7.1f} {raw_q * 1e3:>7.1f} "
            f"{push_q / raw_q if raw_q else 0.0:>6.2f} {r.get('raw_quiet_at_once_s', 0.0) * 1e3:>6.1f} "
            f"{q.get('bytes_s', 0.0) * 1e3:>6.1f} {r.get('push_quiet_sender_run_delay_s', 0.0) * 1e3:>6.1f} "
            f"{r.get('push_training_s', r.get('push_s', 0.0)) * 1e3:>7.1f} "
            f"{r.get('push_training_broadcast_s', 0.0) * 1e3:>6.1f} "
            f"{r.get('push_training_ack_wait_s', 0.0) * 1e3:>6.1f} "
            f"{raw_t:>7} {q.get('served_s', 0.0) * 1e3:>8.1f} {t.get('served_s', 0.0) * 1e3:>8.1f} "
            f"{t.get('ack_to_live_s', 0.0) * 1e3:>8.1f} {t.get('ack_to_live_s_max', 0.0) * 1e3:>7.1f} "
            f"{t.get('step_s', 0.0) * 1e3:>6.1f} {t.get('apply_s', 0.0) * 1e3:>6.1f} "
            f"{str(t.get('bound_held', 0)) + '/' + str(t.get('pairs', 0)):>8} "
            f"{str(t.get('steps_held', 0)) + '/' + str(t.get('pairs', 0)):>8}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Against N: start-up and steps/s; a step's time by phase; the push against the raw broadcast (quiet and
    during training), serving a version, the all-reduce; memory per role (PSS), the machine's and the plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["generators"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6))
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
    phases = ("wait_data", "forward_backward", "optimizer", "metrics", "push_wait", "checkpoint")
    bottom = [0.0] * len(rows)
    for name in phases:
        values = [r.get("step_time_s", {}).get(name, 0.0) for r in rows]
        ax.bar([str(n) for n in ns], values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    other = [max(r.get("step_time_s", {}).get("step", 0.0) - b, 0.0) for r, b in zip(rows, bottom)]
    ax.bar([str(n) for n in ns], other, bottom=bottom, label="the rest of the step", color="lightgrey")
    ax.set_xlabel("N")
    ax.set_ylabel("seconds (learner rank 0, mean)")
    ax.legend(fontsize=8)
    ax.set_title("a training step")
    ax = axes[2]
    series = (("push_quiet_s", "push, quiet fleet", "o-"), ("raw_quiet_s", "raw broadcast, quiet", "o--"),
              ("push_training_s", "push, during training", "s-"), ("raw_training_s", "raw, during training", "s--"),
              ("allreduce_s", "learner all-reduce", "x:"))
    for key, label, style in series:
        ax.plot(ns, [max(r.get(key, 0.0), 1e-6) * 1e3 for r in rows], style, label=label)
    ax.plot(ns, [max(r.get("serve_training", {}).get("served_s", 0.0), 1e-6) * 1e3 for r in rows], "^-",
            label="push start to every generator serving (training)")
    ax.set_yscale("log")
    ax.set_xlabel("N")
    ax.set_ylabel("ms (median)")
    ax.legend(fontsize=8)
    ax.set_title(f"push of {rows[0]['raw_bytes'] / 1e6:.1f} MB vs raw broadcast")
    ax = axes[3]
    ax.plot(ns, [r.get("pss_mb_generator", 0) for r in rows], "o-", label="largest generator (PSS)")
    ax.plot(ns, [r.get("pss_mb_learner", 0) for r in rows], "o-", label="largest learner rank (PSS)")
    ax.plot(ns, [r.get("pss_mb_sum", 0) for r in rows], "o-", label="every role (summed PSS)")
    ax.plot(ns, [used_mb(r) for r in rows], "s:",
            label="machine used (peak, Ray too)")
    ax.plot(ns, [r.get("plan_mb", r["memory_estimate"]["total_gb"] * 1e3) for r in rows], "x--",
            label="memory plan")
    ax.set_xlabel("N")
    ax.set_ylabel("MB")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("memory")
    for ax in (axes[0], axes[2], axes[3]):
        ax.set_xticks(ns)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_row(nodes: Any, n: int, steps: int, reps: int, work: Path, overrides: list[str],
            used_before_mb: float = 0.0) -> dict[str, Any]:
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
    return {**json.loads(out.read_text()), "machine_used_mb": round(used.peak_mb - used_before_mb),
            "machine_used_mb_peak": round(used.peak_mb), "machine_used_mb_before": round(used_before_mb)}


def cpus_per_node(n: int, nodes: int) -> int:
    """Logical CPUs per Ray node for N generators and N learner ranks of one CPU each, the buffer and a spare,
    spread over ``nodes``: at least 6 (Ray's accounting only; the roles share the machine's cores anyway)."""
    return max(6, -(-(2 * n + 2) // nodes))


def ns_for(quick: bool, full: bool) -> list[int]:
    return [1, 2, 4] if quick else [1, 2, 4, 8, 16] if full else [1, 2, 4, 8]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="N in 1, 2, 4 (a few minutes)")
    size.add_argument("--full", action="store_true", help="N in 1, 2, 4, 8, 16 (make scale)")
    ap.add_argument("--ns", default="", help="comma-separated N (default 1,2,4,8; --quick 1,2,4; --full 1,2,4,8,16)")
    ap.add_argument("--nodes", type=int, default=4, help="namespace nodes of the cluster")
    ap.add_argument("--cpus-per-node", type=int, default=0,
                    help="logical CPUs each Ray node offers (default: enough for the largest row, at least 6)")
    ap.add_argument("--steps", type=int, default=8, help="learner steps per row")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the raw broadcast and the all-reduce")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--plot", type=Path, default=None, help="the figure (default: beside --out, .png)")
    ap.add_argument("overrides", nargs="*", help="key=value for every row's job (e.g. model.path=DIR)")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.ns.split(",") if x] or ns_for(args.quick, args.full)
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
        result = stamp({"quick": args.quick, "full": args.full, "nodes": args.nodes, "steps": args.steps,
                        "machine_memory_mb": round(memory_mb), "rows": rows, "target": TARGET,
                        "holds": holds(rows, memory_mb), "push_target": PUSH_TARGET, "push_holds": push_holds(rows)},
                       machine, commit)
        out.write_text(json.dumps(result, indent=2))
        return result

    used_before = machine_memory_mb() - available_mb()
    t_cluster = time.time()
    cpus = args.cpus_per_node or cpus_per_node(max(ns), args.nodes)
    with namespace_cluster(args.nodes, work / "ray_logs", cpus=cpus, subnet_base=150) as nodes:
        print(f"{args.nodes} namespace nodes with Ray up in {time.time() - t_cluster:.0f} s (head {nodes.address})",
              flush=True)
        for n in ns:
            rows.append(run_row(nodes, n, args.steps, args.reps, work, args.overrides, used_before))
            write()  # partial results
    finish(machine)
    result = write()
    figure = (args.plot or out.with_suffix(".png")).resolve()
    if rows:
        figure.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, figure, describe(machine, commit))
    print("\n" + table(rows))
    print("\nthe push against the raw broadcast of its bytes to the same generators, ms (medians):")
    print(push_table(rows))
    print("where the start-up time goes (seconds; per role its slowest rank's phases):")
    for r in rows:
        print(phase_line(r))
    print("where a training step goes (learner rank 0's mean seconds per phase; wait_data: for generated groups):")
    for r in rows:
        print(step_line(r))
    print(f"\npush_q / raw_q: on the quiet fleet after training (ratio: push / raw), both 0.2 s after the last "
          f"member posted (raw_0: the raw sent at once; bytes: until a member's thread saw every byte of "
          f"the push, the median pair; queue: the longest any thread of the sender waited for a core during a "
          f"quiet push, the median); push_t (sent + ack wait) / raw_t: "
          f"during training (* the raw ended after the last step); the bytes: {rows[-1]['raw_bytes'] / 1e6:.2f} MB "
          "if any row; serve_q / serve_t: from the push's start until every generator serves it; ack>live (max): "
          "from the acknowledgement until a generator serves it, during training, of which step: the engine step "
          "in progress, apply: the load; bound: pairs within one step + the apply + one poll; 1 step: pairs whose "
          "generator began at most one engine step between the acknowledgement and its load. allred_ms: the "
          "learners' all-reduce of their gradients' size; pss_*: MB after training (shared pages once); used_mb: the "
          "machine's peak during the row; plan_mb: the memory plan's estimate" if rows else "")
    print(f"target: {TARGET}: {'holds' if result['holds'] else 'does not hold'}")
    print(f"target: {PUSH_TARGET}: {'holds' if result['push_holds'] else 'does not hold'}")
    print(f"all: {time.time() - t0:.0f} s; {describe(machine, commit)}\nwritten {out} and {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
