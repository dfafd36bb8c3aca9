"""bench/scale.py's pure parts (its rows come from a namespace cluster: tests/cluster's 8 + 8 scenario runs the job
end to end): the target, the table, where the start-up time went, the plot, and the steady-state step rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def scale(load_bench: Any) -> Any:
    return load_bench("scale.py")


def row(n: int, complete: bool = True, rss_sum: float = 9000.0) -> dict[str, Any]:
    return {"generators": n, "learners": n, "nodes": min(n, 4), "startup_s": 40.0 * n,
            "startup_s_by_phase": {"driver": {"model": 1.2, "ray start": 0.3},
                                   "generators": {"imports": 9.0, "engine": 20.0 * n},
                                   "learners": {"imports": 6.0, "rendezvous": 0.2}},
            "steps_per_s": 1.5 / n, "push_s": 0.02 * n, "push_broadcast_s": 0.004 * n, "raw_broadcast_s": 0.003 * n,
            "raw_bytes": 1.2e6, "allreduce_s": 0.0005 * n, "rss_mb_generator": 950.0, "rss_mb_learner": 610.0,
            "rss_mb_sum": rss_sum, "memory_estimate": {"total_gb": 1.0 + 1.6 * n}, "versions_complete": complete,
            "version_gaps": [] if complete else ["generator(s) {1: 3} end on another version than the final 4"],
            "push_quiet_s": 0.004 * n, "raw_quiet_s": 0.003 * n, "push_training_s": 0.02 * n,
            "raw_training_s": 0.01 * n, "raw_training_during": n < 4, "pss_mb_generator": 400.0,
            "pss_mb_learner": 300.0, "pss_mb_sum": 900.0 * n, "machine_used_mb": 2000.0 * n, "plan_mb": 1800.0 * n,
            "step_time_s": {"step": 0.5, "wait_data": 0.3, "forward_backward": 0.15},
            "serve_quiet": {"pairs": 5 * n, "bound_held": 5 * n, "served_s": 0.02},
            "serve_training": {"pairs": 7 * n, "bound_held": 7 * n, "steps_held": 6 * n, "served_s": 0.05,
                               "ack_to_live_s": 0.03,
                               "ack_to_live_s_max": 0.06, "step_s": 0.04, "apply_s": 0.01}}


def test_the_target_needs_every_version_everywhere_and_the_memory_to_fit(scale: Any) -> None:
    assert scale.holds([row(1), row(2)], 24000.0)
    assert not scale.holds([row(1), row(2, complete=False)], 24000.0)
    assert not scale.holds([{**row(8), "pss_mb_sum": 25000.0}], 24000.0)
    assert scale.holds([row(8, rss_sum=25000.0)], 24000.0), "summed RSS counts shared pages again: PSS decides"
    no_pss = {k: v for k, v in row(8, rss_sum=25000.0).items() if k != "pss_mb_sum"}
    assert not scale.holds([no_pss], 24000.0), "without PSS the summed RSS peaks decide"
    assert not scale.holds([], 24000.0)


def test_table_and_start_up_lines_name_every_row_and_its_slowest_phases(scale: Any) -> None:
    lines = scale.table([row(1), row(2, complete=False)]).splitlines()
    assert len(lines) == 3 and lines[1].split()[:3] == ["1", "1", "1"] and lines[1].endswith("complete")
    assert "GAPS: generator(s) {1: 3}" in lines[2]
    line = scale.phase_line(row(2))
    assert line.startswith("  2+2 start-up 80 s:") and "generators engine 40, imports 9" in line
    assert "rendezvous" not in line, "phases under half a second are left out"


def test_the_plot_is_written(scale: Any, tmp_path: Path) -> None:
    scale.plot([row(1), row(2), row(4)], tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_steps_per_s_leaves_the_first_step_out(load_bench: Any) -> None:
    job = load_bench("scale_job.py")
    assert job.steps_per_s([{"time": 100.0}, {"time": 104.0}, {"time": 106.0}]) == 2 / 6  # 2 steps after the first
    assert job.steps_per_s([{"time": 100.0}]) == 0.0


def test_where_a_step_goes(scale: Any, load_bench: Any) -> None:
    job = load_bench("scale_job.py")
    records = [{"time/step_s": 9.0, "time/wait_data_s": 8.0}, {"time/step_s": 1.0, "time/wait_data_s": 0.25,
                                                               "time/optimizer_s": 0.001},
               {"time/step_s": 2.0, "time/wait_data_s": 0.75, "time/push_wait_s": 0.5}]
    times = job.step_times(records)
    assert times == {"optimizer": 0.0005, "push_wait": 0.25, "step": 1.5, "wait_data": 0.5}
    line = scale.step_line({**row(2), "step_time_s": times})
    assert line == "  2+2 step 1.50 s: wait_data 0.50, push_wait 0.25"


def test_the_push_target_reads_the_quiet_ratio_and_the_serving_bound(scale: Any) -> None:
    assert scale.push_holds([row(1), row(2), row(4)])  # 0.004 n <= 1.5 x 0.003 n, every pair within its bound
    slow = {**row(2), "push_quiet_s": 0.0091, "raw_quiet_s": 0.006}
    assert not scale.push_holds([row(1), slow])
    late = {**row(2), "serve_training": {**row(2)["serve_training"], "bound_held": 13}}
    assert not scale.push_holds([late])
    assert not scale.push_holds([{**row(1), "raw_quiet_s": 0.0}]) and not scale.push_holds([])


def test_push_table_marks_a_raw_broadcast_that_outlasted_training(scale: Any) -> None:
    lines = scale.push_table([row(1), row(4)]).splitlines()
    assert len(lines) == 3 and lines[1].split()[:4] == ["1+1", "4.0", "3.0", "1.33"]
    assert "40.0*" in lines[2] and "*" not in lines[1] and lines[1].endswith("7/7      6/7")


def test_full_adds_sixteen(scale: Any) -> None:
    assert scale.ns_for(quick=True, full=False) == [1, 2, 4]
    assert scale.ns_for(quick=False, full=False) == [1, 2, 4, 8]
    assert scale.ns_for(quick=False, full=True) == [1, 2, 4, 8, 16]
    assert scale.cpus_per_node(8, 4) == 6 and scale.cpus_per_node(16, 4) == 9  # 32 roles + 2 on 4 nodes
