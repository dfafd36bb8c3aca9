"""Where a run's output goes: the launcher's own lines on the console, everything else in ``run.dir/logs/``.

    console (the launcher's terminal)                 run.dir/logs/
      logs: <run.dir>/logs (the first line)             driver.log        the driver's libraries: Ray's notices,
      start-up progress, progress lines,                                  Python warnings, anything written to its
      our warnings (async_rlhf.*, launch loggers),                        stderr or to fd 1 and 2 (child processes)
      error: lines (each names the log of the role     buffer.log        the buffer actor's process
      that failed), the closing line                   generator-<i>.log each generator's process (vLLM)
                                                       learner-<r>.log   each learner rank's process (DeepSpeed)
                                                       heldout.log       the held-out evaluation tasks

A role sends its fd 1 and 2 to its file first thing in its actor's ``__init__`` (:func:`to_role_log`), so what
its libraries print, C code and the process's exit included ("nanobind: leaked ..." at the held-out task's
exit), lands there; a restarted or resumed role appends under a header line. The driver leaves Ray's forwarding of
the workers' output off (``ray.init(log_to_driver=False)``, :func:`forward_role_output`). ``run.verbose=true`` or
``ASYNC_RLHF_VERBOSE=1`` in the driver's environment restores everything on the console: Ray forwards the roles'
output as before (each role's file is still written, through ``tee``) and the driver keeps its streams.

No torch, ray or vllm here: actors call :func:`to_role_log` before their heavy imports.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

VERBOSE_ENV = "ASYNC_RLHF_VERBOSE"
OUR_LOGGERS = ("async_rlhf", "launch")
"""The loggers whose records are the launcher's own: their warnings and errors reach the console."""
OUR_PACKAGES = ("async_rlhf", "launch")
"""Where the code whose ``print`` lines are the launcher's lives (launch/cluster.py runs as ``__main__``)."""
PRINT_WRAPPERS = ("ray.experimental.tqdm_ray", "wandb.sdk.lib.console_capture")
"""Modules whose function stands between a ``print`` and the driver's sys.stdout: Ray's driver patches in tqdm_ray's
``safe_print`` for ``builtins.print`` once it prints a worker's error (a learner's death), and ``wandb.init``
(``run.report_to=wandb``) replaces ``sys.stdout.write`` by its console-capture callback even with capture off;
every print after comes through them, and the writer is whoever called them."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_console_err: TextIO | None = None
_redirected: Path | None = None

log = logging.getLogger(__name__)


def env_verbose(environ: dict[str, str] | None = None) -> bool:
    """Whether :data:`VERBOSE_ENV` asks for everything on the console (``1``, ``true``, ``yes``, ``on``)."""
    value = (os.environ if environ is None else environ).get(VERBOSE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def is_verbose(cfg: Any) -> bool:
    """``run.verbose``, or :data:`VERBOSE_ENV` in this process's environment."""
    return bool(cfg.run.verbose) or env_verbose()


def logs_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs"


def role_log(run_dir: str | Path, role: str) -> Path:
    """The log file of ``role`` (``generator-0``, ``learner-1``, ``buffer``, ``heldout``, ``driver``)."""
    return logs_dir(run_dir) / f"{role}.log"


def to_role_log(cfg: Any, role: str) -> Path | None:
    """In a role's own process: append its fd 1 and 2 to ``run.dir/logs/<role>.log`` (verbose: also to where they
    went, through ``tee``, so Ray still forwards them). Returns the file, or None where it cannot be written (the
    output then goes where Ray sends it, with a warning saying why). Once per process: a task run again in the
    same worker keeps the first redirection. A relative ``run.dir`` (an actor started outside a run: a run's driver
    makes it absolute) leaves the output where it is."""
    global _redirected

    if not Path(cfg.run.dir).is_absolute():
        return None
    path = role_log(cfg.run.dir, role)
    if _redirected == path:
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        log.warning("cannot write %s (%s): this role's output stays where Ray sends it", path, exc.strerror or exc)
        return None
    os.write(fd, f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {role} (pid {os.getpid()}) ==\n".encode())
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if is_verbose(cfg):  # tee appends to the file and writes on to the worker's own stderr (Ray forwards it)
        before = os.dup(2)
        try:
            tee = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=before, close_fds=True)
        except OSError as exc:
            log.warning("cannot start tee (%s): this role's output stays where Ray sends it", exc.strerror or exc)
            return None
        finally:
            os.close(before)
            os.close(fd)
        fd = os.dup(tee.stdin.fileno())
        tee.stdin.close()  # fd 1 and 2 are its only writers: it ends when this process does
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _redirected = path
    return path


