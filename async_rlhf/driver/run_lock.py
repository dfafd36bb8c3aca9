"""One driver per run directory: an exclusive ``flock`` on ``run_dir/.driver.lock``, held for the driver's life.

Two drivers on one directory (a second ``--resume`` while the first runs, a repeated command, a ``run.overwrite``
over a live run) would write the same staging directories, prune each other's checkpoints and share one buffer
prefix. The second one is refused before it changes anything, naming the live run's pid.

The kernel drops the lock when the holder's process ends, however it ends (SIGKILL included), so a crashed
driver never leaves a stale lock: the file stays, the lock does not. No torch or ray import here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from async_rlhf.config import ConfigError

LOCK_NAME = ".driver.lock"
BRIEF_S = 0.5
"""How long a driver taking the lock waits out a holder: :func:`refuse_if_live` holds it for an instant."""


class RunDirInUse(ConfigError):
    """Another live driver holds the run directory."""


class RunDirLock:
    """The held lock; :meth:`release` (or the process's end) frees it."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir = run_dir
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor of the open file releases the flock
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def holder(run_dir: str | Path) -> dict[str, Any]:
    """What the live driver wrote into the lock file (pid, host, start time); empty if unreadable."""
    try:
        return json.loads((Path(run_dir) / LOCK_NAME).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def in_use(run_dir: Path) -> RunDirInUse:
    """The refusal of a second driver, naming the live one."""
    live = holder(run_dir)
    who = f"pid {live.get('pid', '?')} on {live.get('host', '?')}"
    since = (f", started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(live['started']))}"
             if isinstance(live.get("started"), (int, float)) else "")
    return RunDirInUse(f"run.dir {run_dir} is in use by a live run ({who}{since}); two drivers on one directory "
                       f"would overwrite each other's checkpoints. Stop it first (python launch/cluster.py stop "
                       f"--run-dir {run_dir}), wait for it to end, or give another --run-dir")


def refuse_if_live(run_dir: str | Path) -> None:
    """Raise :class:`RunDirInUse` if a live driver holds ``run_dir`` (creates nothing): what the launcher asks
    first, before any other check of the directory (a repeated command must hear of the live run, not be told to
    overwrite it)."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # no lock file: no driver ever held it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise in_use(Path(run_dir)) from None
    finally:
        os.close(fd)


def hold_run_dir(run_dir: str | Path) -> RunDirLock:
    """Take the run directory for this process (creating it), or raise :class:`RunDirInUse` naming the holder."""
    d = Path(run_dir)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"run.dir {d} is a file; give a new or empty directory (--run-dir)")
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + BRIEF_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:  # a live driver: it holds the lock for its whole life
                os.close(fd)
                raise in_use(d) from None
            time.sleep(0.02)  # a launcher's refuse_if_live holds it for an instant
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, body, 0)
    return RunDirLock(d, fd)
