"""The rank side of the start-up board: ``phase()`` as the rank goes, and a heartbeat thread with the CPU its
process tree uses (a compiler runs in child processes), until the board says start-up is over."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from async_rlhf.startup.board import BOARD_ENV

log = logging.getLogger(__name__)


def tree_cpu_seconds() -> float:
    """CPU seconds of this process, its finished children and its live descendants (ninja, gcc)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
            total += c.user + c.system
        except psutil.Error:
            continue
    return total


class StartupReporter:
    """Reports of rank ``name`` (``learner rank 0``); does nothing outside a run (no board named)."""

    def __init__(self, name: str, every_s: float = 2.0) -> None:
        self.name = name
        self.every_s = every_s
        self._board: Any = None
        board = os.environ.get(BOARD_ENV)
        if not board:
            return
        try:
            import ray

            self._board = ray.get_actor(board)
        except Exception as exc:  # noqa: BLE001 - reporting must never stop a rank from starting
            log.warning("start-up board %s not found (%s): no start-up progress from %s", board, exc, name)
            return
        threading.Thread(target=self._beat, name="startup-heartbeat", daemon=True).start()

    def phase(self, phase: str, detail: str = "") -> None:
        if self._board is not None:
            self._board.phase.remote(self.name, phase, detail)

    def _beat(self) -> None:
        import ray

        while True:  # until the board answers that start-up is over
            try:
                if not ray.get(self._board.beat.remote(self.name, tree_cpu_seconds()), timeout=30):
                    return
            except ray.exceptions.RayActorError:  # the board is gone: the run is over
                return
            except Exception:  # noqa: BLE001 - the board is slow: try again
                pass
            time.sleep(self.every_s)
