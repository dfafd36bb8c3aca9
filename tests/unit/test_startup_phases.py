"""The start-up deadlines (async_rlhf/startup/phases.py) on made-up times: a rank compiling past its budget is
slow, not stopped; a silent or stuck rank and a rendezvous past its timeout stop the run, naming the phase."""

from __future__ import annotations

from async_rlhf.startup.phases import (
    ENGINE,
    FIRST_PUSH,
    IMPORTS,
    MODEL,
    OP_BUILD,
    RENDEZVOUS,
    STARTED,
    Limits,
    StartupClock,
)

LIM = Limits(phase_s=100.0, rendezvous_s=60.0, silent_s=30.0)


def beats(clock: StartupClock, name: str, t0: float, t1: float, cpu_per_s: float, cpu0: float = 0.0) -> None:
    """Heartbeats every 2 s from t0 to t1, the process tree using ``cpu_per_s`` CPU seconds per second."""
    t = t0
    while t <= t1:
        clock.beat(name, t, cpu0 + cpu_per_s * (t - t0))
        t += 2.0


def test_a_compiling_rank_past_its_budget_is_slow_and_its_deadline_moves_on() -> None:
    clock = StartupClock(LIM, rendezvous="10.0.0.1:29500")
    clock.add("learner rank 0", "learners", "n1", 0.0)
    clock.report("learner rank 0", IMPORTS, "deepspeed", 5.0)
    clock.report("learner rank 0", OP_BUILD, "shm_comm", 10.0)
    beats(clock, "learner rank 0", 5.0, 100.0, 0.9)
    assert clock.check(100.0) == []
    beats(clock, "learner rank 0", 102.0, 111.0, 0.9, 0.9 * 97)
    events = clock.check(111.0)
    assert [e.kind for e in events] == ["slow"]
    assert "building op shm_comm for 101 s" in events[0].message and "still working" in events[0].message
    beats(clock, "learner rank 0", 112.0, 240.0, 0.9, 0.9 * 107)
    assert clock.check(150.0) == []  # extended by another budget
    assert [e.kind for e in clock.check(212.0)] == ["slow"]
    clock.report("learner rank 0", RENDEZVOUS, "", 240.0)
    assert clock.check(241.0) == []


def test_a_rank_stuck_with_nothing_progressing_stops_the_run_naming_its_phase() -> None:
    clock = StartupClock(LIM)
    clock.add("learner rank 0", "learners", "n1", 0.0)
    clock.report("learner rank 0", MODEL, "", 10.0)
    beats(clock, "learner rank 0", 10.0, 150.0, 0.001)  # alive, idle
    events = clock.check(150.0)
    assert [e.kind for e in events] == ["stop"] and events[0].phase == MODEL
    assert "made no progress loading model" in events[0].message


def test_a_waiting_rank_is_slow_while_another_rank_still_works() -> None:
    clock = StartupClock(LIM)
    for r in (0, 1):
        clock.add(f"learner rank {r}", "learners", "n1", 0.0)
    clock.report("learner rank 0", ENGINE, "", 10.0)  # waits in a collective for rank 1
    beats(clock, "learner rank 0", 10.0, 120.0, 0.0)
    clock.report("learner rank 1", MODEL, "", 10.0)
    beats(clock, "learner rank 1", 10.0, 120.0, 1.0)
    events = clock.check(120.0)
    assert {e.kind for e in events} == {"slow"}
    rank0 = next(e for e in events if e.rank == "learner rank 0")
    assert "waiting while other ranks still make progress" in rank0.message


def test_a_silent_rank_stops_the_run_at_once() -> None:
    clock = StartupClock(LIM)
    clock.add("generator 0", "generators", "n2", 0.0)
    clock.report("generator 0", ENGINE, "", 5.0)
    beats(clock, "generator 0", 5.0, 20.0, 1.0)
    assert clock.check(45.0) == []
    events = clock.check(51.0)
    assert events[0].kind == "stop" and "went silent while building engine" in events[0].message
    assert "no heartbeat for 32 s" in events[0].message


def test_a_process_that_never_reports_stops_the_run_once_nothing_else_progresses() -> None:
    clock = StartupClock(LIM)
    clock.add("generator 0", "generators", "n2", 0.0)
    clock.add("generator 1", "generators", "n2", 0.0)
    clock.report("generator 1", ENGINE, "", 5.0)
    beats(clock, "generator 1", 5.0, 101.0, 1.0)
    assert [e.kind for e in clock.check(101.0)] == ["slow"]  # generator 1 still works
    beats(clock, "generator 1", 103.0, 150.0, 1.0, 98.0)
    clock.report("generator 1", STARTED, "", 150.0)
    events = clock.check(205.0)
    assert events[0].kind == "stop" and "did not start" in events[0].message and "generator 0" in events[0].message


