"""The fork server itself (the wrapper's half is ``forkserver.py``, whose docstring draws the protocol): it listens on
the node's abstract socket, imports the preloaded packages once, then forks a child per wrapper's request that takes
the wrapper's fds, environment, cwd and argv and runs Ray's ``default_worker.py`` as ``__main__``.

Started as ``python -m async_rlhf.startup.forkserver --serve NAME RAYLET_PID`` (or ``--early``); kept apart from the
wrapper because every Ray worker start runs the wrapper, which needs none of this.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any

from async_rlhf.startup.forkserver import (
    _MAX_REQUEST,
    FORWARDED,
    NEVER_PRELOADED,
    PRELOAD,
    PRELOAD_ENV,
    request_s,
)

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
