"""bench/seeds.py's arithmetic (the demo over seeds) and the two-teacher SFT schedule it measures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from async_rlhf.config import TaskConfig
from async_rlhf.tiny.cache import policy_dir, tiny_settings
from async_rlhf.tiny.sft import sloppy_rate


@pytest.fixture(scope="module")
def seeds(load_bench: Any) -> Any:
    return load_bench("seeds.py")


def test_eval_curve_reads_the_held_out_evaluations_only(seeds: Any, tmp_path: Path) -> None:
    lines = [{"step": 1, "version": 1, "rollout/reward_mean": 0.5},
             {"kind": "eval", "version": 0, "eval/heldout_accuracy": 0.27},
             {"kind": "eval", "version": 25, "eval/heldout_accuracy": 0.91},
             {"kind": "eval", "version": 30, "eval/reward_mean": 0.4}]  # a user's eval set: not the task's
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"half\": ")
    curve = seeds.eval_curve(tmp_path)
    assert curve == [{"version": 0, "accuracy": 0.27}, {"version": 25, "accuracy": 0.91}]
    assert seeds.first_reaching(curve, 0.9) == 25 and seeds.first_reaching(curve, 0.95) is None


def test_summary_counts_failed_runs_against_the_share(seeds: Any) -> None:
    rows = [{"seed": 0, "accuracy_start": 0.27, "accuracy_end": 0.95, "train_s": 40.0, "step_to_0.9": 50},
            {"seed": 1, "accuracy_start": 0.26, "accuracy_end": 0.74, "train_s": 44.0, "step_to_0.9": None},
            {"seed": 2, "failed": "exit 1"}]
    s = seeds.summarise(rows)
    assert s["share_at_least_0.9"] == pytest.approx(1 / 3, abs=1e-3)
    assert s["failed_runs"] == 1
    assert s["accuracy_end"]["mean"] == pytest.approx(0.845) and s["accuracy_end"]["min"] == 0.74
    assert s["train_s"]["std"] == pytest.approx(2.0)
    assert "failed" in seeds.table(rows).splitlines()[-1]


def test_sloppy_teacher_joins_after_the_clean_share() -> None:
    rates = [sloppy_rate(step, 10, 0.65, 0.5) for step in range(1, 11)]
    assert rates == [0.0] * 5 + [0.65] * 5
    assert {sloppy_rate(step, 10, 0.65, 0.0) for step in range(1, 11)} == {0.65}  # the old recipe
    assert {sloppy_rate(step, 10, 0.65, 1.0) for step in range(1, 11)} == {0.0}


def test_clean_share_is_part_of_the_warm_start_cache_key(tmp_path: Path) -> None:
    two = TaskConfig(sft_clean_share=0.5)
    one = TaskConfig(sft_clean_share=0.0)
    assert tiny_settings(two)["sft_clean_share"] == 0.5
    assert policy_dir(tmp_path, two) != policy_dir(tmp_path, one)
