"""bench/vs_trl.py over seeds (issue 47): each side's readings per seed with their mean and std (a seed that never
reached the target left out and counted), both sides at equal time and equal samples, the order of the runs, and
the CPU per generated sample by kind of process (:func:`classify` on real process titles). Nothing here starts
Ray, vLLM or TRL."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

PY = "/home/me/async_rlhf/.venv/bin/python"
SITE = "/home/me/async_rlhf/.venv/lib/python3.11/site-packages"
SESSION = "/tmp/ray/session_2026-11-29_07-12-30_123456_4242"


def curve(*points: tuple[float, int, float]) -> list[dict[str, float]]:
    """Points of (time_s, samples trained, accuracy)."""
    return [{"time_s": t, "step": n // 64, "samples": n, "accuracy": a} for t, n, a in points]


def row(stats: Any, seed: int, trl: list[dict[str, float]], ours: list[dict[str, float]]) -> dict[str, Any]:
    """A seed's comparison as compare() builds it, from two curves."""
    return {"seed": seed, "trl_curve": trl, "ours_curve": ours, "trl_accuracy_end": trl[-1]["accuracy"],
            "ours_accuracy_end": ours[-1]["accuracy"], "trl_time_s": trl[-1]["time_s"],
            "ours_time_s": ours[-1]["time_s"], "time_to_trl_accuracy_s": None,
            "cpu_ms_per_generated_sample_by_process": {"trl": {"trl": 1.0 + seed, "total": 1.0 + seed},
                                                       "ours": {"engine": 0.5, "learner": None, "total": 0.9}},
            **stats.equal_readings(trl, ours)}


# -- readings at equal time and equal samples ---------------------------------------------------------------
def test_equal_time_is_the_last_evaluation_at_or_before_the_shorter_sides_time(stats: Any) -> None:
    trl = curve((0, 0, 0.3), (10, 6400, 0.6), (30, 19200, 0.8), (62, 40000, 0.9))
    ours = curve((0, 0, 0.3), (12, 2000, 0.7), (25, 5000, 0.85), (58, 11000, 0.95), (60.5, 11500, 0.97))
    got = stats.equal_readings(trl, ours)
    assert got["equal_time_s"] == 60.5  # ours trained 60.5 s, TRL 62 s
    assert got["trl_accuracy_at_equal_time"] == 0.8  # TRL's 0.9 came at 62 s, after it
    assert got["ours_accuracy_at_equal_time"] == 0.97  # ours' own end
    assert got["equal_samples"] == 11500  # ours trained fewer samples
    assert got["trl_accuracy_at_equal_samples"] == 0.6  # TRL at 6400 samples; 19200 is beyond
    assert got["ours_accuracy_at_equal_samples"] == 0.97


def test_accuracy_at_takes_the_later_of_two_points_at_the_same_value_and_none_before_the_first(stats: Any) -> None:
    c = curve((0, 0, 0.3), (5, 640, 0.5), (5, 640, 0.6), (9, 1280, 0.7))
    assert stats.accuracy_at(c, "time_s", 5) == 0.6
    assert stats.accuracy_at(c, "samples", 1279) == 0.6
    assert stats.accuracy_at(c, "time_s", 100) == 0.7
    assert stats.accuracy_at(c[1:], "time_s", 1) is None


# -- mean and std over seeds ----------------------------------------------------------------------------------
def test_spread_is_the_sample_std_over_the_values_and_counts_the_missing(stats: Any) -> None:
    mean, std, missing = stats.spread([10.0, None, 14.0, 18.0])
    assert mean == pytest.approx(14.0) and std == pytest.approx(4.0) and missing == 1  # n - 1: sqrt(32 / 2)
    assert std == pytest.approx(statistics.stdev([10.0, 14.0, 18.0]))
    assert stats.spread([7.0, None]) == (7.0, None, 1)  # one value: no std
    assert stats.spread([None, None]) == (None, None, 2)
    assert stats.spread([]) == (None, None, 0)