def test_ranks_waiting_for_a_fork_server_that_imports_are_slow_not_stopped() -> None:
    """No rank has reported (each waits for its node's fork server, still importing): the server's CPU is their
    progress; once it is idle and still nobody reports, the run stops as before."""
    clock = StartupClock(LIM)
    clock.add("generator 0", "generators", "n1", 0.0)
    clock.add("learner rank 0", "learners", "n1", 0.0)
    for t in range(0, 102, 2):
        clock.helper_cpu(float(t), 0.9 * t)
    events = clock.check(101.0)
    assert [e.kind for e in events] == ["slow", "slow"], events
    assert "starting for 101 s" in events[0].message and "fork server" in events[0].message
    for t in range(102, 260, 2):
        clock.helper_cpu(float(t), 0.9 * 101)  # imports done, nothing forked: idle
    events = clock.check(259.0)
    assert events[-1].kind == "stop" and "did not start" in events[-1].message


def test_the_rendezvous_counts_from_the_last_rank_reaching_it_and_is_never_extended() -> None:
    clock = StartupClock(LIM, rendezvous="10.0.0.1:29500")
    for r in (0, 1):
        clock.add(f"learner rank {r}", "learners", f"n{r}", 0.0)
    clock.report("learner rank 1", RENDEZVOUS, "", 10.0)  # waits there while rank 0 compiles for 200 s
    clock.report("learner rank 0", OP_BUILD, "shm_comm", 10.0)
    beats(clock, "learner rank 1", 10.0, 150.0, 0.0)
    beats(clock, "learner rank 0", 10.0, 150.0, 1.0)
    assert all(e.kind == "slow" and e.rank == "learner rank 0" for e in clock.check(150.0))
    beats(clock, "learner rank 1", 152.0, 265.0, 0.0)
    beats(clock, "learner rank 0", 152.0, 210.0, 1.0, 142.0)
    clock.report("learner rank 0", RENDEZVOUS, "", 210.0)
    beats(clock, "learner rank 0", 212.0, 265.0, 0.0, 200.0)
    assert clock.check(265.0) == []  # 55 s after the last arrival, though rank 1 has sat there 255 s
    clock.beat("learner rank 0", 270.0, 200.0)
    clock.beat("learner rank 1", 270.0, 0.0)
    events = clock.check(271.0)
    assert [e.kind for e in events] == ["stop"] and events[0].phase == RENDEZVOUS
    assert "10.0.0.1 on TCP port 29500" in events[0].message and "learner rank 0 on node n0" in events[0].message


def test_progress_line_and_durations() -> None:
    clock = StartupClock(LIM)
    for g in range(3):
        clock.add(f"generator {g}", "generators", "n", 0.0)
        clock.report(f"generator {g}", ENGINE, "", 4.0)
    clock.report("generator 0", STARTED, "", 20.0)
    clock.add("learner rank 0", "learners", "n", 0.0)
    clock.report("learner rank 0", IMPORTS, "deepspeed", 3.0)
    clock.report("learner rank 0", OP_BUILD, "shm_comm", 8.0)
    assert clock.progress_line(41.0, 0.0) == ("start-up 41 s: generators 1/3 ready, 2/3 building engine; "
                                               "learners 0/1 ready, 1/1 building op shm_comm")
    clock.report("learner rank 0", STARTED, "", 50.0)
    clock.enter(["generator 0", "learner rank 0"], FIRST_PUSH, 60.0)
    d = clock.durations(61.0)
    assert d["generators"]["engine build"] == 57.0  # the slowest generator, still building at 61 s
    assert d["generators"]["process start"] == 4.0 and d["generators"]["first push"] == 1.0
    assert d["learners"] == {"process start": 3.0, "imports": 5.0, "op build": 42.0, "first push": 1.0}


def test_reports_arriving_after_the_driver_saw_the_rank_ready_go_in_their_place() -> None:
    clock = StartupClock(LIM)
    clock.add("generator 0", "generators", "n", 0.0)
    clock.report("generator 0", IMPORTS, "vllm", 2.0)
    clock.report("generator 0", STARTED, "", 30.0)  # ready() returned before the board was read again
    clock.report("generator 0", ENGINE, "", 10.0)
    clock.report("generator 0", STARTED, "", 29.5)  # the rank's own report of it
    assert clock.ranks["generator 0"].phase == STARTED and clock.check(500.0) == []
    assert clock.durations(40.0)["generators"] == {"process start": 2.0, "imports": 8.0, "engine build": 19.5}
