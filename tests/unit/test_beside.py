"""runner.Beside: on a run that does not fork its roles, the driver's held-out evaluation runs beside the roles'
start-up and hands back its result or its error (a run that forks them evaluates in a task: runner.TaskResult)."""

from __future__ import annotations

import threading
import time

import pytest

from async_rlhf.driver.runner import Beside

pytestmark = pytest.mark.unit


def test_the_work_runs_while_the_caller_goes_on_and_its_result_comes_back() -> None:
    started, release = threading.Event(), threading.Event()

    def work(x: int) -> int:
        started.set()
        assert release.wait(5), "the caller never released the work"
        return x * 2

    beside = Beside(work, 21)
    assert started.wait(5), "the work did not start at once"
    release.set()  # the caller was free to go on while the work waited
    assert beside.result() == 42
    assert 0.0 <= beside.seconds < 5


def test_an_error_of_the_work_is_raised_by_result() -> None:
    def work() -> None:
        raise FileNotFoundError("no model here")

    beside = Beside(work)
    with pytest.raises(FileNotFoundError, match="no model here"):
        beside.result()


def test_the_thread_does_not_keep_a_failed_run_alive() -> None:
    beside = Beside(time.sleep, 30)
    assert beside._thread.daemon


def test_a_held_out_task_hands_back_its_figure_or_what_failed_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """runner.TaskResult: the accuracy and the task's seconds; a failed task raises its cause, not Ray's first line
    (``ray::timed_heldout_accuracy() (pid=...)``), which is all the launcher's one-line error would show."""
    import ray

    from async_rlhf.driver.runner import TaskResult

    monkeypatch.setattr(ray, "get", lambda ref: (0.5, 1.25))
    task = TaskResult(object())
    assert task.result() == 0.5 and task.seconds == 1.25

    class Failed(ray.exceptions.RayError):
        cause = FileNotFoundError("no file named config.json in /m")

    def failing_get(ref: object) -> None:
        raise Failed("ray::timed_heldout_accuracy() (pid=1, ip=10.0.0.2)")

    monkeypatch.setattr(ray, "get", failing_get)
    with pytest.raises(RuntimeError, match="rank 0's node failed: FileNotFoundError: no file named config.json"):
        TaskResult(object()).result()