def test_side_summary_leaves_a_never_reached_seed_out_of_the_mean_and_counts_it(stats: Any) -> None:
    rows = [row(stats, 0, curve((0, 0, 0.3), (20, 1280, 0.9), (60, 3840, 0.95)),
                curve((0, 0, 0.3), (10, 640, 0.92), (60, 1920, 0.97))),
            row(stats, 1, curve((0, 0, 0.3), (40, 2560, 0.88), (60, 3840, 0.89)),  # TRL never reaches 0.9
                curve((0, 0, 0.3), (30, 960, 0.91), (60, 1920, 0.93))),
            row(stats, 2, curve((0, 0, 0.3), (30, 1920, 0.91), (60, 3840, 0.93)),
                curve((0, 0, 0.3), (20, 640, 0.95), (60, 1920, 0.96)))]
    trl = stats.side_summary(rows, "trl", 0.9)
    assert trl["seeds"] == [0, 1, 2]
    assert trl["time_to_target_s"] == [20, None, 30] and trl["never_reached"] == 1
    assert trl["time_to_target_s_mean"] == pytest.approx(25.0)
    assert trl["time_to_target_s_std"] == pytest.approx(statistics.stdev([20, 30]))
    assert trl["accuracy_end"] == [0.95, 0.89, 0.93]
    assert trl["accuracy_end_mean"] == pytest.approx(0.9233333)
    assert trl["accuracy_end_std"] == pytest.approx(statistics.stdev([0.95, 0.89, 0.93]))
    # held: the mean of 3 evaluations in a row: TRL holds 0.9 on no seed (its start drags the first mean down)
    assert trl["time_to_hold_target_s"] == [None, None, None] and trl["never_held"] == 3
    assert trl["time_to_hold_target_s_mean"] is None and trl["time_to_hold_target_s_std"] is None
    ours = stats.side_summary(rows, "ours", 0.9)
    assert ours["time_to_target_s"] == [10, 30, 20] and ours["never_reached"] == 0
    assert ours["time_to_target_s_mean"] == pytest.approx(20.0) and ours["time_to_target_s_std"] == pytest.approx(10.0)
    # at equal samples (ours trained 1920 by its end, TRL 3840): TRL's last evaluation at or before 1920
    assert trl["accuracy_at_equal_samples"] == [0.9, 0.3, 0.91]
    assert ours["accuracy_at_equal_samples"] == [0.97, 0.93, 0.96]
    assert trl["accuracy_at_equal_time"] == trl["accuracy_end"]  # both sides trained 60 s
    assert trl["samples_trained"] == [3840, 3840, 3840] and ours["time_s"] == [60, 60, 60]


def test_task_entry_keeps_seed_0s_single_run_keys_and_adds_the_seeds(stats: Any) -> None:
    rows = [row(stats, s, curve((0, 0, 0.3), (60, 3840, 0.9 + s / 100)), curve((0, 0, 0.3), (60, 1920, 0.95)))
            for s in range(2)]
    rows[0]["time_to_trl_accuracy_s"], rows[1]["time_to_trl_accuracy_s"] = 30.0, None
    entry = stats.task_entry(rows, 0.9)
    assert entry["trl_accuracy_end"] == 0.9 and entry["seed"] == 0 and entry["per_seed"] == rows
    assert entry["seeds"] == [0, 1] and entry["target_accuracy"] == 0.9 and entry["vary_start"] is False
    for side in ("trl", "ours"):
        assert {"time_to_target_s", "accuracy_end", "time_to_target_s_mean", "time_to_target_s_std",
                "accuracy_end_mean", "accuracy_end_std"} <= set(entry[side])
    by = entry["cpu_ms_per_generated_sample_by_process"]
    assert by["trl"]["trl"] == pytest.approx(1.5)  # the mean of the seeds' 1.0 and 2.0
    assert by["ours"]["engine"] == pytest.approx(0.5) and by["ours"]["learner"] is None
    # the ratio the target reads: the mean over seeds, so a seed that never reached TRL's accuracy misses it
    assert entry["target_ratio_per_seed"] == [0.5, None] and stats.task_ratio(entry) == float("inf")
    assert stats.task_ratio({"time_to_trl_accuracy_s": 30.0, "trl_time_s": 60.0}) == 0.5  # a single run's entry
    json.dumps(entry, allow_nan=False)  # strict JSON: any script can read it back


def test_cpu_ms_per_generated_sample_by_kind(stats: Any) -> None:
    got = stats.cpu_ms_by_process({"generated_samples": 2000, "by_process": {"engine": 1.0, "learner": 0.6,
                                                                             "ray": 0.2, "other": 0.0}})
    assert got == pytest.approx({"engine": 0.5, "learner": 0.3, "ray": 0.1, "other": 0.0, "total": 0.9})
    nothing = stats.cpu_ms_by_process({"generated_samples": 0, "by_process": {"engine": 1.0}})
    assert nothing == {"engine": None, "total": None}


