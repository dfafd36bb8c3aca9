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
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

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


# ---------------------------------------------------------------- the server


def _pythonpath(env: dict[str, str] | os._Environ[str]) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


_INTERPRETER_PATH: list[str] = []
"""The server's ``sys.path`` without its first entry and its own PYTHONPATH (set when it starts serving)."""


class _Child:
    """What the forked child runs, returned out of the serve loop so the worker runs at the top of the stack."""

    def __init__(self, request: dict[str, Any], fds: list[int]) -> None:
        self.request, self.fds = request, fds

    def run(self) -> None:
        for sig in (signal.SIGCHLD, *FORWARDED):  # as in a fresh interpreter
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        for target, fd in zip((0, 1, 2), self.fds[:3]):
            os.dup2(fd, target)
            os.close(fd)
        _watch_lifeline(self.fds[3])
        req = self.request
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        argv = req["argv"][1:] if req["argv"][:1] == ["-u"] else req["argv"]
        script = argv[0]
        sys.argv = list(argv)
        # as a fresh interpreter would have it: the script's folder, the worker's PYTHONPATH (a job's working_dir),
        # then the interpreter's own entries (not the PYTHONPATH of the wrapper that started the server)
        extra = _pythonpath(os.environ)
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra,
                       *[p for p in _INTERPRETER_PATH if p not in extra]]
        _reapply_environment()
        import runpy

        runpy.run_path(script, run_name="__main__")


