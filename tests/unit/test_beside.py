"""beside.Beside: on a run that does not fork its roles, the driver's held-out evaluation runs beside the roles'
start-up and hands back its result or its error (a run that forks them evaluates in a task: beside.TaskResult)."""

from __future__ import annotations

import threading
import time

import pytest

from async_rlhf.driver.beside import Beside

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



def test_a_failed_held_out_task_raises_what_failed_in_it() -> None:
    """beside.TaskResult raises ``heldout_task_failure`` of Ray's error: the task's cause, not Ray's first line
    (``ray::timed_heldout_accuracy() (pid=...)``), which is all the launcher's one-line error would show."""
    from async_rlhf.driver.beside import heldout_task_failure

    class TaskError(Exception):  # as Ray's task error carries the task's own exception
        cause = FileNotFoundError("no file named config.json in /m")

    err = heldout_task_failure(TaskError("ray::timed_heldout_accuracy() (pid=1, ip=10.0.0.2)"))
    assert str(err) == ("the held-out evaluation on learner rank 0's node failed: FileNotFoundError: no file named "
                        "config.json in /m")
    lost = heldout_task_failure(ValueError("the node died"))  # no cause: the error itself
    assert str(lost).endswith("failed: ValueError: the node died")


def test_a_failed_final_figure_is_none_with_a_warning_and_a_good_one_comes_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """beside.final_figure: the run is done when the final policy is evaluated; a failing evaluation (either way
    it runs) must not cost the summary, and says what failed."""
    from async_rlhf.driver.beside import final_figure

    assert final_figure(lambda: 0.75) == 0.75

    def broken() -> float:
        raise OSError("policy/model.safetensors: no such file")

    with caplog.at_level("WARNING"):
        assert final_figure(broken) is None
    assert "final policy failed: OSError: policy/model.safetensors: no such file" in caplog.text