# -- the runs: seeds interleaved, one start ------------------------------------------------------------------
def fake_sides(bench: Any, monkeypatch: Any, calls: list[tuple[str, int, str]], kinds: tuple[str, ...]) -> None:
    def run_trl(cfg: Any, model_dir: str, budget_s: float, eval_every_s: float, work: Path) -> dict[str, Any]:
        calls.append(("trl", cfg.train.seed, model_dir))
        c = curve((0, 0, 0.3), (budget_s, 6400, 0.8 + cfg.train.seed / 100))
        return {"curve": c, "time_s": budget_s, "steps": 100, "samples_per_s": 6400 / budget_s,
                "accuracy_end": c[-1]["accuracy"],
                "cpu": {"cpu_s": 10.0, "time_s": budget_s, "samples": 6400, "generated_samples": 6400,
                        "by_process": {"trl": 10.0}}}

    def run_ours(cfg_args: list[str], group_size: int, model_dir: str, budget_s: float, eval_every: int,
                 work: Path, generators: int, ours_set: tuple[str, ...] = ()) -> dict[str, Any]:
        seed = int(next(a for a in cfg_args if a.startswith("train.seed=")).split("=")[1])
        calls.append(("ours", seed, model_dir))
        (work / "ours.log").write_text(f"seed {seed}\n")
        c = curve((0, 0, 0.3), (budget_s / 2, 1000, 0.85), (budget_s, 2000, 0.9))
        return {"curve": c, "time_s": budget_s, "steps": 30, "accuracy_end": 0.9, "samples_per_s": 2000 / budget_s,
                "generated_samples_per_s": 4000 / budget_s,
                "cpu": {"cpu_s": 8.0, "time_s": budget_s, "samples": 2000, "generated_samples": 4000,
                        "by_process": dict.fromkeys(kinds, 1.0)},
                "learner_push_wait_fraction": 0.0, "learner_compute_fraction": 0.5, "zero_advantage_share": 0.5}

    monkeypatch.setattr(bench, "run_trl", run_trl)
    monkeypatch.setattr(bench, "run_ours", run_ours)
    monkeypatch.setattr(bench, "plot", lambda *a, **k: None)
    monkeypatch.setattr(bench, "plot_seeds", lambda *a, **k: None)


def test_seeds_interleave_the_sides_and_start_from_seed_0s_warm_start(bench: Any, process_cpu: Any, monkeypatch: Any,
                                                                       tmp_path: Path) -> None:
    calls: list[tuple[str, int, str]] = []
    fake_sides(bench, monkeypatch, calls, process_cpu.KINDS)
    starts: list[int] = []
    monkeypatch.setattr(bench, "start_policy", lambda cfg: starts.append(cfg.train.seed) or f"warm-{cfg.train.seed}")
    entry = bench.compare("addition", 10.0, 1.0, tmp_path, seeds=3, target=0.85)
    assert calls == [("trl", 0, "warm-0"), ("ours", 0, "warm-0"), ("trl", 1, "warm-0"), ("ours", 1, "warm-0"),
                     ("trl", 2, "warm-0"), ("ours", 2, "warm-0")]
    assert starts == [0]  # one warm start, seed 0's, for every seed
    assert [r["seed"] for r in entry["per_seed"]] == [0, 1, 2] and entry["target_accuracy"] == 0.85
    assert entry["trl"]["accuracy_end"] == pytest.approx([0.8, 0.81, 0.82])
    assert entry["ours"]["time_to_target_s"] == [5.0] * 3
    assert entry["trl"]["time_to_target_s"] == [None] * 3 and entry["trl"]["never_reached"] == 3
    assert entry["cpu_ms_per_generated_sample_by_process"]["ours"]["engine"] == pytest.approx(0.25)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [f"addition_seed{s}_ours.log" for s in range(3)]


def test_vary_start_gives_each_seed_its_own_warm_start_and_one_seed_keeps_the_old_log_name(
        bench: Any, process_cpu: Any, monkeypatch: Any, tmp_path: Path) -> None:
    calls: list[tuple[str, int, str]] = []
    fake_sides(bench, monkeypatch, calls, process_cpu.KINDS)
    monkeypatch.setattr(bench, "start_policy", lambda cfg: f"warm-{cfg.train.seed}")
    (tmp_path / "a").mkdir()
    bench.compare("longtail", 10.0, 1.0, tmp_path / "a", seeds=2, vary_start=True)
    assert calls == [("trl", 0, "warm-0"), ("ours", 0, "warm-0"), ("trl", 1, "warm-1"), ("ours", 1, "warm-1")]
    calls.clear()
    (tmp_path / "b").mkdir()
    entry = bench.compare("longtail", 10.0, 1.0, tmp_path / "b")
    assert entry["target_accuracy"] == bench.TARGETS["longtail"] and len(entry["per_seed"]) == 1
    assert [p.name for p in (tmp_path / "b").glob("*.log")] == ["longtail_ours.log"]


