"""The machine and the commit a benchmark figure was measured on, in one place for every bench.

The same bench gives 0.5x-2x between two machines of the same kind, and the machine here is shared: a figure
without the CPU model, the cores it could use, the load average before and after it, and the commit of the
code is not reproducible. Every bench's JSON carries ``{"machine": ..., "commit": ...}`` and every printed
table starts (and ends) with :func:`describe`'s lines.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_model(cpuinfo: str | None = None) -> str:
    """The first ``model name`` of /proc/cpuinfo (Linux), else what ``platform`` knows."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_commit(root: Path = ROOT) -> str:
    """``git rev-parse HEAD`` of the tree the bench runs from, ``+dirty`` when tracked files differ from it
    (the figure is then of uncommitted code), ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine_record() -> dict[str, Any]:
    """The machine now; call :func:`finish` on it when the bench is done (adds the load average after)."""
    return {"cpu_model": cpu_model(), "cores": os.cpu_count() or 0,
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "hostname": platform.node(), "load_average_before": load_average(), "load_average_after": None}


def finish(machine: dict[str, Any]) -> dict[str, Any]:
    machine["load_average_after"] = load_average()
    return machine


def stamp(result: dict[str, Any], machine: dict[str, Any], commit: str) -> dict[str, Any]:
    """``result`` with the machine and commit first (a result file is read top down)."""
    return {"machine": machine, "commit": commit, **result}


def describe(machine: dict[str, Any], commit: str) -> str:
    """One line for the top (and, with the load after, the bottom) of a printed table."""
    after = machine.get("load_average_after")
    load = " ".join(f"{x:.2f}" for x in machine["load_average_before"])
    if after is not None:
        load += " before, " + " ".join(f"{x:.2f}" for x in after) + " after"
    return (f"machine: {machine['cpu_model']}, {machine['cores']} cores ({machine['usable_cores']} usable), "
            f"load average (1/5/15 min) {load}; commit {commit}")
