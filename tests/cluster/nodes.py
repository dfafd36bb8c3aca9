"""Ray nodes on one machine: one Linux network namespace per node, every node joined to one bridge.

    namespace <tag>sw (the switch): bridge <tag>br
      |-- veth <tag>s0 <==> <tag>h0   namespace <tag>n0   <subnet>.1   Ray head   (resources head, node0, front)
      |-- veth <tag>s1 <==> <tag>h1   namespace <tag>n1   <subnet>.2   Ray worker (resources worker, node1, front)
      |-- ...                                                          (the driver runs in <tag>n0)
      '-- veth <tag>s3 <==> <tag>h3   namespace <tag>n3   <subnet>.4   Ray worker (resources worker, node3, back)

The first half of the nodes carry the resource ``front``, the others ``back``: a job can keep two roles on disjoint
sets of more than one node each (learner ranks spread over the front nodes, generators on the back ones, so that a
back node can be lost without a learner).

Each node namespace has its own loopback, so an address assumed to be 127.0.0.1 fails exactly as it would across
hosts. The private /24 exists only inside these namespaces. Every Ray node is ``ray start --block`` in a process
group of its own, stopped only through that group (never ``ray stop``, which would end every Ray process on the
machine), in the caller's session: a session of its own would be a scheduler autogroup of its own, and the kernel
would then give every node an equal share of the machine's cores whatever runs there (the roles' niceness, Ray's
15 and the generators' +10 on borrowed cores, counting only inside a node). No cluster shares cores between hosts;
in one group the nodes share them as the roles of a one-host run do. Measured at 8 + 8 (bench/scale.py,
2026-12-07): with a session per node the sender's threads waited 30 ms for a core in a 40 ms quiet push (raw
broadcast 12.6), behind the generators' loads; in one group 3.6 ms in an 11.0 ms push (raw 10.8).
:meth:`Nodes.remove` then deletes exactly the namespaces this object created (deleting a namespace deletes the
veth ends and the bridge inside it). Building fails, never skips, without root and iproute2 (part of
the set-up). Used by tests/cluster and bench/scale.py (the largest fleet this machine holds, over 4 nodes).

    with namespace_cluster(4, logs) as nodes:          # 4 Ray nodes up, stopped and removed at exit
        nodes.run(nodes.ns(0), [PY, "job.py", "--address", nodes.address], timeout_s=600)
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from async_rlhf.driver.local_ray import LOCAL_RAY_ENV

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RAY = str(Path(PY).with_name("ray"))
GCS_PORT = 6390
DASHBOARD_PORT = 8265
MAX_NODES = 9
"""Interface names are <tag><letter><i>: with a tag of at most 12 characters and one digit they stay within
Linux's 15."""


