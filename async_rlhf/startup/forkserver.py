"""Ray workers forked from a process that has already imported PyTorch, transformers, vLLM and DeepSpeed.

Each role (buffer, generator, learner rank) is a Ray actor in a worker process of its own, and a new worker first
imports what its role needs: ~8 s of CPU on an idle 2-core machine, 20 s on a busy one, for every generator and
learner rank started, restarted or added. With ``run.fork_workers`` (on by default on CPU) the driver gives each
generator's and learner rank's runtime environment a ``py_executable`` (Ray's maintained way to choose how a
worker is started) that is this module: a small wrapper that asks the node's fork server for a child already
past those imports.

    raylet --exec--> wrapper: python -m async_rlhf.startup.forkserver default_worker.py --node-id=N ...
                       | connects to the abstract socket named after the node, the thread settings and the
                       | interpreter with its preloaded packages (server_name); the first wrapper to find
                       | none starts the server, which listens at
                       | once and answers once its imports are done
                       | sends: argv, environment, cwd   + its stdin, stdout, stderr and a lifeline pipe
                       v
                     fork server (modules imported, one thread, never runs a torch op)
                       | fork -> child: takes the fds, environment, cwd and argv, runs default_worker.py as
                       |         __main__ (the Ray worker: it registers its own pid with the raylet)
                       | replies {"pid": child} ... and {"exit": code} when the child ends
                       v
                     wrapper: forwards SIGTERM/SIGINT/SIGHUP/SIGQUIT to the child, exits with its code
                     (or its signal). The child SIGKILLs itself when the lifeline closes (the wrapper was
                     killed), and the server exits when the raylet that started its first worker does.

A driver that starts a Ray of its own starts its servers first thing (:class:`EarlyServers`), before its model and
Ray: they import while it works, and learn their name (the node id) and raylet on their stdin once Ray is up.

The server and its children stay in the raylet's session (a job's processes stay one session), each child in a
process group of its own (the raylet ends a worker's group with it). Anything that fails before the fork (no
server, a server that does not answer in ``FORK_S``) makes the wrapper exec the plain ``python default_worker.py
...`` Ray would have run: forking is an optimisation, never a dependency. The server preloads only third-party
modules: the project's own code is imported by each worker (a runtime environment may ship another version of it).
What a preloaded library reads from the environment only when loaded is the server's: the OpenMP thread count
(one server per value, ``IMPORT_TIME_ENV``), vLLM's log level (set again in the child) and numpy's global seed
(drawn again); what else those libraries read, they read when used (vLLM's ``envs``, DeepSpeed's op builder,
CUDA's device list).

Not for GPU nodes as is: importing DeepSpeed there probes CUDA, after which a forked child cannot use it; the
driver leaves it off when the run asks for GPUs (never tried on a GPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from async_rlhf.startup.runtime_stamp import stamp

MODULE = "async_rlhf.startup.forkserver"
PRELOAD = ("torch", "transformers", "vllm", "deepspeed", "vllm.v1.worker.cpu_model_runner?")
"""What the server imports before it forks anything; ``ASYNC_RLHF_FORKSERVER_PRELOAD`` (comma-separated module
names) in the roles' environment replaces it. A name ending in ``?`` is skipped where it does not exist (vLLM
moves its modules between releases: that costs a generator its import time, nothing else). Never Ray: its core
library reads the worker's job and raylet (``RAY_JOB_ID``, ``RAY_RAYLET_PID``) from the environment once, when
loaded, so a child of a server that had loaded it registers with the job of the wrapper that started the server
(seen: a second job's workers were ended at once as workers of the first, finished, job). The server refuses to
serve if a preloaded module loaded it. ``import vllm`` is lazy: the CPU model runner is most of what building an
engine imports besides (4.5-5.5 s on 2 cores) and loads no Ray, unlike ``vllm.entrypoints.llm`` and
``vllm.v1.engine.core`` (under a second after it). The native threads it adds are OpenBLAS's and OpenMP's pools
(OpenCV's bundled OpenBLAS), sized by the thread variables the server is keyed by: none under
``OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1``, and both libraries reset their pools in a forked child."""
NEVER_PRELOADED = "ray._raylet"
PRELOAD_ENV = "ASYNC_RLHF_FORKSERVER_PRELOAD"

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
LISTEN_S = 30.0
"""How long a wrapper tries to reach a server it started (the server listens before it imports anything)."""
FORK_S = 300.0
"""How long a wrapper waits for its child's pid (the server answers once its imports are done); then it runs
Ray's plain command: a server that slow saves nothing."""
REQUEST_S = 10.0
"""How long the server waits for the request of a wrapper that connected (it sends it right after connecting);
``ASYNC_RLHF_FORKSERVER_REQUEST_S`` in the server's environment sets another."""
REQUEST_S_ENV = "ASYNC_RLHF_FORKSERVER_REQUEST_S"
_MAX_REQUEST = 1 << 20


def request_s(env: dict[str, str]) -> float:
    """The server's wait for a request (:data:`REQUEST_S`, or :data:`REQUEST_S_ENV` of ``env``), read once as it
    starts serving; a value that is not a positive number of seconds is refused naming the variable."""
    raw = env.get(REQUEST_S_ENV)
    if raw is None:
        return REQUEST_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{REQUEST_S_ENV}={raw!r} is not a positive number of seconds: set it to one (e.g. 10) or "
                         "unset it")
    return value


def command() -> str:
    """The ``py_executable`` to give a runtime environment: this interpreter running this module."""
    return f"{sys.executable} -m {MODULE}"


def _arg(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Variables the preloaded libraries read once, when loaded, and never again: the OpenMP runtime's default
thread count is fixed then for every thread the process will start (vLLM's CPU kernels compare it with torch's
count), so a worker must come from a server that was started with the same values."""


def server_name(node_id: str, env: dict[str, str], runtime: str | None = None) -> str:
    """The abstract socket of the server for this node, these :data:`IMPORT_TIME_ENV` values and this preload
    list, in this interpreter with these packages (``runtime``, default :func:`runtime_stamp` of ``env``).
    Abstract names are per network namespace, as a node is; hashed: they have at most 107 bytes."""
    if runtime is None:
        runtime = runtime_stamp(env)
    key = [node_id, *(env.get(k, "") for k in IMPORT_TIME_ENV), env.get(PRELOAD_ENV, ""), runtime]
    return "\0async_rlhf-forkserver-" + hashlib.sha1("\n".join(key).encode()).hexdigest()


def runtime_stamp(env: dict[str, str], executable: str | None = None, prefix: str | None = None,
                  path: list[str] | None = None) -> str:
    """:func:`async_rlhf.startup.runtime_stamp.stamp` of the top-level packages this server preloads under ``env``
    (:data:`PRELOAD_ENV`, else :data:`PRELOAD`): what a server's imports are, part of its name."""
    names = [entry.rstrip("?").split(".")[0] for entry in env.get(PRELOAD_ENV, ",".join(PRELOAD)).split(",")]
    return stamp(list(dict.fromkeys(filter(None, names))), executable, prefix, path)


# ---------------------------------------------------------------- the wrapper Ray starts as the worker command


def _plain(argv: list[str]) -> None:
    """Run the worker as Ray would have: exec a fresh interpreter."""
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def _connect(name: str, argv: list[str], raylet_pid: int) -> socket.socket:
    """A connection to the node's server; the first wrapper to find none starts it."""
    deadline = None
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(name)
            return sock
        except OSError:
            sock.close()
            if os.getppid() != raylet_pid:  # the raylet is gone: so is the worker it wanted
                sys.exit(1)
            if deadline is not None and time.monotonic() > deadline:
                raise
        if deadline is None:
            _start_server(name, argv, raylet_pid)
            deadline = time.monotonic() + LISTEN_S
        time.sleep(0.05)


def _start_server(name: str, argv: list[str], raylet_pid: int) -> None:
    """Start the node's server for this wrapper, detached from it: through an intermediate process that exits at
    once, so that it is nobody's child (Ray ends a worker's children with it, and this wrapper is the raylet's
    worker process), in a process group of its own (Ray ends a worker's process group with it) and in the
    raylet's session (so that ending a job's session ends it too). Several wrappers may start one; the first to
    bind the name serves, the others exit. It starts with this wrapper's environment (the
    :data:`IMPORT_TIME_ENV` values its name stands for). Its log is ``forkserver.log`` in the session's logs."""
    logs = os.path.join(_arg(argv, "--temp-dir") or "/tmp/ray", _arg(argv, "--session-name") or "", "logs")
    log_path = os.path.join(logs, "forkserver.log") if os.path.isdir(logs) else os.devnull
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        _spawn_server(name, raylet_pid, log_path, None)
    finally:
        os._exit(0)


def _spawn_server(name: str, raylet_pid: int, log_path: str, env: dict[str, str] | None) -> int:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", MODULE, "--serve", name.lstrip("\0"), str(raylet_pid)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True, process_group=0,
                                env=env).pid


def prestart(node_id: str, raylet_pid: int, role_envs: list[dict[str, str]]) -> list[int]:
    """Start now, from the driver of a Ray it started itself, the servers the roles with these variables will
    ask for on this node (one per distinct :func:`server_name`): their imports then overlap the driver's own
    start-up (Ray, placement, the buffer) instead of delaying the first generator and learner rank. Returns their
    pids. A wrapper that finds its server still importing waits for it; one whose variables differ from these
    starts its own."""
    names: dict[str, dict[str, str]] = {}
    for role_env in role_envs:
        name, env = _role_server(node_id, role_env)
        names.setdefault(name, env)
    return [_spawn_server(name, raylet_pid, os.devnull, env) for name, env in names.items()]


def _role_server(node_id: str, role_env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The name of the server for a role with these variables on ``node_id`` (``""``: any node), and the
    environment it starts with (this process's and the role's)."""
    env = {**os.environ, **role_env}
    return server_name(node_id, env), env


class EarlyServers:
    """Servers a driver that will start its own Ray starts before it does anything else: their imports overlap
    the driver's own (its model, Ray's start, the placement) instead of following Ray's start. Ray's node id and
    raylet pid, which name a server and end it, exist only once Ray is up: :meth:`bind` then tells each server
    its name. One per distinct thread setting of ``role_envs`` (the variables the roles' runtime environments
    will add to this process's)."""

    def __init__(self, role_envs: list[dict[str, str]]) -> None:
        self.servers: dict[str, subprocess.Popen] = {}
        for role_env in role_envs:
            key, env = _role_server("", role_env)
            if key not in self.servers:
                self.servers[key] = subprocess.Popen(
                    [sys.executable, "-m", MODULE, "--early"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, close_fds=True, process_group=0, env=env)

    def bind(self, node_id: str, raylet_pid: int, role_envs: list[dict[str, str]]) -> list[dict[str, str]]:
        """Name each server after ``node_id`` and have it end with ``raylet_pid``; wait (up to 5 s) until each
        listens. Returns the role environments no early server stands for (start theirs with :func:`prestart`);
        servers no role asks for end."""
        names, rest = {}, []
        for role_env in role_envs:
            key = _role_server("", role_env)[0]
            if key in self.servers:
                names[key] = _role_server(node_id, role_env)[0]
            else:
                rest.append(role_env)
        for key, proc in self.servers.items():
            if key in names and proc.poll() is None:
                try:
                    proc.stdin.write(f"{names[key].lstrip(chr(0))} {raylet_pid}\n".encode())
                except OSError:
                    pass  # it ended: the first wrapper starts the server
        self.close()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not all(_listening(n) for n in names.values()):
            time.sleep(0.02)
        return rest

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.servers.values()]

    def close(self) -> None:
        """Close every server's stdin: one not yet told its name ends."""
        for proc in self.servers.values():
            try:
                proc.stdin.close()
            except OSError:
                pass


def _listening(name: str) -> bool:
    """Whether some process listens on the abstract socket ``name`` (as ``/proc/net/unix`` shows it)."""
    want = "@" + name.lstrip("\0")
    try:
        with open("/proc/net/unix") as f:
            return any(line.rstrip().endswith(" " + want) for line in f)
    except OSError:
        return True


def wrap(argv: list[str]) -> None:
    """The worker command: have the node's server fork the worker, stand in for it until it ends."""
    node_id, raylet_pid = _arg(argv, "--node-id"), os.getppid()
    if not node_id or not _is_raylet(raylet_pid):
        _plain(argv)
    try:
        sock = _connect(server_name(node_id, dict(os.environ)), argv, raylet_pid)
        life_r, life_w = os.pipe()
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(sock, [request], [0, 1, 2, life_r])
        os.close(life_r)
        sock.settimeout(FORK_S)
        reply = json.loads(sock.recv(_MAX_REQUEST) or b"{}")
        sock.settimeout(None)
        if "pid" not in reply:
            raise ValueError(reply.get("refused", "the server ended without answering"))
        pid = int(reply["pid"])
    except (OSError, ValueError) as exc:
        # the pipe's write end closes at exec: a child the server would still fork ends itself at once
        print(f"async_rlhf forkserver: {exc!r}; starting the worker the plain way", file=sys.stderr, flush=True)
        _plain(argv)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _signal(pid, s))
    code = _wait_child(sock, pid)
    os.close(life_w)
    if code < 0:  # ended by a signal: end the same way, as the raylet would have seen it
        if -code in FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal that does not end a process by default
    sys.exit(code)


def _is_raylet(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().startswith("raylet")
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _wait_child(sock: socket.socket, pid: int) -> int:
    """The child's exit code (negative: the signal that ended it), from the server; if the server is gone,
    wait for the child to be gone and return 1."""
    data = sock.recv(_MAX_REQUEST)  # EINTR (a forwarded signal) is retried by Python
    if data:
        return int(json.loads(data)["exit"])
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 1
        time.sleep(0.2)


def main(argv: list[str]) -> None:
    if argv[:1] in (["--serve"], ["--early"]):
        from async_rlhf.startup.fork_serving import serve, serve_early

        child = serve(argv[1], int(argv[2])) if argv[0] == "--serve" else serve_early()
        if child is not None:
            child.run()
        return
    wrap(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