def test_both_sides_of_a_seed_get_train_seed_and_ours_set_still_comes_last(bench: Any) -> None:
    assert bench.task_config("addition", seed=2).train.seed == 2
    assert bench.task_config("addition", ("train.seed=7",), seed=2).train.seed == 7  # a what-if of ours wins
    assert bench.seeded("longtail", 1)[-1] == "train.seed=1"


def test_targets_default_per_task_and_the_flag_sets_all_or_some(stats: Any) -> None:
    tasks = ["addition", "longtail"]
    assert stats.parse_targets([], tasks) == {"addition": 0.9, "longtail": 0.95}
    assert stats.parse_targets(["0.8"], tasks) == {"addition": 0.8, "longtail": 0.8}
    assert stats.parse_targets(["addition=0.8,longtail=0.9"], tasks) == {"addition": 0.8, "longtail": 0.9}
    assert stats.parse_targets(["0.7", "longtail=0.9", "addition3=0.5"], tasks) == {"addition": 0.7, "longtail": 0.9}
    for bad, says in (("additon=0.8", "unknown task"), ("addition=high", "not a number"), ("1.5", "at most 1")):
        with pytest.raises(ValueError, match=says):
            stats.parse_targets([bad], tasks)


def test_plot_seeds_writes_one_figure_with_both_axes(stats: Any, vs_report: Any, tmp_path: Path) -> None:
    rows = [row(stats, s, curve((0, 0, 0.3), (30, 1920, 0.9)), curve((0, 0, 0.3), (30, 960, 0.95))) for s in range(2)]
    vs_report.plot_seeds("addition", rows, tmp_path / "addition_seeds.png", 1, 0.9)
    assert (tmp_path / "addition_seeds.png").stat().st_size > 0


# -- CPU by kind of process ------------------------------------------------------------------------------------
PADDED = [""] * 40  # setproctitle leaves the rest of the argument area empty