def half_resource(i: int, count: int, cpus: int) -> dict[str, int]:
    """Node ``i`` of ``count``: ``front`` in the first half (the head among them), ``back`` in the rest."""
    return {"front" if i < (count + 1) // 2 else "back": cpus}


class NamespaceError(RuntimeError):
    """The namespaces could not be built (no root, no iproute2, a name taken)."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


@dataclass
class Nodes:
    tag: str
    subnet: str
    """The first three octets of the nodes' /24, e.g. 10.231.105 (node i is <subnet>.<i + 1>)."""
    count: int
    temp_dir: Path
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    """Ray's token authentication for this cluster only (head, worker nodes and drivers present it)."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    node_procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    """Node i's ``ray start --block`` (its process group holds node i's raylet and every worker on it)."""
    built: list[str] = field(default_factory=list)
    """The namespaces created so far (what :meth:`remove` deletes)."""

    def __post_init__(self) -> None:
        if not 1 <= self.count <= MAX_NODES or len(self.tag) > 12:
            raise ValueError(f"1-{MAX_NODES} nodes and a tag of at most 12 characters, got {self.count}, {self.tag!r}")

    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    @property
    def switch(self) -> str:
        return f"{self.tag}sw"

    @property
    def head_ns(self) -> str:
        return self.ns(0)

    @property
    def address(self) -> str:
        return f"{self.ip(0)}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.ip(0)}:{DASHBOARD_PORT}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(LOCAL_RAY_ENV)  # as the launcher's own Ray (async_rlhf/driver/local_ray.py)
        env.update({"RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token})
        return env

    # -- namespaces ---------------------------------------------------------------------------------------
    def build(self) -> None:
        """The switch namespace with its bridge, and one namespace per node joined to it by a veth pair."""
        if os.geteuid() != 0 or not shutil.which("ip"):
            raise NamespaceError("network-namespace nodes need root and iproute2's `ip` (scripts/setup_env.sh "
                                 "installs iproute2); tests/cluster must run, not skip")
        bridge = f"{self.tag}br"
        _ip("netns", "add", self.switch)
        self.built.append(self.switch)
        _ip("-n", self.switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", self.switch, "link", "set", bridge, "up")
        for i in range(self.count):
            ns, host_end, switch_end = self.ns(i), f"{self.tag}h{i}", f"{self.tag}s{i}"
            _ip("netns", "add", ns)
            self.built.append(ns)
            _ip("-n", ns, "link", "add", host_end, "type", "veth", "peer", "name", switch_end, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", switch_end, "master", bridge)
            _ip("-n", self.switch, "link", "set", switch_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(i)}/24", "dev", host_end)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", host_end, "up")

    def remove(self) -> None:
        """Stop every process started here (by process group), then delete the namespaces built here. Every group
        is signalled first and then waited for under one deadline (one node at a time, each with its own grace,
        took 20 s and more at the end of the module)."""
        self.stop_all(list(reversed(self.procs)))
        for ns in reversed(self.built):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.built.clear()

    # -- processes ----------------------------------------------------------------------------------------
    def popen(self, ns: str, cmd: list[str], log: Path, **kw) -> subprocess.Popen:
        """A command in namespace ``ns``, in a process group of its own (stopped by :meth:`stop`) and in this
        process's session (see the module's docstring)."""
        out = open(log, "w")
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                env=self.env(), cwd=str(ROOT), process_group=0, **kw)
        self.procs.append(proc)
        return proc

    def run(self, ns: str, cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, env=self.env(),
                              cwd=str(ROOT), timeout=timeout_s)

    def run_streamed(self, ns: str, cmd: list[str], log: Path, show: Callable[[str], bool],
                     timeout_s: float) -> tuple[int, str]:
        """Like :meth:`run`, with every output line written to ``log`` as it comes and those ``show`` picks printed
        (a job's progress while it runs); stopped by process group past ``timeout_s``. Returns (exit code, output)."""
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=self.env(), cwd=str(ROOT), process_group=0)
        self.procs.append(proc)
        timer = threading.Timer(timeout_s, self.stop, args=(proc,))
        timer.start()
        lines = []
        try:
            with log.open("w") as out:
                for line in proc.stdout:
                    out.write(line)
                    lines.append(line)
                    if show(line):
                        print(line, end="", flush=True)
        finally:
            timer.cancel()
        code = proc.wait()
        self.procs.remove(proc)
        return code, "".join(lines)

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
        """Signal a started process's whole group (a Ray node and every worker it forked), then kill it."""
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

    def stop_all(self, procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
        """SIGTERM to every process group of ``procs`` at once, after ``grace_s`` SIGKILL to every group (a member
        that outlived its group's leader too)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in procs if p.poll() is None]
            for proc in alive if sig == signal.SIGTERM else procs:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            for proc in alive:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def stop_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Every process of node i (its Ray node's process group), e.g. SIGKILL: the node is lost."""
        self.stop(self.node_procs[i], sig, grace_s=10)

    # -- Ray ------------------------------------------------------------------------------------------------
    def start_ray(self, logs: Path, cpus: int, attempts: int = 3) -> None:
        """The head on node 0 (resources head and node0; the dashboard serves ``ray job submit``), then a worker
        on every other node (resources worker and node<i>; each node front or back too: :func:`half_resource`),
        each with ``cpus`` logical CPUs, one at a time: on 2
        busy cores, workers started together time out registering with the GCS (seen: 2 of 3 failed). A worker
        whose ``ray start`` ends before its node registered is started again, up to ``attempts`` times; so is the
        whole cluster when the head ends (its Ray client server gives up when the head's own raylet has not
        registered 30 s after it started, and the raylet starts only once the dashboard is up or has failed:
        ``ray start --block`` then ends the head). One :class:`NodeCount` per head watches the count (a probe per
        poll imported Ray every 2 s)."""
        logs.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            try:
                self._start_nodes(logs, cpus, attempt, attempts)
                return
            except NamespaceError:
                head = self.node_procs[0]
                if head.poll() is None or attempt == attempts - 1:
                    raise
                self.stop_all([self.node_procs.pop(i) for i in sorted(self.node_procs)])

    def _start_nodes(self, logs: Path, cpus: int, head_attempt: int, attempts: int) -> None:
        head = self.node_procs[0] = self.popen(self.ns(0), [
            RAY, "start", "--head", "--block", "--node-ip-address", self.ip(0), "--port", str(GCS_PORT),
            "--num-cpus", str(cpus),
            "--resources", json.dumps({"head": cpus, "node0": cpus, **half_resource(0, self.count, cpus)}),
            "--dashboard-host", self.ip(0), "--dashboard-port", str(DASHBOARD_PORT),
            "--temp-dir", str(self.temp_dir)], logs / f"node0.{head_attempt}.log")
        with NodeCount(self, logs / f"node_count.{head_attempt}.log") as alive:
            self.wait_nodes(1, alive, [head])
            for i in range(1, self.count):
                for attempt in range(attempts):
                    self.node_procs[i] = self.popen(self.ns(i), [
                        RAY, "start", "--block", "--address", self.address, "--node-ip-address",
                        self.ip(i), "--num-cpus", str(cpus),
                        "--resources",
                        json.dumps({"worker": cpus, f"node{i}": cpus, **half_resource(i, self.count, cpus)})],
                        logs / f"node{i}.{head_attempt}.{attempt}.log")
                    try:
                        self.wait_nodes(i + 1, alive, [head, self.node_procs[i]])
                        break
                    except NamespaceError:
                        self.stop(self.node_procs[i])
                        if attempt == attempts - 1 or head.poll() is not None:
                            raise

    def wait_nodes(self, count: int, alive: NodeCount, starts: list[subprocess.Popen],
                   timeout_s: float = 180.0) -> None:
        """Until ``alive`` reports ``count`` Ray nodes; raises :class:`NamespaceError` past ``timeout_s`` or as soon
        as one of ``starts`` (the ``ray start`` of the head and of the node awaited) has ended."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            last = alive.latest()
            if last == str(count):
                return
            ended = [p for p in starts if p.poll() is not None]
            if ended:
                raise NamespaceError(f"a Ray node's start ended (exit {ended[0].returncode}, namespace "
                                     f"{ended[0].args[3]}) with {last} of {count} nodes up")
            time.sleep(0.5)
        raise NamespaceError(f"the {self.count}-node Ray cluster did not come up: {count} nodes wanted, saw {last!r}")


class NodeCount:
    """One Python in the head's namespace that joins the cluster once (retrying until the GCS answers) and writes
    the number of alive Ray nodes to ``log`` every second; :meth:`latest` reads the last line (a probe that ended
    is started again). A context manager: the probe is stopped at exit."""

    PROBE = """
import sys, time, ray
while True:
    try:
        ray.init(address=sys.argv[1], logging_level="ERROR")
        break
    except Exception as e:  # the head's GCS is not up yet
        print(f"(no GCS yet: {type(e).__name__})", flush=True)
        time.sleep(1)
while True:
    print(sum(1 for n in ray.nodes() if n["Alive"]), flush=True)
    time.sleep(1)
"""

    def __init__(self, nodes: Nodes, log: Path) -> None:
        self.nodes, self.log = nodes, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def __enter__(self) -> NodeCount:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.nodes.stop(self.proc, grace_s=5)
            self.nodes.procs.remove(self.proc)

    def _start(self) -> None:
        self.starts += 1
        self.proc = self.nodes.popen(self.nodes.head_ns, [PY, "-c", self.PROBE, self.nodes.address],
                                     self.log.with_suffix(f".{self.starts}.log"))

    def latest(self) -> str:
        assert self.proc is not None, "NodeCount is used as a context manager"
        lines = self.log.with_suffix(f".{self.starts}.log").read_text().splitlines()
        code = self.proc.poll()
        if code is not None:  # it lost the GCS or failed: the next read is a new probe's
            self.nodes.procs.remove(self.proc)
            self._start()
            return f"(probe ended, exit {code}: {' | '.join(lines[-3:])})"
        return lines[-1].strip() if lines else "(probe starting)"


def new_nodes(count: int, temp_dir: Path, subnet_base: int = 100) -> Nodes:
    """A :class:`Nodes` named after this process (its namespaces never collide with another run's)."""
    pid = os.getpid()
    return Nodes(f"ar{pid % 100000}", f"10.231.{subnet_base + pid % 50}", count, temp_dir)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM (a timeout's, a plain ``kill``) ends the process through Python's exit path
    (SystemExit 143), so that ``finally`` clauses run: Python's default ends it on the spot, and the Ray nodes and
    namespaces of a killed ``bench/scale.py`` stayed behind. Only on the main thread (elsewhere: unchanged)."""

    def exit_now(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, exit_now)
    except ValueError:  # not the main thread: signals are the main thread's
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def namespace_cluster(count: int, logs: Path, cpus: int = 6, subnet_base: int = 100,
                      temp_dir: Path | None = None) -> Iterator[Nodes]:
    """``count`` namespace nodes with a Ray node each, up; at exit every process started is stopped and every
    namespace built is deleted (also when building failed half-way, and on SIGTERM: :func:`sigterm_exits`).
    ``temp_dir``: Ray's (its sockets' paths must stay short); by default a fresh one under /tmp, deleted at exit."""
    own = temp_dir is None
    nodes = new_nodes(count, Path(tempfile.mkdtemp(prefix="rayns_")) if own else temp_dir, subnet_base)
    with sigterm_exits():
        try:
            nodes.build()
            nodes.start_ray(logs, cpus)
            yield nodes
        finally:
            nodes.remove()
            if own:
                shutil.rmtree(nodes.temp_dir, ignore_errors=True)
