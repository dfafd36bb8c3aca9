"""The placement plan is a pure function of config and sizes; its totals are what the cluster must hold."""

from __future__ import annotations

import pytest

from async_rlhf.config import ConfigError, load_config
from async_rlhf.driver.placement import check_fits, format_plan, plan_placement


def test_totals_per_resource_for_16_and_16() -> None:
    cfg = load_config(None, ["resources.generator_cpus=2", "resources.learner_cpus=4", "resources.buffer_cpus=1"])
    plan = plan_placement(cfg, generators=16, learners=16)
    assert plan.role("generators").count == 16 and plan.role("learners").count == 16
    assert plan.totals() == {"CPU": 16 * 2 + 16 * 4 + 1, "GPU": 0}
    assert len(plan.role("generators").ray_bundles()) == 16


def test_gpu_roles_and_tensor_parallel() -> None:
    cfg = load_config(None, ["resources.tensor_parallel=2", "resources.generator_gpus=2", "resources.learner_gpus=1",
                             "resources.placement=spread", "learners=4"])
    plan = plan_placement(cfg, generators=3)
    assert plan.totals()["GPU"] == 3 * 2 + 4 * 1
    assert plan.role("generators").strategy == "spread"
    assert plan.role("generators").ray_bundles()[0] == {"CPU": 1.0, "GPU": 2.0}
    assert "tensor_parallel=2" in format_plan(plan)


def test_tensor_parallel_needs_matching_gpus() -> None:
    with pytest.raises(ConfigError, match="resources.generator_gpus=4"):
        load_config(None, ["resources.tensor_parallel=4"])


def test_unknown_strategy_refused() -> None:
    with pytest.raises(ConfigError, match="resources.placement must be one of pack, spread"):
        load_config(None, ["resources.placement=scatter"])


def test_check_fits_names_the_short_resource() -> None:
    plan = plan_placement(load_config(None, ["resources.learner_gpus=1"]), generators=2, learners=2)
    check_fits(plan, {"CPU": 8, "GPU": 2}, "the cluster")
    with pytest.raises(ConfigError, match="GPU: the plan needs 2, the cluster has 1"):
        check_fits(plan, {"CPU": 8, "GPU": 1}, "the cluster")


def test_format_plan_total_row_and_fit_line() -> None:
    plan = plan_placement(load_config(None, []), generators=3, learners=2)
    text = format_plan(plan, {"CPU": 2, "GPU": 0})
    total = next(line for line in text.splitlines() if line.startswith("total")).split()
    assert total[1:] == ["6", "5", "0"]
    assert "no, short of CPU (5 needed)" in text
