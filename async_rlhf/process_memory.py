"""Peak resident memory of a process and its children (Linux /proc), for the per-role figures of a run.

    peak_rss_mb()    VmHWM (the kernel's high-water mark of resident memory) of this process, plus each live
                     descendant's: an upper bound of the tree's peak (their peaks need not coincide). On CPU a
                     generator's vLLM engine runs in the actor's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so
                     its weights and KV cache are counted; children that already exited are not.

    pss_mb(pid)      the proportional set size now (``Pss`` of /proc/<pid>/smaps_rollup): each resident page divided
                     by the processes that map it. Forked roles share the fork server's imported pages (torch, vLLM,
                     DeepSpeed: several hundred MB each) and RSS counts them once per process; summed PSS counts
                     them once for the machine, which is what a fleet costs.
    machine_used_mb() MemTotal - MemAvailable of /proc/meminfo: what the kernel says the machine has in use (page
                     cache it can drop is not counted).

For ``actor.__ray_call__.remote(actor_peak_rss_mb)``: measured inside any Ray actor without a method of its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def status_int(status: str, key: str) -> int:
    """The integer of a /proc/<pid>/status field (``VmHWM:   1234 kB`` -> 1234, in kB); 0 when absent (a kernel
    thread has no VmHWM)."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == key:
            parts = value.split()
            return int(parts[0]) if parts else 0
    return 0


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone meanwhile
        return ""


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, theirs, ...), from each process's parent in /proc."""
    parent: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        ppid = status_int(_status(int(entry.name)), "PPid")
        parent.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parent.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def peak_rss_mb(pid: int | None = None) -> dict[str, float]:
    """``self_mb`` (VmHWM of ``pid``, default this process), ``children_mb`` (of its live descendants),
    ``total_mb`` (both), ``processes`` (1 + descendants), in MB (1e6 bytes)."""
    pid = os.getpid() if pid is None else pid
    own = round(status_int(_status(pid), "VmHWM") * 1024 / 1e6, 1)
    kids = descendants(pid)
    children = round(sum(status_int(_status(c), "VmHWM") for c in kids) * 1024 / 1e6, 1)
    # the total of the rounded parts: the three figures add up as printed
    return {"self_mb": own, "children_mb": children, "total_mb": round(own + children, 1),
            "processes": float(1 + len(kids))}


def rollup_kb(text: str, key: str = "Pss") -> int:
    """A field of /proc/<pid>/smaps_rollup in kB (``Pss:   1234 kB`` -> 1234); 0 when absent (the format of
    /proc/<pid>/status: ``status_int``)."""
    return status_int(text, key)


def pss_mb(pid: int) -> float:
    """Proportional set size of ``pid`` now, MB (1e6 bytes); 0 when it is gone or unreadable (another user's)."""
    return pss_split_mb(pid)["pss"]


def pss_split_mb(pid: int) -> dict[str, float]:
    """``pss`` of ``pid`` now and its parts ``anon`` (heaps, the KV cache, copied-on-write pages: what the machine
    must hold) and ``file`` (mapped files: shared libraries, weights read by mmap; page cache the kernel may drop
    and read again), MB; zeros when it is gone or unreadable."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        text = ""
    return {key.lower(): rollup_kb(text, field) * 1024 / 1e6
            for key, field in (("pss", "Pss"), ("anon", "Pss_Anon"), ("file", "Pss_File"), ("shmem", "Pss_Shmem"))}


def meminfo_used_mb(meminfo: str) -> float:
    """``MemTotal - MemAvailable`` of a /proc/meminfo text, MB."""
    return (status_int(meminfo, "MemTotal") - status_int(meminfo, "MemAvailable")) * 1024 / 1e6


def machine_used_mb() -> float:
    """Memory the machine has in use now, MB: :func:`meminfo_used_mb` of /proc/meminfo."""
    return meminfo_used_mb(Path("/proc/meminfo").read_text())


def actor_peak_rss_mb(_actor: Any) -> dict[str, float]:
    """For ``actor.__ray_call__.remote(actor_peak_rss_mb)``: :func:`peak_rss_mb` of the actor's process."""
    return peak_rss_mb()
