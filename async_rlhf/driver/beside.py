"""What runs beside a training run: the held-out evaluation of the policy before and after RL, in a thread of the
driver (:class:`Beside`) or in a task forked on learner rank 0's node (:class:`TaskResult`), and the rule that a
failed final evaluation never costs the run its summary (:func:`final_figure`)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class Beside:
    """``fn(*args)`` on a daemon thread, beside what the caller does meanwhile; :meth:`result` waits for it and
    raises what it raised. On a run that does not fork its roles (GPU runs, ``run.fork_workers=false``), the
    driver's held-out evaluation (a transformers forward of a small held-out set) runs so beside the roles'
    start-up and beside the shutdown; a run that forks its roles evaluates in a task forked from learner rank 0's
    server instead (``Cluster.heldout``).
    A daemon: a run that fails to start does not wait for it."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True, name="beside")
        self.started = time.time()
        self._thread.start()

    def _run(self, fn: Any, args: tuple[Any, ...]) -> None:
        try:
            self._box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self._box["error"] = exc
        self._box["seconds"] = time.time() - self.started

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]

    @property
    def seconds(self) -> float:
        """How long ``fn`` ran (once :meth:`result` returned)."""
        return self._box["seconds"]


class TaskResult:
    """A ref of ``timed_heldout_accuracy`` (``Cluster.heldout``) with :class:`Beside`'s interface; a failed task
    raises what failed in it (the first line of Ray's own error names only the task)."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self.seconds = 0.0

    def result(self) -> float:
        import ray

        try:
            value, self.seconds = ray.get(self.ref)
        except ray.exceptions.RayError as exc:
            raise heldout_task_failure(exc) from exc
        return value


def final_figure(fn: Any) -> Any:
    """``fn()``, a held-out figure of the final policy, or None with a warning if it failed: the run is done, its
    summary is still written, without the figure."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("the held-out evaluation of the final policy failed: %s: %s", type(exc).__name__, exc)
        return None


def heldout_task_failure(exc: BaseException) -> RuntimeError:
    """What a failed held-out task raises: the error in the task (Ray's error carries it as ``cause``), named with
    where it ran."""
    cause = getattr(exc, "cause", None) or exc
    return RuntimeError(f"the held-out evaluation on learner rank 0's node failed: {type(cause).__name__}: {cause}")