def _reapply_environment() -> None:
    """What the preloaded modules took from the server's environment when imported, taken from the worker's:
    vLLM's log level; and numpy's global generator, seeded at import (a fresh process seeds it from the OS;
    forked children would all share the server's draw). The thread counts need nothing: the server was started
    with the worker's (:data:`IMPORT_TIME_ENV`, its name)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "")
    if level and "vllm" in sys.modules:
        import logging

        vllm_logger = logging.getLogger("vllm")
        for target in (vllm_logger, *vllm_logger.handlers):
            target.setLevel(level.upper())
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _watch_lifeline(fd: int) -> None:
    """End this child when its wrapper is gone (killed by the raylet or with its node): the wrapper holds the
    write end of the pipe, so a read that returns means it closed."""
    import threading

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forkserver-lifeline", daemon=True).start()


def serve(name: str, raylet_pid: int) -> _Child | None:
    """Listen on ``name`` (before importing anything: a second server started for the same name exits at once,
    and wrappers queue their requests while the imports run); fork a child per request; report each child's end;
    return when the raylet is gone (``None``) or, in a child, with what the child runs."""
    listener = _listen(name)
    if listener is None:
        return None  # another wrapper's server has it
    t0 = time.monotonic()
    return _serve(listener, name, raylet_pid, _preload(os.environ.get(PRELOAD_ENV, ",".join(PRELOAD)), name), t0)


def serve_early() -> _Child | None:
    """A server the driver started before its Ray (:class:`EarlyServers`): it imports at once, and learns its
    name and raylet from its stdin (one line, then the driver closes it) while it does; it binds the name as soon
    as it has it. Ends at once if the driver closes stdin without a line (its Ray did not start, or the roles
    ask for other settings) or another server has the name."""
    import threading

    told: list[tuple[socket.socket, str, int]] = []

    def learn_name() -> None:
        words = sys.stdin.readline().split()
        listener = _listen(words[0]) if len(words) == 2 else None
        if listener is None:
            os._exit(0)
        told.append((listener, words[0], int(words[1])))

    t0 = time.monotonic()
    thread = threading.Thread(target=learn_name, name="forkserver-name", daemon=True)
    thread.start()
    preload = _preload(os.environ.get(PRELOAD_ENV, ",".join(PRELOAD)), "(early)")
    thread.join()  # no thread but this one from here on: the serve loop forks
    listener, name, raylet_pid = told[0]
    return _serve(listener, name, raylet_pid, preload, t0)


def _listen(name: str) -> socket.socket | None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind("\0" + name)
    except OSError:
        listener.close()
        return None
    listener.listen(256)
    return listener


def _serve(listener: socket.socket, name: str, raylet_pid: int, preload: list[str], t0: float) -> _Child | None:
    freeze_heap()
    own = _pythonpath(os.environ)
    _INTERPRETER_PATH[:] = [p for p in sys.path[1:] if os.path.abspath(p) not in own]
    wait_s = request_s(dict(os.environ))
    refusal = f"{', '.join(preload)} loaded {NEVER_PRELOADED}" if NEVER_PRELOADED in sys.modules else ""
    if refusal:  # stays bound, so that wrappers find it and start plain at once instead of starting servers
        print(f"forkserver {name}: {refusal}: not forking (every worker starts the plain way)", flush=True)
    print(f"forkserver {name}: pid {os.getpid()}, raylet {raylet_pid}, imported {', '.join(preload)} in "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    raylet = os.pidfd_open(raylet_pid)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(raylet, selectors.EVENT_READ, "raylet")
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(timeout=0.2):
            if key.data == "raylet":
                print(f"forkserver {name}: raylet {raylet_pid} ended", flush=True)
                return None
            request = _accept(name, listener, wait_s)
            if request is None:
                continue
            conn, message, fds = request
            if refusal:
                for fd in fds:
                    os.close(fd)
                _send(conn, {"refused": refusal})  # no pid: the wrapper runs the worker the plain way
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.setpgid(0, 0)  # the raylet ends a worker's process group with it: not the server's
                sel.close()
                listener.close()
                os.close(raylet)
                conn.close()
                for other in waiting.values():
                    other.close()
                return _Child(message, fds)
            for fd in fds:
                os.close(fd)
            waiting[pid] = conn
            _send(conn, {"pid": pid})
        _reap(waiting)


def freeze_heap() -> None:
    """Move every object the imports left to the garbage collector's permanent generation (``gc.freeze``), before
    the first fork: a full collection in a child then never walks them. vLLM collects several times while it
    builds an engine (model load, KV cache, the freeze of its own heap), and each pass walked the ~680 thousand
    objects the imports of torch, transformers, vLLM and DeepSpeed leave (0.4 CPU-s a pass here): building the
    tiny engine took 2.0 CPU-s, 0.8 with the heap frozen. A collection's walk also writes each object's GC
    header, so it copied the server's pages into every child; frozen, they stay shared (as ``gc.freeze``'s
    documentation advises for a process that forks without exec; it also advises not collecting first, so that no
    freed holes are refilled and copied: here the imports' garbage is collected once, before any child exists,
    so nothing is kept that would not have been)."""
    import gc

    gc.collect()
    gc.freeze()


def _preload(names: str, server: str) -> list[str]:
    """Import each comma-separated module; one marked optional (``name?``) that does not exist is skipped with a
    line in the log. Returns the modules imported."""
    done = []
    for entry in filter(None, names.split(",")):
        module = entry.rstrip("?")
        try:
            __import__(module)
        except ModuleNotFoundError as exc:
            if not entry.endswith("?") or not (exc.name and module.startswith(exc.name)):
                raise
            print(f"forkserver {server}: no module {module} here: not preloaded", flush=True)
            continue
        done.append(module)
    return done


def _accept(name: str, listener: socket.socket,
            wait_s: float) -> tuple[socket.socket, dict[str, Any], list[int]] | None:
    """The next request: its connection, message and fds; ``None`` for one refused or already given up (or not
    sent within ``wait_s``)."""
    conn, _ = listener.accept()
    peer_uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    if peer_uid != os.getuid():  # the socket is reachable by every user of the node: serve ours only
        print(f"forkserver {name}: refused a request from uid {peer_uid}", flush=True)
        conn.close()
        return None
    fds: list[int] = []
    conn.settimeout(wait_s)  # a wrapper killed between its connect and its request must not stall the server
    try:
        data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_REQUEST, 4)
        conn.settimeout(None)
        message = json.loads(data)
        if len(fds) != 4:
            raise ValueError(f"{len(fds)} file descriptors, not 4")
        try:  # a wrapper that gave up waiting (and ran its worker the plain way) closed its end
            if conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                raise ValueError("the wrapper is gone")
        except BlockingIOError:
            pass
    except (OSError, ValueError) as exc:
        print(f"forkserver {name}: request not served: {exc!r}", flush=True)
        for fd in fds:
            os.close(fd)
        conn.close()
        return None
    return conn, message, fds


def _reap(waiting: dict[int, socket.socket]) -> None:
    """Tell the wrappers of children that ended how they ended."""
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the wrapper is gone; its child ends by the lifeline


def main(argv: list[str]) -> None:
    if argv[:1] in (["--serve"], ["--early"]):
        child = serve(argv[1], int(argv[2])) if argv[0] == "--serve" else serve_early()
        if child is not None:
            child.run()
        return
    wrap(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
