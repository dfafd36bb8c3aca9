"""What a fleet costs in memory, measured while it runs, against the memory plan (issue 46, items 1 and 2).

    python bench/fleet_memory.py --generators 16 --learners 16 [--out row.json] [key=value ...]

Runs ``launch/cluster.py --generators N --learners M run.overwrite=true run.dir=... key=value ...`` (``train.steps=5``
unless given) and reads, every ``--every`` seconds until it ends:

    machine_used_mb   MemTotal - MemAvailable, less its value before the launch (the fleet's own)
    pss               the proportional set size of each process of the run (the launcher's descendants and any new
                      process bench/process_cpu.py's classify names: Ray's, the fork servers and their children),
                      by kind (engine = a generator, learner, buffer, ray, driver, forkserver, other): pages shared
                      by forked roles count once in the sum

and prints and writes one row: the peaks of both, the largest generator's and learner rank's PSS, the sum by kind
at the peak, and the plan (async_rlhf/driver/memory_plan.py, the run's own config) with its error against both
peaks. Starts Ray and vLLM: run it under ``flock /tmp/stack.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from process_cpu import classify  # noqa: E402

from async_rlhf.process_memory import descendants, machine_used_mb, pss_split_mb  # noqa: E402


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def process_kind(pid: int) -> str:
    """:func:`classify` of a live process from /proc (its title, its command line)."""
    cmdline = _read(f"/proc/{pid}/cmdline").split("\0")
    name = _read(f"/proc/{pid}/comm").strip()
    return classify(name, cmdline)


def fleet_pids(root: int, before: set[int]) -> list[int]:
    """The run's processes: ``root``'s descendants, and every process started since (not in ``before``) that
    :func:`classify` recognises (a fork server or Ray process whose parent is no longer in the tree)."""
    tree = set(descendants(root)) | {root}
    new = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()} - before - tree
    return sorted(tree | {p for p in new if process_kind(p) != "other"})


def sample(root: int, before: set[int]) -> dict[str, Any]:
    """One reading: PSS of every process of the run (pid -> (kind, MB)) and the machine's used memory."""
    procs, parts = {}, {"anon": 0.0, "file": 0.0, "shmem": 0.0}
    for p in fleet_pids(root, before):
        split = pss_split_mb(p)
        procs[p] = (process_kind(p), split["pss"])
        for key in parts:
            parts[key] += split[key]
    return {"time": time.time(), "machine_used_mb": machine_used_mb(), "procs": procs, "parts": parts}


def summarise(readings: list[dict[str, Any]], baseline_mb: float) -> dict[str, Any]:
    """The peaks over ``readings``: machine used (less ``baseline_mb``), summed PSS and its split by kind at that
    reading, and the largest single generator (``engine``) and learner rank over the whole run."""
    sums = [sum(mb for _, mb in r["procs"].values()) for r in readings]
    at = max(range(len(readings)), key=sums.__getitem__)
    by_kind: dict[str, float] = {}
    for kind, mb in readings[at]["procs"].values():
        by_kind[kind] = round(by_kind.get(kind, 0.0) + mb, 1)
    counts: dict[str, int] = {}
    for kind, _ in readings[at]["procs"].values():
        counts[kind] = counts.get(kind, 0) + 1

    def largest(kind: str) -> float:
        return round(max((mb for r in readings for k, mb in r["procs"].values() if k == kind), default=0.0), 1)

    used = max(r["machine_used_mb"] for r in readings)
    return {"machine_used_mb": round(used - baseline_mb, 1), "machine_used_abs_mb": round(used, 1),
            "baseline_mb": round(baseline_mb, 1), "pss_sum_mb": round(sums[at], 1), "pss_mb_by_kind": by_kind,
            "processes_by_kind": counts, "pss_parts_mb": {k: round(v, 1) for k, v in readings[at]["parts"].items()},
            "pss_mb_generator": largest("engine"), "pss_mb_learner": largest("learner"),
            "readings": len(readings)}


def plan_mb(generators: int, learners: int, overrides: list[str]) -> dict[str, Any]:
    """The memory plan of the run's config (``launch/cluster.py``'s ``plan_for``), in MB."""
    from async_rlhf.config import load_config
    from async_rlhf.driver.memory_plan import plan_for

    cfg = load_config(None, [f"generators={generators}", f"learners={learners}", *overrides])
    plan = plan_for(cfg)
    return {"plan_mb": round(plan.total_gb() * 1000, 1), "plan": plan.to_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, required=True)
    p.add_argument("--learners", type=int, required=True)
    p.add_argument("--every", type=float, default=1.0, help="seconds between readings")
    p.add_argument("--timeout", type=float, default=600.0, help="end the run (SIGTERM, then SIGKILL) after this")
    p.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "fleet_memory")
    p.add_argument("--out", type=Path)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    overrides = list(args.overrides)
    if not any(o.startswith("train.steps=") for o in overrides):
        overrides.append("train.steps=5")
    plan = plan_mb(args.generators, args.learners, overrides)
    before = {int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()}
    baseline = machine_used_mb()
    cmd = [sys.executable, str(ROOT / "launch" / "cluster.py"), "--generators", str(args.generators), "--learners",
           str(args.learners), "run.overwrite=true", f"run.dir={args.run_dir}", *overrides]
    t0 = time.time()
    log = (args.run_dir.parent / f"{args.run_dir.name}.console.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as console:
        proc = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        print(f"fleet_memory: pid {proc.pid}: {' '.join(cmd[1:])} (console: {log})", flush=True)
        readings = []
        try:
            while proc.poll() is None:
                readings.append(sample(proc.pid, before))
                if time.time() - t0 > args.timeout:
                    os.killpg(proc.pid, 15)
                    time.sleep(10)
                    os.killpg(proc.pid, 9)
                    break
                time.sleep(args.every)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    rc = proc.wait()
    row = {"generators": args.generators, "learners": args.learners, "rc": rc, "wall_s": round(time.time() - t0, 1),
           "overrides": overrides, **summarise(readings, baseline), **plan}
    for key in ("machine_used_mb", "pss_sum_mb"):
        row[f"plan_error_{key}"] = round(row["plan_mb"] / row[key] - 1, 3) if row[key] else None
    summary = args.run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        row["summary"] = {k: s[k] for k in ("steps", "heldout_accuracy_start", "heldout_accuracy_end",
                                            "final_accuracy", "initial_accuracy") if k in s}
    print(json.dumps({k: v for k, v in row.items() if k != "readings"}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
