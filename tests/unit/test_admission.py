"""The staleness rule worked by hand: admission counts and the consumption test."""

import pytest

from async_rlhf.buffer.admission import AdmissionControl, is_stale, staleness


def test_synchronous_rule_grants_one_batch_per_version():
    a = AdmissionControl(groups_per_version=4, max_staleness=0)
    assert a.capacity == 4
    assert a.admit(10) == 4
    assert a.running == 4
    assert a.admit(10) == 0
    assert a.admit(1) == 0
    for _ in range(4):
        a.finished()
    assert (a.accepted, a.running) == (4, 0)
    # all four finished, but the learner has not moved: still nothing
    assert a.admit(10) == 0
    a.set_version(1)
    assert a.capacity == 8
    assert a.admit(3) == 3
    assert a.admit(10) == 1
    assert a.admit(10) == 0
    assert (a.accepted, a.running) == (4, 4)


def test_max_staleness_two_runs_two_versions_ahead():
    a = AdmissionControl(groups_per_version=4, max_staleness=2)
    assert a.admit(100) == 12
    assert a.admit(1) == 0
    a.set_version(1)
    assert a.admit(100) == 4
    a.set_version(3)  # versions may jump
    assert a.admit(100) == 8
    assert a.running == 24


def test_admit_never_grants_negative_or_more_than_asked():
    a = AdmissionControl(groups_per_version=4, max_staleness=1)
    assert a.admit(0) == 0
    assert a.admit(-5) == 0
    assert a.admit(3) == 3
    assert a.admit(2) == 2
    assert a.running == 5


def test_release_frees_slots():
    a = AdmissionControl(groups_per_version=4, max_staleness=0)
    assert a.admit(4) == 4
    a.release(3)
    assert a.running == 1
    assert a.admit(10) == 3
    a.release(100)  # never below zero
    assert a.running == 0
    assert a.admit(10) == 4


def test_dropped_frees_accepted_slots():
    a = AdmissionControl(groups_per_version=4, max_staleness=0)
    assert a.admit(4) == 4
    for _ in range(4):
        a.finished()
    assert a.admit(1) == 0
    a.dropped(2)
    assert a.accepted == 2
    assert a.admit(10) == 2
    a.dropped()
    assert a.accepted == 1
    a.dropped(50)
    assert a.accepted == 0
    assert a.admit(10) == 2  # 4 capacity - 0 accepted - 2 running


def test_finished_without_running_does_not_go_negative():
    a = AdmissionControl(groups_per_version=2, max_staleness=0)
    a.finished()  # e.g. a group from before a restart
    assert (a.accepted, a.running) == (1, 0)
    assert a.admit(5) == 1


def test_set_version_backwards_raises():
    a = AdmissionControl(groups_per_version=4, max_staleness=0)
    a.set_version(3)
    a.set_version(3)  # same version is fine
    with pytest.raises(ValueError, match="backwards"):
        a.set_version(2)
    assert a.version == 3


@pytest.mark.parametrize("learner,oldest,expected", [(5, 5, 0), (5, 3, 2), (0, 0, 0), (2, 4, -2), (10, 0, 10)])
def test_staleness(learner, oldest, expected):
    assert staleness(learner, oldest) == expected


@pytest.mark.parametrize("learner,oldest,max_staleness,expected", [
    (5, 5, 0, False),
    (5, 4, 0, True),
    (5, 3, 2, False),
    (5, 2, 2, True),
    (1, 3, 0, False),
])
def test_is_stale(learner, oldest, max_staleness, expected):
    assert is_stale(learner, oldest, max_staleness) is expected
