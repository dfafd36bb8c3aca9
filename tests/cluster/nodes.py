"""Two Ray nodes on one machine: one Linux network namespace per node, joined by a veth pair.

    namespace <tag>a   <sub>.1   Ray head (--resources head)     <== veth pair ==>   namespace <tag>b   <sub>.2
    the driver runs here                                                          Ray worker node (--resources worker)

Each namespace has its own loopback, so an address assumed to be 127.0.0.1 fails exactly as it would across
two hosts. The private /24 exists only inside these namespaces. The fixture starts each Ray node with
``ray start --block`` in a process group of its own and stops only those groups (never ``ray stop``, which
would end every Ray process on the machine), then deletes its namespaces; it fails, never skips, when the
namespaces cannot be built (root and iproute2 are part of the set-up).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RAY = str(Path(PY).with_name("ray"))
GCS_PORT = 6390
DASHBOARD_PORT = 8265


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class TwoNodes:
    tag: str
    ip_a: str
    ip_b: str
    temp_dir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    """Ray's token authentication for this cluster only (head, worker node and drivers present it)."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    worker_proc: subprocess.Popen | None = None
    """Node B's ``ray start --block`` (its process group holds node B's raylet and every worker on it)."""

    @property
    def ns_a(self) -> str:
        return f"{self.tag}a"

    @property
    def ns_b(self) -> str:
        return f"{self.tag}b"

    @property
    def address(self) -> str:
        return f"{self.ip_a}:{GCS_PORT}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token})
        return env

    def popen(self, ns: str, cmd: list[str], log: Path, **kw) -> subprocess.Popen:
        """A command in namespace ``ns``, in a process group of its own (stopped by :meth:`stop`)."""
        out = open(log, "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                env=self.env(), cwd=str(ROOT), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, ns: str, cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, env=self.env(),
                              cwd=str(ROOT), timeout=timeout_s)

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        """Signal a started process's whole group (the Ray node and every worker it forked), then kill it."""
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(proc.pid, s)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=grace_s)
                return
            except subprocess.TimeoutExpired:
                continue

    def wait_nodes(self, count: int, timeout_s: float = 90.0) -> None:
        probe = ("import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                 "print(sum(1 for n in ray.nodes() if n['Alive']))")
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            out = self.run(self.ns_a, [PY, "-c", probe, self.address], timeout_s=60)
            last = (out.stdout.strip().splitlines() or [""])[-1]
            if last == str(count):
                return
            time.sleep(2)
        raise AssertionError(f"the two-node Ray cluster did not come up: {count} nodes wanted, saw {last!r}")


def build_namespaces(nodes: TwoNodes) -> None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("tests/cluster need root and iproute2's `ip` to build network namespaces "
                    "(scripts/setup_env.sh installs iproute2); they must run, not skip")
    va, vb = f"{nodes.tag}va", f"{nodes.tag}vb"
    _ip("netns", "add", nodes.ns_a)
    _ip("netns", "add", nodes.ns_b)
    _ip("link", "add", va, "type", "veth", "peer", "name", vb)
    _ip("link", "set", va, "netns", nodes.ns_a)
    _ip("link", "set", vb, "netns", nodes.ns_b)
    for ns, dev, addr in ((nodes.ns_a, va, nodes.ip_a), (nodes.ns_b, vb, nodes.ip_b)):
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", dev, "up")


def remove_namespaces(nodes: TwoNodes) -> None:
    for ns in (nodes.ns_a, nodes.ns_b):  # deleting a namespace deletes the veth end inside it (and its peer)
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
