"""Every benchmark runs at tiny sizes into a directory that does not exist yet and writes the JSON its docstring
promises (keys checked, never a timing). A benchmark nobody runs rots: this is what keeps them runnable.

The transport benches (buffer, weight_sync) run through bench/all.py, which checks that no row measured
nothing. The stack benchmarks start from the tiny random-weight model (``model.path=``), two learner steps each; the
figures mean nothing here, only that every code path of the script runs to the end. ``bench/pipeline.py`` has
its own test (tests/integration/test_pipeline_bench.py, the standalone phase); ``bench/vs_trl.py`` runs only
where the bench extra (TRL) is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TINY_RUN = ["generator.eval_every=0", "train.batch_size=2", "train.group_size=2", "generator.max_new_tokens=6",
            "generator.groups_in_flight=2", "run.checkpoint_every=0"]
VS_TRL_BUDGET_S = 4  # seconds of training per side: a few steps of each, enough for every code path


def run_bench(script: str, args: list[str], out: Path, timeout_s: float = 600, ray_address: str = "") -> dict:
    """``bench/<script> args`` in a subprocess; with ``ray_address``, its roles run on the session's shared Ray
    (conftest.shared_ray: the bench joins it as a job under ``ray job submit`` would) instead of a Ray of its own.
    Not for vs_trl, which reads the CPU time of the launcher's process tree (its actors must be in it).

    One at a time: started together they only share the 2 cores (the transport benches' time-bounded rows then
    fail), and the stack benches leave no idle core to fill."""
    assert not out.parent.exists()
    env = {**os.environ, "RAY_ADDRESS": ray_address} if ray_address else None
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s, check=False, env=env)
    assert proc.returncode == 0, f"{script} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def test_all_runs_buffer_and_weight_sync_into_one_json(tmp_path: Path) -> None:
    """bench/all.py over the two transport benches at tiny sizes: each bench's rows, target and pass/fail, the
    machine and commit; no row of either measured nothing (all.py makes that an error, exit 1)."""
    out = tmp_path / "new" / "all.json"
    out.parent.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "all.py"), "--quick", "--only", "buffer,weight_sync", "--out", str(out),
         "--args", "buffer=--seconds 0.1 --precision 0.5 --repeats 1",
         "--args", "weight_sync=--sizes 0.2 --receivers 1 --dtypes float32 --layouts few_large --storage flat "
                   "--reps 2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"all.py failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert data["machine"]["cpu_model"] and data["machine"]["load_average_after"] and data["commit"]
    buffer, sync = data["benches"]
    assert (buffer["name"], sync["name"]) == ("buffer", "weight_sync")
    assert all(b["error"] is None and b["target"] and isinstance(b["holds"], bool) for b in (buffer, sync))
    assert {"memory", "redis", "memory-16p4c", "redis-16p4c"} <= {r["store"] for r in buffer["rows"]}
    assert all(r["msgs_per_s"] > 0 and r["raw_msgs_per_s"] > 0 and r["relay_msgs_per_s"] > 0 for r in buffer["rows"])
    (row,) = sync["rows"]
    assert row["receivers"] == 1 and row["dtype"] == "float32" and row["push_s"] > 0 and row["raw_s"] > 0
    own = json.loads((out.parent / "all_benches" / "buffer" / "results.json").read_text())
    assert own["commit"] == data["commit"] and "relay_ratio" in own["compares"]


def test_learner_memory_bench(tmp_path: Path) -> None:
    out = tmp_path / "new" / "memory.json"
    data = run_bench("learner_memory.py", ["--quick", "--seq-lens", "128", "--out", str(out)], out)
    rows = data["rows"]
    assert {r["mode"] for r in rows} == {"padded", "packed", "packed_chunked"}
    assert all({"seq_len", "vocab", "mode", "peak_mb", "samples_per_s"} <= set(r) for r in rows)
    assert all(r["seq_len"] == 128 and r["peak_mb"] > 0 for r in rows)


def test_staleness_bench(tmp_path: Path, tiny_model_dir: Path, ray_address: str) -> None:
    out = tmp_path / "new" / "staleness.json"
    data = run_bench("staleness.py", ["--quick", "--steps", "2", "--staleness", "1", "--corrections", "none",
                                      "--out", str(out), f"model.path={tiny_model_dir}", *TINY_RUN], out,
                     ray_address=ray_address)
    (run,) = data["runs"]
    assert run["max_staleness"] == 1 and run["correction"] == "none" and 0.0 <= run["final_accuracy"] <= 1.0
    assert "start_accuracy" in data and (out.parent / "table.md").exists() and (out.parent / "accuracy.png").exists()


def test_algorithms_bench(tmp_path: Path, tiny_model_dir: Path, ray_address: str) -> None:
    out = tmp_path / "new" / "algorithms.json"
    data = run_bench("algorithms.py", ["--quick", "--steps", "2", "--algorithms", "grpo", "--out", str(out),
                                       f"model.path={tiny_model_dir}", *TINY_RUN], out, ray_address=ray_address)
    (run,) = data["runs"]
    assert run["algorithm"] == "grpo" and {"accuracy_start", "accuracy_end", "wall_time_s"} <= set(run)


def test_delayed_rewards_bench(tmp_path: Path, tiny_model_dir: Path, ray_address: str) -> None:
    out = tmp_path / "new" / "delayed.json"
    data = run_bench("delayed_rewards.py", ["--quick", "--steps", "2", "--delay", "0.2", "--jitter", "0",
                                            "--model", str(tiny_model_dir), "--dir", str(tmp_path / "runs"),
                                            "--out", str(out), *TINY_RUN], out, ray_address=ray_address)
    assert {"busy_fraction_no_delay", "busy_fraction_delayed", "delay_s", "runs"} <= set(data)
    assert [r["delay_s"] for r in data["runs"]] == [0.0, 0.2]


def test_vs_trl_bench(tmp_path: Path, tiny_model_dir: Path) -> None:
    if importlib.util.find_spec("trl") is None:
        pytest.skip("bench/vs_trl.py needs the bench extra (pip install -e '.[cpu,dev,bench]'): TRL is not installed")
    out = tmp_path / "new" / "vs_trl.json"
    data = run_bench("vs_trl.py", ["--budget-s", str(VS_TRL_BUDGET_S), "--tasks", "addition", "--seeds", "2",
                                   "--model", str(tiny_model_dir), "--out", str(out)], out)
    (task,) = data["tasks"]
    assert {"task", "trl_accuracy_end", "trl_time_s", "time_to_trl_accuracy_s", "trl_samples_per_s",
            "ours_samples_per_s", "learner_push_wait_fraction"} <= set(task)  # seed 0's, as for a single run
    assert task["trl_time_s"] >= VS_TRL_BUDGET_S and task["ours_time_s"] > 0  # the budget is honoured
    assert task["trl_samples_per_s"] > 0 and task["ours_samples_per_s"] > 0
    # over seeds: both sides run once per seed, each reading per seed with its mean and std
    assert data["seeds"] == 2 and [r["seed"] for r in task["per_seed"]] == [0, 1]
    for side in ("trl", "ours"):
        got = task[side]
        assert len(got["time_to_target_s"]) == len(got["accuracy_end"]) == 2
        assert {"time_to_target_s_mean", "time_to_target_s_std", "accuracy_end_mean", "accuracy_end_std",
                "never_reached", "accuracy_at_equal_time", "accuracy_at_equal_samples"} <= set(got)
    assert all(r["trl_time_s"] >= VS_TRL_BUDGET_S and r["ours_time_s"] > 0 for r in task["per_seed"])
    assert all("samples" in p for r in task["per_seed"] for p in r["trl_curve"] + r["ours_curve"])
    # CPU by kind of process: the engine and the learner each used some within the window
    by = task["cpu_ms_per_generated_sample_by_process"]
    assert by["trl"]["trl"] > 0 and {"engine", "learner", "buffer", "ray", "driver", "total"} <= set(by["ours"])
    assert all(r["ours_cpu_s_by_process"]["engine"] > 0 and r["ours_cpu_s_by_process"]["learner"] > 0
               for r in task["per_seed"]), [r["ours_cpu_s_by_process"] for r in task["per_seed"]]
    assert (out.parent / "addition_seeds.png").stat().st_size > 0
    assert (out.parent / "addition_seed1_ours.log").stat().st_size > 0


def test_seeds_bench(tmp_path: Path, tiny_model_dir: Path) -> None:
    """bench/seeds.py: the demo's command once per seed (two seeds, two steps each, from the random tiny model so
    no warm start is built), a row per seed with the JSON its docstring promises and the figure beside it."""
    out = tmp_path / "new" / "seeds.json"
    data = run_bench("seeds.py", ["--seeds", "2", "--first-seed", "3", "--out", str(out), "--set",
                                  f"model.path={tiny_model_dir}", "train.steps=2", "task.heldout_size=20", *TINY_RUN],
                     out)
    assert [r["seed"] for r in data["rows"]] == [3, 4], data["rows"]
    for row in data["rows"]:
        assert {"accuracy_start", "accuracy_end", "train_s", "startup_s", "steps", "step_to_0.9", "curve"} <= set(row)
        assert row["steps"] == 2 and 0.0 <= row["accuracy_end"] <= 1.0 and row["train_s"] > 0
        assert json.loads((out.parent / f"seed-{row['seed']}" / "config.json").read_text())["train"]["seed"] == row[
            "seed"]
    assert 0.0 <= data["share_at_least_0.9"] <= 1.0 and data["failed_runs"] == 0
    assert data["machine"]["cpu_model"] and data["commit"]
    assert (out.parent / "seeds.png").stat().st_size > 0
