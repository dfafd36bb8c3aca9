"""The Ray a run starts on this machine when it is given none (the launcher, ``Cluster`` in a script or a bench, the
tests' shared Ray, the test tier's namespace nodes): no idle workers started ahead of need.

Ray starts idle Python workers with a node and again when the first driver connects (up to one per logical CPU),
so that the first tasks start at once. A run's roles are long-lived actors, each started once in a worker of its
own; the prestarted workers only take cores while the roles import vLLM and DeepSpeed, then sit idle, polling,
for the whole run. Measured on 2 cores: a 1 + 1 launch reaches its first step ~1 s sooner, and an idle 16-CPU
Ray used 0.08 of the machine with them, 0.04 without (docs/testing.md).

Ray reads these variables when its processes start; one already set by the user wins.
"""

from __future__ import annotations

import os

NO_PRESTART_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


def start_local_ray(num_cpus: int, env_vars: dict[str, str]) -> None:
    """A Ray of this process's own (``address="local"``: never one an earlier ``ray start`` left in
    /tmp/ray/ray_current_cluster), ``num_cpus`` logical CPUs, ``env_vars`` in every worker, no prestarted
    workers."""
    import ray

    for key, value in NO_PRESTART_ENV.items():
        os.environ.setdefault(key, value)  # the raylet and GCS this call starts inherit them
    ray.init(address="local", include_dashboard=False, log_to_driver=True, num_cpus=num_cpus,
             runtime_env={"env_vars": env_vars})
