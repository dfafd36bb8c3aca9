"""Every benchmark with a stated target, one after another, into one JSON a script can read.

    flock /tmp/heavy.lock python bench/all.py [--quick] --out FILE [--only buffer,weight_sync,...]

Runs bench/buffer.py, bench/weight_sync.py, bench/pipeline.py, bench/vs_trl.py and bench/scale.py (each in its own
process, with its own ``--out`` in a scratch directory beside FILE; scale builds network namespaces: root) and writes

    {"machine": {...}, "commit": "...", "quick": bool, "holds": bool,
     "benches": [{"name", "target", "holds", "rows": [...], "seconds", "error", "result"}]}

``holds`` is each bench's own pass/fail against the target it states (read from its JSON); a bench that
failed (an error naming a row that measured too little, a crash) has ``holds: false`` and its ``error``.
A row with a rate of 0 is an error too. Exit status 1 when a bench failed (a missed target is a result: 0).
``--quick`` runs each bench's ``--quick`` (vs_trl on one task with a shorter budget: its full run is 3 tasks
x 2 sides x 600 s; scale with N up to 4) and takes about 15-20 minutes on 2 cores.

The lock is the caller's: every bench here starts processes that load both cores, so run the whole of it
under ``flock /tmp/heavy.lock`` on a shared machine (it does not take the lock itself: a bench it starts
would wait on it forever).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import describe, finish, git_commit, machine_record  # noqa: E402


def buffer_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    keep = ("store", "payload_bytes", "producers", "consumers", "msgs_per_s", "raw_msgs_per_s", "ratio",
            "relay_msgs_per_s", "relay_ratio", "p50_ms", "p99_ms")
    return [{k: r[k] for k in keep if k in r} for r in data["rows"]]


def weight_sync_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    keep = ("params", "dtype", "layout", "storage", "receivers", "bytes", "raw_s", "push_s", "ratio",
            "ratio_interval", "pause_s", "reps")
    return [{k: r[k] for k in keep if k in r} for r in data["rows"]]


def pipeline_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"variant": name, "generator_alone_generated_per_s": v["standalone"]["generator_samples_per_s"],
             "learner_alone_trained_per_s": v["standalone"]["learner_samples_per_s"],
             "async_trained_per_s": v["async"]["samples_per_s"],
             "async_generated_per_s": v["async"]["generated_samples_per_s"],
             "sync_trained_per_s": v["sync"]["samples_per_s"], "kept_fraction": v["kept_fraction"],
             "bottleneck": v["bottleneck"], "efficiency": v["efficiency"], "efficiency_basis": v["efficiency_basis"],
             "async_over_sync": v["async_over_sync"], "generator_busy_fraction": v["async"]["generator_busy_fraction"]}
            for name, v in data["variants"].items()]


def scale_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    keep = ("generators", "learners", "nodes", "startup_s", "startup_s_by_phase", "steps_per_s", "push_s",
            "raw_broadcast_s", "allreduce_s", "rss_mb_generator", "rss_mb_learner", "versions_complete")
    return [{k: r[k] for k in keep if k in r} for r in data["rows"]]


def vs_trl_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for t in data["tasks"]:
        reached = t["time_to_trl_accuracy_s"]
        out.append({"task": t["task"], "trl_accuracy_end": t["trl_accuracy_end"], "trl_time_s": t["trl_time_s"],
                    "time_to_trl_accuracy_s": reached,
                    "ratio_to_trl_time": None if reached is None else reached / t["trl_time_s"],
                    "trl_samples_per_s": t["trl_samples_per_s"], "ours_samples_per_s": t["ours_samples_per_s"],
                    "ours_generated_samples_per_s": t["ours_generated_samples_per_s"]})
    return out


@dataclass
class Bench:
    name: str
    script: str
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]]
    rate_keys: tuple[str, ...]  # a row with 0 (or less) in one of these measured nothing
    quick: list[str] = field(default_factory=list)
    """Arguments of its --quick run (the full run takes the script's defaults)."""


BENCHES = [
    Bench("buffer", "buffer.py", buffer_rows, ("msgs_per_s", "raw_msgs_per_s", "relay_msgs_per_s"), ["--quick"]),
    Bench("weight_sync", "weight_sync.py", weight_sync_rows, ("raw_s", "push_s"), ["--quick"]),
    Bench("pipeline", "pipeline.py", pipeline_rows,
          ("generator_alone_generated_per_s", "learner_alone_trained_per_s", "async_trained_per_s",
           "async_generated_per_s", "sync_trained_per_s"), ["--quick"]),
    # one task (where RL takes minutes: the other two saturate within seconds on both sides), a shorter budget
    Bench("vs_trl", "vs_trl.py", vs_trl_rows, ("trl_samples_per_s", "ours_samples_per_s"),
          ["--tasks", "addition3", "--budget-s", "90"]),
    # N generators + N learner ranks over 4 namespace nodes: N in 1, 2, 4 (--quick), also 8 in the full run
    Bench("scale", "scale.py", scale_rows, ("startup_s", "steps_per_s", "push_s", "raw_broadcast_s"), ["--quick"]),
]


def zero_rates(name: str, rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[str]:
    """One line per row with a rate of 0 (or none at all where one is due)."""
    bad = []
    for i, row in enumerate(rows):
        for key in keys:
            value = row.get(key)
            if not isinstance(value, (int, float)) or value <= 0:
                bad.append(f"{name} row {i} ({row_label(row)}): {key} = {value!r}")
    return bad


def row_label(row: dict[str, Any]) -> str:
    label = [str(row[k]) for k in ("store", "variant", "task", "params", "dtype", "layout", "storage",
                                   "receivers", "payload_bytes", "generators") if k in row]
    return " ".join(label)


def entry(bench: Bench, data: dict[str, Any] | None, seconds: float, error: str | None) -> dict[str, Any]:
    """The bench's record in the combined file, from its own JSON (``None`` when it wrote none)."""
    rows: list[dict[str, Any]] = []
    if data is not None and error is None:
        try:
            rows = bench.rows(data)
        except (KeyError, TypeError) as exc:
            error = f"{bench.name}: its JSON lacks {exc}"
    if error is None and not rows:
        error = f"{bench.name}: no rows"
    if error is None:
        zeros = zero_rates(bench.name, rows, bench.rate_keys)
        error = "; ".join(zeros) or None
    target = (data or {}).get("target", "")
    holds = error is None and bool((data or {}).get("holds"))
    return {"name": bench.name, "target": target, "holds": holds, "rows": rows, "seconds": round(seconds, 1),
            "error": error, "commit": (data or {}).get("commit"), "machine": (data or {}).get("machine")}


def run(bench: Bench, quick: bool, scratch: Path, timeout_s: float, extra: list[str] = ()) -> dict[str, Any]:
    out = scratch / bench.name / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "bench" / bench.script), *(bench.quick if quick else []), *extra,
           "--out", str(out)]
    print(f"== {bench.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    log = out.parent / "log.txt"
    error = None
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
            if proc.returncode != 0:
                error = f"{bench.name} exited with {proc.returncode}: {last_line(log)}"
        except subprocess.TimeoutExpired:
            error = f"{bench.name} did not finish within {timeout_s:.0f} s"
    seconds = time.time() - t0
    data = json.loads(out.read_text()) if out.is_file() else None
    if data is None and error is None:
        error = f"{bench.name} wrote no {out}"
    got = entry(bench, data, seconds, error)
    got["log"] = str(log)
    print(f"   {'holds' if got['holds'] else 'does not hold'} ({seconds:.0f} s): {got['target']}"
          + (f"\n   error: {got['error']}" if got["error"] else ""), flush=True)
    return got


def last_line(log: Path) -> str:
    """The error a failed bench ended with (its last non-empty line)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def combine(machine: dict[str, Any], commit: str, quick: bool, benches: list[dict[str, Any]]) -> dict[str, Any]:
    return {"machine": machine, "commit": commit, "quick": quick,
            "holds": bool(benches) and all(b["holds"] for b in benches), "benches": benches}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="each bench's --quick (about 10-15 minutes on 2 cores)")
    ap.add_argument("--out", required=True, type=Path, help="the combined JSON")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(b.name for b in BENCHES))
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="longest run of one bench")
    ap.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                    help="more arguments for one bench, after its own (repeatable), e.g. 'buffer=--precision 0.2'")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or [b.name for b in BENCHES]
    extra = {}
    for item in args.args:
        name, _, rest = item.partition("=")
        extra[name] = shlex.split(rest)
    unknown = (set(names) | set(extra)) - {b.name for b in BENCHES}
    if unknown:
        ap.error(f"unknown bench(es) {sorted(unknown)}")
    out = args.out.resolve()
    scratch = out.parent / (out.stem + "_benches")
    machine, commit = machine_record(), git_commit()
    print(describe(machine, commit), flush=True)
    t0 = time.time()
    benches = []
    for bench in (b for b in BENCHES if b.name in names):
        benches.append(run(bench, args.quick, scratch, args.timeout_s, extra.get(bench.name, [])))
        out.write_text(json.dumps(combine(machine, commit, args.quick, benches), indent=2))  # partial results
    finish(machine)
    result = combine(machine, commit, args.quick, benches)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'bench':<12} {'holds':<6} {'seconds':>8}  target")
    for b in benches:
        print(f"{b['name']:<12} {str(b['holds']):<6} {b['seconds']:>8.0f}  {b['target']}"
              + (f"\n{'':<28}error: {b['error']}" if b["error"] else ""))
    print(f"all: {time.time() - t0:.0f} s; {describe(machine, commit)}\nwritten {out} (each bench's own output in "
          f"{scratch})")
    return 1 if any(b["error"] for b in benches) else 0  # a missed target is a result; a failed bench is not


if __name__ == "__main__":
    raise SystemExit(main())