@pytest.mark.parametrize(("name", "cmdline", "kind"), [
    # Ray workers, titled by Ray: between tasks, during one, and /proc/PID/comm's 15 characters without cmdline
    ("ray::GeneratorActor", ["ray::GeneratorActor", *PADDED], "engine"),
    ("ray::GeneratorActor.generate_loop", ["ray::GeneratorActor.generate_loop", *PADDED], "engine"),
    ("ray::GeneratorA", [], "engine"),
    ("ray::LearnerActor.train_loop", ["ray::LearnerActor.train_loop", *PADDED], "learner"),
    ("ray::LearnerAct", [], "learner"),
    ("ray::BufferActor.put_groups", ["ray::BufferActor.put_groups", *PADDED], "buffer"),
    ("ray::BufferActo", [], "buffer"),
    ("ray::IDLE", ["ray::IDLE", *PADDED], "ray"),
    ("ray::IDLE_SpillWorker", ["ray::IDLE_SpillWorker", *PADDED], "ray"),
    ("ray::DashboardAgent", ["ray::DashboardAgent", *PADDED], "ray"),
    ("ray::RuntimeEnvAgent", ["ray::RuntimeEnvAgent", *PADDED], "ray"),
    ("ray::StartupBoard", ["ray::StartupBoard", *PADDED], "other"),
    ("ray::timed_heldout_accuracy", ["ray::timed_heldout_accuracy", *PADDED], "other"),
    # vLLM's engine core (and workers) when in processes of their own
    ("VLLM::EngineCore", ["VLLM::EngineCore", *PADDED], "engine"),
    ("VLLM::EngineCor", [], "engine"),
    ("VLLM::Worker_TP0", ["VLLM::Worker_TP0"], "engine"),
    # Ray's own programs and scripts
    ("raylet", [f"{SITE}/ray/core/src/ray/raylet/raylet", f"--raylet_socket_name={SESSION}/sockets/raylet",
                "--store_socket_name=/tmp/ray/plasma_store", "--object_manager_port=0", "--node_manager_port=0",
                "--node_ip_address=127.0.0.1", "--num_prestart_python_workers=0"], "ray"),
    ("gcs_server", [f"{SITE}/ray/core/src/ray/gcs/gcs_server", f"--log_dir={SESSION}/logs",
                    "--config_list=eyJvYmplY3Rf", "--gcs_server_port=0", "--node-ip-address=127.0.0.1"], "ray"),
    ("python", [f"{PY}", "-u", f"{SITE}/ray/_private/log_monitor.py", f"--session-dir={SESSION}",
                f"--logs-dir={SESSION}/logs", "--gcs-address=127.0.0.1:61823", "--logging-rotate-bytes=536870912"],
     "ray"),
    ("python", [f"{PY}", "-u", f"{SITE}/ray/dashboard/agent.py", "--node-ip-address=127.0.0.1",
                "--metrics-export-port=52119"], "ray"),
    ("python", [f"{PY}", "-u", f"{SITE}/ray/_private/runtime_env/agent/main.py", "--node-ip-address=127.0.0.1",
                "--runtime-env-agent-port=63125"], "ray"),
    ("python", [f"{PY}", "-u", f"{SITE}/ray/_private/workers/default_worker.py", "--node-ip-address=127.0.0.1",
                "--node-manager-port=40325", f"--object-store-name={SESSION}/sockets/plasma_store",
                "--worker-launch-time-ms=1796000000000", "--language=PYTHON"], "ray"),
    # the role fork server, its wrappers (their arguments name default_worker.py) and the launcher
    ("python", [f"{PY}", "-m", "async_rlhf.startup.forkserver", "--early"], "forkserver"),
    ("python", [f"{PY}", "-m", "async_rlhf.startup.forkserver", "--serve", "async_rlhf-fork-6f1c2e", "4242"],
     "forkserver"),
    ("python", [f"{PY}", "-m", "async_rlhf.startup.forkserver", f"{SITE}/ray/_private/workers/default_worker.py",
                "--node-id=5b2f0c", "--node-ip-address=127.0.0.1", "--language=PYTHON"], "forkserver"),
    ("python", [f"{PY}", "/home/me/async_rlhf/launch/cluster.py", "--generators", "1", "--learners", "1",
                "task.name=addition", "generator.max_new_tokens=6", "train.seed=2",
                "model.path=/home/me/async_rlhf/runs/cache/tiny-52da644d371b",
                "run.dir=/tmp/vs_trl_addition_x/seed2/ours"], "driver"),
    # helpers
    ("tee", ["tee", "-a", "/tmp/vs_trl_addition_x/seed2/ours/logs/generator-0.log"], "other"),
    ("python", [f"{PY}", "-m", "async_rlhf.prebuild", "--vllm-model-info"], "other"),
])
def test_classify_realistic_processes(process_cpu: Any, name: str, cmdline: list[str], kind: str) -> None:
    assert process_cpu.classify(name, cmdline) == kind


def test_cpu_by_kind_counts_late_processes_from_0_and_keeps_the_last_reading_of_ended_ones(process_cpu: Any) -> None:
    start = {(10, 1.0): 5.0, (11, 1.0): 2.0, (12, 1.0): 1.0}
    last = {(10, 1.0): ("driver", "python", 5.5),
            (11, 1.0): ("engine", "ray::GeneratorActor", 9.0),   # ended after this reading: kept
            (12, 1.0): ("learner", "ray::LearnerActor", 4.0),
            (13, 7.0): ("learner", "ray::LearnerActor", 0.5),    # appeared within the window: from 0
            (12, 9.0): ("other", "tee", 0.25)}                   # pid 12 reused by another process: from 0
    got = process_cpu.cpu_by_kind(start, last)
    assert set(got) == set(process_cpu.KINDS)
    assert got["driver"] == pytest.approx(0.5) and got["engine"] == pytest.approx(7.0)
    assert got["learner"] == pytest.approx(3.5) and got["other"] == pytest.approx(0.25) and got["ray"] == 0.0


