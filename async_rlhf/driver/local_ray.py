"""The Ray a run starts on this machine when it is given none (the launcher, ``Cluster`` in a script or a bench, the
tests' shared Ray, the test tier's namespace nodes): no idle workers started ahead of need or kept after it, and a
log monitor that looks for new log files less often.

Ray starts idle Python workers with a node and again when the first driver connects (up to one per logical CPU),
so that the first tasks start at once. A run's roles are long-lived actors, each started once in a worker of its
own; the prestarted workers only take cores while the roles import vLLM and DeepSpeed, then sit idle, polling,
for the whole run. Measured on 2 cores: a 1 + 1 launch reaches its first step ~1 s sooner, and an idle 16-CPU
Ray used 0.08 of the machine with them, 0.04 without (docs/testing.md).

Ray also keeps the worker of a finished task, idle, for the next task of the same runtime environment, up to one
per logical CPU (``num_workers_soft_limit``). A run's tasks are few and each run has a runtime environment of its
own (the node probe of a run on a Ray it joined), so on a Ray that outlives its runs (the tests' shared Ray, a
script's ``Cluster`` after ``Cluster``) the idle workers piled up: 9-13 at ~2 % of a core each in a suite run.
With a soft limit of 0 the raylet ends an idle worker after a second; 6 such tasks on a 16-CPU Ray left 7 idle
workers and Ray's processes used 14 % of a core, with the limit none and 4.5 %.

The log monitor (one per node) looks for new worker log files every 0.1 s while a node has fewer than 1000
(``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD``), globbing the session's log directory each time: ~9 % of a core per node
in the test tier's namespace cluster. With the threshold at 0 it looks every ``LOG_NAME_UPDATE_INTERVAL_S`` (2 s
here); the lines of a file it already follows are still forwarded every 0.1 s, and a new file is read from its
start.

Ray reads these variables when its processes start; one already set by the user wins.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

LOCAL_RAY_ENV = {
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_num_workers_soft_limit": "0",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "2",
}


START_TIMED_OUT = "timed out during startup"
"""What ``ray.init`` raises when the raylet it started has not registered with the GCS within Ray's fixed 30 s:
seen on a loaded 2-core machine (two stacks starting beside it), where the same start takes 20 s with ten busy
processes beside it."""


def start_local_ray(num_cpus: int, env_vars: dict[str, str], attempts: int = 3, log_to_driver: bool = True) -> None:
    """A Ray of this process's own (``address="local"``: never one an earlier ``ray start`` left in
    /tmp/ray/ray_current_cluster), ``num_cpus`` logical CPUs, ``env_vars`` in every worker, no prestarted
    workers; ``log_to_driver=False``: the workers' output is not printed by this process (a run's roles write
    their own logs, async_rlhf/run_logs.py). A start that timed out (:data:`START_TIMED_OUT`) has its processes
    stopped (by pid: the children this call started) and is tried again, up to ``attempts`` starts. The module
    docstring says what :data:`LOCAL_RAY_ENV` changes."""
    import ray

    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)  # the raylet and GCS this call starts inherit them
    for attempt in range(1, attempts + 1):
        before = child_pids()
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=log_to_driver, num_cpus=num_cpus,
                     runtime_env={"env_vars": env_vars})
            return
        except Exception as exc:
            if START_TIMED_OUT not in str(exc):
                raise
            stopped = stop_children_since(before)
            if attempt == attempts:
                raise RuntimeError(
                    f"the local Ray did not come up: {attempts} starts each timed out after Ray's 30 s waiting for "
                    f"its raylet to register (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores). "
                    "Start the run when the machine is less busy, or start Ray yourself (`ray start --head`) and "
                    "pass --address") from exc
            logger.warning("the local Ray's raylet did not register within Ray's 30 s (load average %.1f): stopped "
                           "its %d processes, starting it again (start %d of %d)", os.getloadavg()[0], len(stopped),
                           attempt + 1, attempts)


def child_pids() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def is_ray_process(cmdline: list[str]) -> bool:
    """Whether a command line is one of Ray's own processes: a binary or script of the ray package (GCS, raylet,
    dashboard, monitors) or a process that retitled itself ``ray::...`` (the dashboard and runtime-env agents)."""
    return any("/ray/" in arg for arg in cmdline) or bool(cmdline and cmdline[0].startswith("ray::"))


def stop_children_since(before: set[int], grace_s: float = 5.0) -> list[int]:
    """Kill this process's descendants that were not there in ``before`` and are Ray's (what a failed start left;
    a child another thread of the driver started meanwhile is not touched); returns their pids."""
    import psutil

    new = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid not in before and is_ray_process(proc.cmdline()):
                new.append(proc)
        except psutil.Error:  # ended meanwhile
            continue
    for proc in new:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(new, timeout=grace_s)
    return [p.pid for p in new]
