"""bench/fleet_memory.py's arithmetic (issue 46): the peaks of a run's readings, machine used net of other work, and
what the run directory says about versions and prompts. No fleet is started here."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def fleet_memory(load_bench: Any) -> ModuleType:
    return load_bench("fleet_memory.py")


def reading(used: float, others: float, procs: dict[int, tuple[str, float]]) -> dict[str, Any]:
    return {"time": 0.0, "machine_used_mb": used, "others_anon_mb": others, "procs": procs,
            "parts": {"anon": 0.9 * sum(mb for _, mb in procs.values()), "file": 0.0, "shmem": 0.0},
            "baseline_used_mb": 1000.0}


def test_peaks_and_machine_used_net_of_other_work(fleet_memory: ModuleType) -> None:
    readings = [
        reading(2000, 900, {1: ("driver", 200.0), 2: ("engine", 300.0)}),
        reading(2600, 500, {1: ("driver", 210.0), 2: ("engine", 350.0), 3: ("engine", 340.0), 4: ("learner", 150.0)}),
        reading(2500, 500, {1: ("driver", 210.0), 2: ("engine", 360.0), 4: ("learner", 160.0)}),
    ]
    # the machine without the run: 1000 used less 800 of other processes' anonymous memory, 300 after it
    out = fleet_memory.summarise(readings, baseline_mb=200.0, after_mb=300.0)
    assert out["pss_sum_mb"] == pytest.approx(1050.0)  # the second reading: the peak of the sum
    assert out["pss_mb_by_kind"] == {"driver": 210.0, "engine": 690.0, "learner": 150.0}
    assert out["processes_by_kind"] == {"driver": 1, "engine": 2, "learner": 1}
    assert (out["pss_mb_generator"], out["pss_mb_learner"]) == (360.0, 160.0)  # the largest over the run
    # own used: max(2000 - 900, 2600 - 500, 2500 - 500) = 2100, less the mean baseline 250
    assert out["machine_used_mb"] == pytest.approx(1850.0)
    assert out["machine_used_raw_mb"] == pytest.approx(1600.0)  # 2600 - 1000: other work freed 400 meanwhile


def test_the_run_directory_says_whether_every_push_reached_every_generator(fleet_memory: ModuleType,
                                                                          tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3, "accuracy_start": 0.3, "accuracy_end": 0.9,
                                                       "startup_s": 10.0, "final_version": 3}))
    records = [{"step": 1}, {"step": 2, "sync/version": 1, "sync/members": 4, "sync/dropped": 0.0},
               {"step": 3, "sync/version": 2, "sync/members": 3, "sync/dropped": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "data_ledger.jsonl").write_text(json.dumps({"prompt_keys": ["1:1", "1:2"]}) + "\n"
                                                + json.dumps({"prompt_keys": ["1:2", "2:1"]}) + "\n")
    out = fleet_memory.run_checks(tmp_path, generators=4)
    assert (out["accuracy_start"], out["accuracy_end"], out["steps"]) == (0.3, 0.9, 3)
    assert (out["pushes_to_all"], out["pushes_recorded"]) == (1, 2)
    assert (out["prompts_trained"], out["prompts_distinct"]) == (4, 3)  # "1:2" trained twice
    assert fleet_memory.run_checks(tmp_path / "absent", 4) == {}
