"""The readings of bench/vs_trl.py (bench/vs_trl_stats.py, bench/process_cpu.py, bench/vs_trl_report.py): what TRL
holds by its end, and the time a curve takes to hold a level."""

from __future__ import annotations

from typing import Any

import pytest


def curve(*points: tuple[float, float]) -> list[dict[str, float]]:
    return [{"time_s": t, "accuracy": a} for t, a in points]


def test_held_accuracy_is_the_mean_of_the_second_half_not_a_dipping_last_evaluation(stats: Any) -> None:
    trl = curve((0, 0.4), (100, 0.9), (300, 0.99), (450, 0.98), (600, 0.91))
    assert stats.held_accuracy(trl, 300) == pytest.approx((0.99 + 0.98 + 0.91) / 3)
    # no evaluation in the second half: the last one
    assert stats.held_accuracy(curve((0, 0.4), (100, 0.8)), 300) == pytest.approx(0.8)


def test_time_to_hold_needs_consecutive_evaluations_not_one_lucky_one(stats: Any) -> None:
    ours = curve((0, 0.4), (5, 0.97), (10, 0.85), (15, 0.9), (20, 0.96), (25, 0.97), (30, 0.98))
    assert stats.time_to(ours, 0.95) == 5  # one evaluation above is enough for the first reading
    # means of three in a row: 0.74, 0.907, 0.903, 0.943, 0.970
    assert stats.time_to(ours, 0.95, 3) == 30
    assert stats.time_to(ours, 0.9, 3) == 15
    assert stats.time_to(ours, 0.99, 3) is None
    assert stats.time_to(ours[:2], 0.1, 3) is None  # fewer evaluations than the window


def test_the_report_divides_by_trls_own_time_to_hold_when_trl_saturates_early(vs_report: Any, capsys: Any) -> None:
    """TRL holding its accuracy within seconds makes "over TRL's budget" tiny; the target speaks of TRL's time."""
    row = {"task": "addition", "trl_accuracy_end": 0.98, "trl_time_s": 600.0, "ours_accuracy_end": 0.99,
           "ours_time_s": 600.0, "trl_first_at_its_end_accuracy_s": 5.0, "time_to_trl_accuracy_s": 17.0,
           "time_to_threshold_s": {}, "trl_steps": 100, "ours_steps": 50, "trl_samples_per_s": 1.0,
           "ours_samples_per_s": 1.0, "ours_generated_samples_per_s": 2.0, "zero_advantage_share": 0.5,
           "learner_push_wait_fraction": 0.0, "learner_compute_fraction": 0.3, "trl_accuracy_held": 0.97,
           "trl_time_to_its_held_accuracy_s": 16.0, "time_to_trl_held_accuracy_s": 20.0,
           "time_to_hold_threshold_s": {}}
    vs_report.report(row)
    out = capsys.readouterr().out
    assert "ours / TRL's budget: 0.03" in out and "ours / TRL's own time to hold it (16 s): 1.25" in out
    vs_report.report({**row, "trl_time_to_its_held_accuracy_s": None})
    assert "own time" not in capsys.readouterr().out  # TRL never held it (3 in a row): no such ratio


def test_tree_cpu_counts_the_descendants_of_the_process(process_cpu: Any) -> None:
    """The cluster's CPU time is its driver's and every process under it: a busy grandchild must show up."""
    import subprocess
    import sys
    import time

    import psutil

    busy = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\ntime.sleep(30)"
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {busy!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        deadline = time.time() + 20
        while process_cpu.tree_cpu_s(parent.pid) < 0.6 and time.time() < deadline:
            time.sleep(0.1)
        assert process_cpu.tree_cpu_s(parent.pid) >= 0.6
    finally:
        for child in psutil.Process(parent.pid).children(recursive=True):
            child.kill()
        parent.kill()
        parent.wait()
    assert process_cpu.tree_cpu_s(parent.pid) == 0.0  # gone: nothing to count


def test_cpu_readings_per_sample_trained_and_generated(stats: Any) -> None:
    trl = {"time_s": 600.0, "cpu": {"cpu_s": 120.0, "time_s": 60.0, "samples": 60_000}}
    ours = {"time_s": 605.0, "cpu": {"cpu_s": 90.0, "time_s": 60.0, "samples": 30_000, "generated_samples": 90_000}}
    got = stats.cpu_readings(trl, ours)  # over the seconds the CPU was read over, not the run's span
    assert got["trl_cores_busy"] == pytest.approx(2.0) and got["ours_cores_busy"] == pytest.approx(1.5)
    assert got["trl_cpu_ms_per_sample"] == pytest.approx(2.0)
    assert got["ours_cpu_ms_per_sample"] == pytest.approx(3.0)
    assert got["ours_cpu_ms_per_generated_sample"] == pytest.approx(1.0)
    nothing_generated = {**ours, "cpu": {**ours["cpu"], "generated_samples": 0}}
    assert stats.cpu_readings(trl, nothing_generated)["ours_cpu_ms_per_generated_sample"] is None


def test_ours_set_reaches_our_config_only_and_a_wrong_key_is_refused_before_any_run(bench: Any) -> None:
    cfg = bench.task_config("addition", ("generator.groups_in_flight=24",))
    assert cfg.generator.groups_in_flight == 24 and cfg.generator.max_new_tokens == 6
    assert bench.task_config("addition").generator.groups_in_flight != 24
    with pytest.raises(ValueError, match="groups_in_fligt"):
        bench.task_config("addition", ("generator.groups_in_fligt=24",))


def test_ours_set_never_reaches_trls_run(bench: Any, monkeypatch: Any, tmp_path: Any) -> None:
    """TRL trains with the shared settings whatever --ours-set says (a what-if changes our side only)."""
    seen: dict[str, Any] = {}

    class Captured(Exception):
        pass

    def capture_trl(cfg: Any, *_: Any) -> None:
        seen["cfg"] = cfg
        raise Captured

    monkeypatch.setattr(bench, "start_policy", lambda cfg: str(tmp_path))
    monkeypatch.setattr(bench, "run_trl", capture_trl)
    with pytest.raises(Captured):
        bench.compare("addition", 10.0, 1.0, tmp_path, ours_set=("train.lr=0.5", "generator.temperature=0.3"))
    assert seen["cfg"].train.lr == pytest.approx(1e-4) and seen["cfg"].generator.temperature == pytest.approx(1.0)


def test_the_target_ratio_is_our_time_over_trls_and_never_reaching_it_misses(stats: Any) -> None:
    assert stats.target_ratio({"time_to_trl_accuracy_s": 45.0, "trl_time_s": 90.0}) == pytest.approx(0.5)
    assert stats.target_ratio({"time_to_trl_accuracy_s": None, "trl_time_s": 90.0}) == float("inf")


def test_the_half_time_target_is_the_600_s_budgets_and_a_short_budget_says_why_not(stats: Any) -> None:
    assert stats.target_for(600.0)[0] == 0.5 and "not" not in stats.target_for(600.0)[1]
    ratio, text = stats.target_for(90.0)
    assert ratio == 1.0 and "1.0, not 0.5, with a 90 s budget" in text
