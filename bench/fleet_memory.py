"""What a fleet costs in memory, measured while it runs, against the memory plan (issue 46, items 1 and 2).

    python bench/fleet_memory.py --generators 16 --learners 16 [--out row.json] [key=value ...]

Runs ``launch/cluster.py --generators N --learners M run.overwrite=true run.dir=... key=value ...`` (``train.steps=5``
unless given) and reads, every ``--every`` seconds until it ends:

    machine_used_mb   MemTotal - MemAvailable less the anonymous PSS of every process outside the run, less the same
                      before the launch and after the run (their mean): the run's own (other work on a shared
                      machine moves the raw figure, machine_used_raw_mb, by hundreds of MB)
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
    fleet = fleet_pids(root, before)
    for p in fleet:
        split = pss_split_mb(p)
        procs[p] = (process_kind(p), split["pss"])
        for key in parts:
            parts[key] += split[key]
    return {"time": time.time(), "machine_used_mb": machine_used_mb(), "procs": procs, "parts": parts,
            "others_anon_mb": others_anon_mb(set(fleet))}


def others_anon_mb(fleet: set[int]) -> float:
    """Anonymous PSS of every process outside the run (other people's work on a shared machine): what the
    machine's used memory moved by that the run did not move."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    return sum(pss_split_mb(p)["anon"] for p in pids if p not in fleet)


def summarise(readings: list[dict[str, Any]], baseline_mb: float, after_mb: float | None = None) -> dict[str, Any]:
    """The peaks over ``readings``: machine used (less the mean of ``baseline_mb`` and ``after_mb``, the machine
    without the run before and after it), summed PSS and its split by kind at that reading, and the largest single
    generator (``engine``) and learner rank over the whole run."""
    after_mb = baseline_mb if after_mb is None else after_mb
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
    own = max(r["machine_used_mb"] - r["others_anon_mb"] for r in readings)
    raw = used - readings[0]["baseline_used_mb"]
    return {"machine_used_mb": round(own - (baseline_mb + after_mb) / 2, 1), "machine_used_raw_mb": round(raw, 1),
            "machine_used_abs_mb": round(used, 1), "baseline_mb": round(baseline_mb, 1),
            "baseline_after_mb": round(after_mb, 1),
            "pss_sum_mb": round(sums[at], 1), "pss_mb_by_kind": by_kind, "processes_by_kind": counts,
            "pss_parts_mb": {k: round(v, 1) for k, v in readings[at]["parts"].items()},
            "pss_mb_generator": largest("engine"), "pss_mb_learner": largest("learner"),
            "readings": len(readings)}


def run_checks(run_dir: Path, generators: int) -> dict[str, Any]:
    """What the run itself says: steps, held-out accuracy at the start and the end, whether every push but the last
    (whose figures no step's record carries) was acknowledged by all ``generators`` with none dropped, and the
    prompts trained against the distinct ones (data_ledger.jsonl: each prompt trained once)."""
    out: dict[str, Any] = {}
    summary = run_dir / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        out.update({k: s.get(k) for k in ("steps", "accuracy_start", "accuracy_end", "startup_s", "final_version")})
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        pushes = [r for r in records if "sync/version" in r]
        out["pushes_to_all"] = sum(1 for r in pushes if int(r.get("sync/members", 0)) == generators
                                   and not float(r.get("sync/dropped", 0.0)))
        out["pushes_recorded"] = len(pushes)
    ledger = run_dir / "data_ledger.jsonl"
    if ledger.is_file():
        keys = [k for line in ledger.read_text().splitlines() if line.strip()
                for k in json.loads(line).get("prompt_keys", [])]
        out["prompts_trained"], out["prompts_distinct"] = len(keys), len(set(keys))
    return out


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
    raw_baseline = machine_used_mb()
    baseline = raw_baseline - others_anon_mb(set())
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
                readings.append({**sample(proc.pid, before), "baseline_used_mb": raw_baseline})
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
    time.sleep(5)  # the run's processes gone: the machine's used memory without them, once more
    after = machine_used_mb() - others_anon_mb(set())
    row = {"generators": args.generators, "learners": args.learners, "rc": rc, "wall_s": round(time.time() - t0, 1),
           "overrides": overrides, **summarise(readings, baseline, after), **plan}
    for key in ("machine_used_mb", "pss_sum_mb"):
        row[f"plan_error_{key}"] = round(row["plan_mb"] / row[key] - 1, 3) if row[key] else None
    row.update(run_checks(args.run_dir, args.generators))
    print(json.dumps({k: v for k, v in row.items() if k != "readings"}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
