"""The Ray a run starts for itself (``start_local_ray``) really starts no idle worker and keeps none: Ray ignores an
unknown ``RAY_*`` variable silently, so only a real Ray can tell that the names are ones it reads. A plain
``ray.init`` with the same CPUs prestarts idle workers as the driver connects (2 for 4 CPUs here) and keeps the
worker of a finished task idle (one with a runtime environment of its own, as a run's node probe on a Ray it
joined), so the count below fails if the variables stop working."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = r"""
import json, sys, time
import psutil, ray
from async_rlhf.driver.local_ray import start_local_ray
if sys.argv[1] == "ours":
    start_local_ray(4, {})
else:
    ray.init(address="local", include_dashboard=False, num_cpus=4)
def idle():  # a worker is default_worker.py from its spawn, ray::IDLE once it has imported Ray
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            args = p.cmdline()
        except psutil.Error:  # ended meanwhile
            continue
        cmd = " ".join(args)  # (the raylet's own command line names default_worker.py too, as an option's value)
        if "ray::IDLE" in cmd or (len(args) > 1 and args[1].endswith("default_worker.py")):
            found.append(cmd[:300])
    return found
@ray.remote(num_cpus=0)
def task():
    return 1
assert ray.get(task.options(runtime_env={"env_vars": {"PROBE": "1"}}).remote(), timeout=120) == 1
# the prestart, when on, spawns its workers as the driver registers (they were there right after init): counted
# 3 s after the task; a plain Ray's are awaited up to 30 s more (a loaded machine spawns late); ours may take a
# few seconds to end the task's worker (idle for 1 s, then ended at the raylet's next check)
start = time.monotonic()
while time.monotonic() - start < 3 or (
        (sys.argv[1] == "plain") != bool(idle()) and time.monotonic() - start < 33):
    time.sleep(0.5)
print(json.dumps(idle()))
ray.shutdown()
"""


def start_probe(mode: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # nothing of the session's Ray
    return subprocess.Popen([sys.executable, "-c", PROBE, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def idle_workers(probe: subprocess.Popen) -> list[str]:
    try:
        out, err = probe.communicate(timeout=180)
    finally:
        if probe.poll() is None:
            probe.kill()
            probe.wait()
    assert probe.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_plain_ray_keeps_idle_workers_and_ours_none() -> None:
    # both Rays at once (each a Ray of its own, on its own ports): the two starts and waits overlap
    plain, ours = start_probe("plain"), start_probe("ours")
    try:
        assert idle_workers(plain), "Ray keeps no idle worker by default here: this check could not fail"
    finally:
        found = idle_workers(ours)
    assert found == []
