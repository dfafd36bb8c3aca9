"""The pipeline benchmark's standalone phase on the real stack: roles pinned to their planned cores, the
generators measured alone (drained by a consumer), then the learner alone on the groups they left.

One short standalone run is shared by the assertions (starting vLLM and DeepSpeed is what costs time).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
LEARNER_STEPS = 4


def load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "bench" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def standalone_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                   ray_address: str) -> dict[str, Any]:
    bench = load_bench()
    overrides = ["generators=1", "learners=1", "train.batch_size=4", "train.group_size=4",
                 "generator.groups_in_flight=4", "generator.eval_every=0", "task.name=longtail",
                 "generator.max_new_tokens=12",
                 "run.pin=always"]  # the split is the subject, whatever another run on this host pinned
    return bench.standalone(overrides, str(tiny_model_dir), tmp_path_factory.mktemp("standalone"),
                            window_s=3.0, learner_steps=LEARNER_STEPS)


def test_every_actor_runs_on_its_planned_cores(standalone_run: dict[str, Any]) -> None:
    plan = standalone_run["cpu_plan"]["placements"]
    assert standalone_run["affinity"] == {name: p["cores"] for name, p in plan.items()}
    if len(os.sched_getaffinity(0)) >= 2:  # the generator and the learner do not share a core
        assert not set(plan["generator 0"]["cores"]) & set(plan["learner 0"]["cores"])


def test_capacities_are_measured_alone(standalone_run: dict[str, Any]) -> None:
    assert standalone_run["generator_samples_per_s"] > 0
    assert standalone_run["drained_groups"] > 0
    assert standalone_run["learner_steps"] == LEARNER_STEPS
    assert standalone_run["learner_samples_per_s"] > 0