def forward_role_output(cfg: Any) -> bool:
    """``log_to_driver`` of the driver's ``ray.init``: the roles' output reaches the driver's console only when
    verbose (otherwise it is in their files)."""
    return is_verbose(cfg)


def console_stderr() -> TextIO:
    """Where the launcher's own error lines go: the terminal's stderr (sys.stderr until :func:`quiet_driver`)."""
    return _console_err or sys.stderr


def quiet_driver(cfg: Any) -> Path:
    """In the launcher's process, once ``run.dir`` exists: print the first line of the run (where the logs are),
    then, unless verbose, send its fd 1 and 2, sys.stderr and every logger but :data:`OUR_LOGGERS` to
    ``logs/driver.log``; what our own code prints to sys.stdout (:class:`OursToConsole`) and our loggers keep
    the terminal.
    ``ASYNC_RLHF_VERBOSE`` sets ``cfg.run.verbose`` here, so roles on a Ray the driver joined see it too. Not
    undone: the launcher's process ends with its run."""
    global _console_err

    if env_verbose():
        cfg.run.verbose = True
    where = logs_dir(cfg.run.dir)
    where.mkdir(parents=True, exist_ok=True)
    if cfg.run.verbose:
        print(f"logs: {where} (run.verbose: everything is shown here too)", flush=True)
        return where
    print(f"logs: {where} (each role's output; run.verbose=true or {VERBOSE_ENV}=1 shows it here)", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    console_out = os.fdopen(os.dup(1), "w", buffering=1)
    _console_err = os.fdopen(os.dup(2), "w", buffering=1)
    fd = os.open(role_log(cfg.run.dir, "driver"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = OursToConsole(console_out, sys.stdout)  # sys.stderr still writes to fd 2: driver.log
    ours = logging.StreamHandler(_console_err)
    ours.setFormatter(logging.Formatter(LOG_FORMAT))
    ours.setLevel(logging.WARNING)
    root = logging.getLogger()
    if not root.handlers:  # the driver's whole log, ours included, in driver.log
        logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=sys.stderr)
    for name in OUR_LOGGERS:
        logging.getLogger(name).addHandler(ours)
    return where


class OursToConsole(io.TextIOBase):
    """The quiet launcher's ``sys.stdout``: what our own code prints (a caller in :data:`OUR_PACKAGES` or the
    launcher's script) goes to the terminal, anything else to driver.log: a library's logging handler bound to
    sys.stdout when it was imported (DeepSpeed's "Setting accelerator to CPU" while a first run builds the tiny
    model), a library's ``print``. Its file descriptor is driver.log's (child processes given sys.stdout)."""

    def __init__(self, console: TextIO, log: TextIO) -> None:
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        frame = sys._getframe(1)
        while frame.f_back is not None and frame.f_globals.get("__name__", "") in PRINT_WRAPPERS:
            frame = frame.f_back  # a library's stand-in for print: whoever called print is the writer
        caller = frame.f_globals.get("__name__", "")
        ours = caller == "__main__" or caller.split(".")[0] in OUR_PACKAGES
        return (self.console if ours else self.log).write(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def fileno(self) -> int:
        return self.log.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.console.encoding


def role_log_note(run_dir: str | Path, role: str) -> str:
    """What an error line about a failed role adds: ``log: <its file>``."""
    return f"log: {role_log(run_dir, role)}"
