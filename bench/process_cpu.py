"""Our side's CPU by kind of process, for bench/vs_trl.py: :func:`classify` puts a process of the launcher's tree
in a kind (:data:`KINDS`) by its name and command line (Ray's and vLLM's process titles), :class:`ProcessCpu`
reads the tree every few seconds over a window (a process that appears later counts from 0; one that ends keeps
its last reading), :func:`tree_cpu_s` is the tree's CPU seconds so far."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

KINDS = ("engine", "learner", "buffer", "ray", "driver", "forkserver", "other")
"""The kinds of process our side's CPU is broken down by (:func:`classify`); TRL's one process is ``trl``."""
RAY_TITLES = {"GeneratorActor": "engine", "LearnerActor": "learner", "BufferActor": "buffer", "IDLE": "ray",
              "DashboardAgent": "ray", "RuntimeEnvAgent": "ray"}
"""Ray workers' titles (``ray::<title>``, set by Ray with setproctitle): ``ray::GeneratorActor`` between tasks,
``ray::GeneratorActor.<method>`` while one runs, ``ray::IDLE`` (or ``ray::IDLE_SpillWorker``) for a worker with
no actor, ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent`` for Ray's agents. Any other title is a task or
actor of ours (start-up board, held-out evaluation): ``other``."""
RAY_PROGRAMS = ("raylet", "gcs_server", "plasma_store")
RAY_SCRIPTS = ("log_monitor.py", "monitor.py", "dashboard/dashboard.py", "dashboard/agent.py",
               "runtime_env/agent/main.py", "ray.util.client.server", "default_worker.py", "setup_worker.py")
"""Ray's Python processes by their script (the last two: a worker not yet past its start, before it sets its title)."""
FORKSERVER = "async_rlhf.startup.forkserver"
"""Module of the role fork server: the server (``-m ... --serve``/``--early``), the wrappers the raylet runs for
each forked role (``-m ... default_worker.py ...``) and a forked child before Ray gives it its title."""
SAMPLE_EVERY_S = 2.0
"""Seconds between two readings of our process tree's CPU times over the training window (a process that ends
between two readings loses at most this much of its CPU time)."""


def classify(name: str, cmdline: Sequence[str]) -> str:
    """The kind (one of :data:`KINDS`) of a process of our side's tree, from ``psutil.Process.name()`` and
    ``cmdline()``. A process title set by setproctitle is the first argument, padded with empty ones (and the
    name, which psutil completes from it; ``/proc/PID/comm`` alone keeps 15 characters: ``ray::GeneratorA``)."""
    args = [a for a in cmdline if a]
    first = args[0] if args else ""
    title = first if first.startswith(("ray::", "VLLM::")) else name
    if title.startswith("VLLM::"):  # vLLM's engine core (and its workers) in processes of their own
        return "engine"
    if title.startswith("ray::"):
        return ray_title_kind(title[len("ray::"):])
    text = " ".join(args)
    program = os.path.basename(first.split(" ")[0]) if first else ""
    if name in RAY_PROGRAMS or program in RAY_PROGRAMS:
        return "ray"
    if FORKSERVER in text:  # before the Ray scripts: a wrapper's arguments name default_worker.py
        return "forkserver"
    if any(script in text for script in RAY_SCRIPTS):
        return "ray"
    if any(a.endswith(("launch/cluster.py", "launch.cluster")) for a in args):
        return "driver"
    return "other"


def ray_title_kind(title: str) -> str:
    """The kind of a Ray worker from its title without ``ray::``: ``GeneratorActor.run`` or ``GeneratorActor``,
    or its first 10 characters in a bare ``/proc/PID/comm`` (``GeneratorA``)."""
    head = title.split(".")[0].split("(")[0].strip()
    if head.startswith("IDLE"):
        return "ray"
    for known, kind in RAY_TITLES.items():
        if head == known or (len(title) == 10 and len(head) >= 4 and known.startswith(head)):
            return kind
    return "other"


Key = tuple[int, float]
"""A process: (pid, create time), so that a reused pid is another process."""


def process_readings(root_pid: int, root_kind: str = "driver") -> dict[Key, tuple[str, str, float]]:
    """``{(pid, create time): (kind, title, CPU seconds so far)}`` for process ``root_pid`` (its kind is
    ``root_kind``) and every live descendant: the driver, Ray's own processes and every actor (Ray starts them
    under the driver when it starts the cluster itself). CPU seconds are user + system, all threads."""
    import psutil

    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[Key, tuple[str, str, float]] = {}
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            with proc.oneshot():
                times, name, key = proc.cpu_times(), proc.name(), (proc.pid, proc.create_time())
                try:
                    cmdline = proc.cmdline()
                except (psutil.AccessDenied, psutil.ZombieProcess):
                    cmdline = []
            kind = root_kind if proc.pid == root_pid else classify(name, cmdline)
            title = next((a for a in cmdline if a), name)[:100]
            out[key] = (kind, title, times.user + times.system)
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and every live descendant."""
    return sum(cpu for _, _, cpu in process_readings(pid).values())


def cpu_by_kind(start: dict[Key, float], last: dict[Key, tuple[str, str, float]]) -> dict[str, float]:
    """CPU seconds per kind over a window: each process's last reading less its reading at the start (0 for one
    that appeared later; one that ended keeps its last reading). Every kind of :data:`KINDS` is there."""
    out = dict.fromkeys(KINDS, 0.0)
    for key, (kind, _, cpu) in last.items():
        out[kind] = out.get(kind, 0.0) + max(0.0, cpu - start.get(key, 0.0))
    return out


class ProcessCpu:
    """Our side's CPU by kind of process over a window: :meth:`begin`, :meth:`sample` every few seconds (to
    catch the processes that end before the window does), :meth:`end`."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.start: dict[Key, float] = {}
        self.last: dict[Key, tuple[str, str, float]] = {}

    def begin(self) -> None:
        self.last = process_readings(self.root_pid)
        self.start = {key: cpu for key, (_, _, cpu) in self.last.items()}

    def sample(self) -> None:
        self.last.update(process_readings(self.root_pid))  # the latest title wins (an idle worker turned actor)

    def end(self) -> dict[str, Any]:
        """``{"by_process": {kind: CPU s}, "other_processes": {title: CPU s}}`` (the ten busiest ``other``)."""
        self.sample()
        other: dict[str, float] = {}
        for key, (kind, title, cpu) in self.last.items():
            if kind == "other":
                other[title] = other.get(title, 0.0) + max(0.0, cpu - self.start.get(key, 0.0))
        busiest = sorted(other.items(), key=lambda kv: -kv[1])[:10]
        return {"by_process": cpu_by_kind(self.start, self.last),
                "other_processes": {title: round(cpu, 3) for title, cpu in busiest}}
