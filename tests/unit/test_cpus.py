from __future__ import annotations

import os

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.cpu_spec import CpuSpecError, parse_cores
from async_rlhf.driver.cpu_plan import (
    pin_this_process,
    plan_cpus,
    plan_for_config,
    split_blocks,
)


def cores(plan, actor: str) -> tuple[int, ...]:
    return plan.placements[actor].cores


def test_auto_gives_each_role_its_own_cores_in_proportion() -> None:
    plan = plan_cpus(tuple(range(8)), generators=3, learners=1)
    assert plan.cores_of("learner") == (6, 7)
    assert plan.cores_of("generator") == (0, 1, 2, 3, 4, 5)
    assert [cores(plan, f"generator {i}") for i in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert cores(plan, "buffer") == plan.cores_of("learner"), "the buffer answers puts beside the learners"
    assert not plan.oversubscribed


def test_buffer_beside_the_generators_on_a_node_without_learners() -> None:
    plan = plan_cpus((0, 1, 2, 3), generators=2, learners=0)
    assert cores(plan, "buffer") == (0, 1, 2, 3) == plan.cores_of("generator")


def test_two_cores_one_generator_one_learner_split_one_each() -> None:
    plan = plan_cpus((0, 1), generators=1, learners=1)
    assert cores(plan, "generator 0") == (0,)
    assert cores(plan, "learner 0") == (1,)
    assert not plan.oversubscribed


def test_more_actors_than_cores_share_and_are_flagged() -> None:
    plan = plan_cpus((0, 1), generators=3, learners=1, generator_cpus="0")
    assert cores(plan, "generator 0") == cores(plan, "generator 1") == cores(plan, "generator 2") == (0,)
    assert cores(plan, "learner 0") == (1,)
    assert plan.oversubscribed and "[0]" in plan.warnings[-1]


def test_on_a_small_host_generators_borrow_the_learners_cores_at_lower_priority() -> None:
    plan = plan_cpus((0, 1), generators=2, learners=1)  # the demo on 2 cores: one generator core for two
    assert cores(plan, "generator 0") == (0,) and cores(plan, "generator 1") == (1,)
    assert cores(plan, "learner 0") == (1,)
    assert [plan.placements[f"generator {i}"].nice for i in range(2)] == [10, 10]
    assert plan.placements["learner 0"].nice == 0 and "borrow" in plan.warnings[-1]
    assert "--generators 1" in plan.warnings[-1]  # on 2 cores: the faster fleet is named
    four = plan_cpus((0, 1, 2, 3), generators=4, learners=1)  # borrows too, but the 2-core advice is not its
    assert "borrow" in four.warnings[-1] and "--generators 1" not in four.warnings[-1]
    assert plan_cpus((0, 1), 2, 1, generator_nice=5).placements["generator 0"].nice == 5
    roomy = plan_cpus(tuple(range(8)), generators=2, learners=1)  # enough cores: fleets kept apart
    assert not set(roomy.cores_of("generator")) & set(roomy.cores_of("learner"))
    assert roomy.placements["generator 0"].nice == 0


def test_single_core_is_shared_by_everyone() -> None:
    plan = plan_cpus((3,), generators=1, learners=1)
    assert cores(plan, "generator 0") == cores(plan, "learner 0") == (3,)
    assert plan.oversubscribed


def test_explicit_fleet_and_the_other_takes_the_rest() -> None:
    plan = plan_cpus(tuple(range(4)), generators=2, learners=1, learner_cpus="0")
    assert cores(plan, "learner 0") == (0,)
    assert plan.cores_of("generator") == (1, 2, 3)
    assert [cores(plan, f"generator {i}") for i in range(2)] == [(1, 2), (3,)]


def test_all_shares_every_core_and_threads_above_cores_are_flagged() -> None:
    plan = plan_cpus((0, 1), 1, 1, generator_cpus="all", learner_cpus="all", generator_threads=2,
                     learner_threads=3)
    assert cores(plan, "generator 0") == cores(plan, "learner 0") == (0, 1)
    assert any("learner 0: 3 threads on 2" in w for w in plan.warnings)


def test_parse_cores_ranges_and_errors_name_the_fix() -> None:
    assert parse_cores("0-2,5", tuple(range(8)), "k") == (0, 1, 2, 5)
    with pytest.raises(CpuSpecError, match=r"core\(s\) \[9\].*available here"):
        parse_cores("8-9", tuple(range(9)), "learner.cpus")
    with pytest.raises(CpuSpecError, match="not a core id"):
        parse_cores("one", (0,), "generator.cpus")


def test_split_blocks_sizes_differ_by_at_most_one() -> None:
    blocks = split_blocks(tuple(range(7)), 3)
    assert [len(b) for b in blocks] == [3, 2, 2]
    assert sum(blocks, ()) == tuple(range(7))


def test_config_refuses_a_bad_core_list_at_load() -> None:
    with pytest.raises(ConfigError, match="generator.cpus"):
        load_config(None, ["generator.cpus=0-x"])


def test_plan_for_config_uses_this_process_affinity() -> None:
    cfg = load_config(None, ["generators=1", "learners=1"])
    plan = plan_for_config(cfg)
    assert set(plan.available) == os.sched_getaffinity(0)
    assert set(plan.cores_of("generator")) | set(plan.cores_of("learner")) == set(plan.available)


def test_pin_this_process_narrows_and_restores_affinity() -> None:
    before = tuple(sorted(os.sched_getaffinity(0)))
    try:
        assert pin_this_process(before[:1]) == [before[0]]
    finally:
        pin_this_process(before)
    assert tuple(sorted(os.sched_getaffinity(0))) == before


def _niceness_after_pinning(queue) -> None:
    import threading

    started = threading.Event()
    threading.Thread(target=started.wait, daemon=True).start()  # a thread that exists before the pinning
    before = os.getpriority(os.PRIO_PROCESS, 0)
    pin_this_process(tuple(sorted(os.sched_getaffinity(0))), nice=5)
    late = []
    t = threading.Thread(target=lambda: late.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    t.start()
    t.join()
    every = []
    for tid in os.listdir("/proc/self/task"):
        try:
            every.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except ProcessLookupError:  # a helper thread that ended meanwhile
            continue
    queue.put((before, every, late[0]))
    started.set()


def test_generators_that_borrow_cores_run_at_lower_priority_in_every_thread() -> None:
    import multiprocessing as mp

    plan = plan_cpus((0, 1), 2, 1, generator_cpus="all", generator_nice=5)
    assert [plan.placements[f"generator {i}"].nice for i in range(2)] == [5, 5]
    assert plan.placements["learner 0"].nice == 0
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_niceness_after_pinning, args=(queue,))
    proc.start()
    before, every_thread, started_later = queue.get(timeout=60)
    proc.join(10)
    assert set(every_thread) == {before + 5} and started_later == before + 5