def test_the_sampler_reads_real_titles_and_keeps_a_child_that_ended(process_cpu: Any) -> None:
    """A launcher-like parent whose child takes a Ray actor's title, burns CPU and is killed before the window
    ends: its CPU stays counted, as an engine's."""
    pytest.importorskip("setproctitle")
    child = ("import setproctitle, time\nsetproctitle.setproctitle('ray::GeneratorActor.generate_loop')\n"
             "t = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(60)")
    spawn = f"import subprocess, sys, time\ntime.sleep(0.5)\nsubprocess.run([sys.executable, '-c', {child!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    import psutil

    try:
        sampler = process_cpu.ProcessCpu(parent.pid)
        sampler.begin()  # before the child exists: it counts from 0
        deadline, burnt = time.time() + 30, None
        while time.time() < deadline:
            time.sleep(0.1)
            sampler.sample()
            engines = [cpu for kind, _, cpu in sampler.last.values() if kind == "engine"]
            if engines and engines[0] >= 0.5:
                burnt = engines[0]
                break
        assert burnt is not None, f"no busy engine seen: {sampler.last}"
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.wait(timeout=30)  # the child is reaped: gone from the tree
        window = sampler.end()
    finally:
        if parent.poll() is None:
            for proc in psutil.Process(parent.pid).children(recursive=True):
                proc.kill()
            parent.kill()
            parent.wait()
    assert window["by_process"]["engine"] >= 0.5
    assert window["by_process"]["driver"] < window["by_process"]["engine"]
    assert process_cpu.tree_cpu_s(parent.pid) == 0.0


def test_main_writes_the_seeds_json_and_prints_both_tables(bench: Any, process_cpu: Any, monkeypatch: Any,
                                                           tmp_path: Path, capsys: Any) -> None:
    """The whole script over fake sides: K=2 on two tasks, the JSON layout the issue asks for, strict JSON."""
    calls: list[tuple[str, int, str]] = []
    fake_sides(bench, monkeypatch, calls, process_cpu.KINDS)
    monkeypatch.setattr(bench, "start_policy", lambda cfg: "warm")
    monkeypatch.setattr(bench, "default_generators", lambda: 1)
    out = tmp_path / "new" / "vs_trl.json"
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--budget-s", "10", "--tasks", "addition,longtail", "--seeds", "2",
                                      "--target", "addition=0.85", "--out", str(out)])
    bench.main()
    data = json.loads(out.read_text())
    assert data["seeds"] == 2 and data["targets"] == {"addition": 0.85, "longtail": 0.95} and data["commit"]
    assert data["machine"]["load_average_after"] is not None
    assert [t["task"] for t in data["tasks"]] == ["addition", "longtail"]
    addition = data["tasks"][0]
    for side in ("trl", "ours"):
        got = addition[side]
        assert len(got["time_to_target_s"]) == len(got["accuracy_end"]) == 2
        assert {"time_to_target_s_mean", "time_to_target_s_std", "accuracy_end_mean", "accuracy_end_std"} <= set(got)
    assert addition["trl"]["time_to_target_s"] == [None, None] and addition["ours"]["time_to_target_s"] == [5.0, 5.0]
    by = addition["cpu_ms_per_generated_sample_by_process"]
    assert set(by["ours"]) == {*process_cpu.KINDS, "total"} and by["trl"]["trl"] == pytest.approx(10000 / 6400)
    assert all("samples" in p for r in addition["per_seed"] for p in r["trl_curve"] + r["ours_curve"])
    printed = capsys.readouterr().out
    assert "over 2 seed(s)" in printed and "| never, never | 5 s, 5 s |" in printed and "-; 2 of 2 |" in printed
    assert "| engine (generator actors" in printed
    assert "over 2 seeds: the mean of the seeds' ratios): holds" in printed  # TRL's 0.8-0.81 reached by ours at 5 s
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_one_seed_prints_the_single_run_table_too(bench: Any, process_cpu: Any, monkeypatch: Any, tmp_path: Path,
                                                  capsys: Any) -> None:
    calls: list[tuple[str, int, str]] = []
    fake_sides(bench, monkeypatch, calls, process_cpu.KINDS)
    monkeypatch.setattr(bench, "start_policy", lambda cfg: "warm")
    monkeypatch.setattr(bench, "default_generators", lambda: 1)
    out = tmp_path / "vs_trl.json"
    monkeypatch.setattr(sys, "argv", ["vs_trl.py", "--budget-s", "10", "--tasks", "addition3", "--out", str(out)])
    bench.main()
    data = json.loads(out.read_text())
    (task,) = data["tasks"]
    assert data["seeds"] == 1 and task["seeds"] == [0] and task["trl"]["time_to_target_s_std"] is None
    printed = capsys.readouterr().out
    assert "## addition3" in printed and "time to TRL's end accuracy" in printed and "over 1 seed(s)" in printed
