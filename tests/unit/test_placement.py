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
    assert "no, short of CPU (5 needed)" in text  # a Ray of 2 logical CPUs (joined, or run.num_cpus=2)


def test_one_host_fits_by_logical_cpus_and_says_how_many_roles_share_the_cores() -> None:
    """Issue 46: ``--dry-run`` of 16 + 16 on 2 cores said "fits this machine (2 CPU, 0 GPU): no, short of CPU (32
    needed)" though the fleet runs: the launcher starts Ray with the logical CPUs the plan needs. The fit line now
    reads that Ray's CPUs and the cores are said apart; run.num_cpus below the plan is still refused."""
    from async_rlhf.driver.placement import local_ray_cpus

    cfg = load_config(None, ["generators=16", "learners=16"])
    plan = plan_placement(cfg)
    ray_cpus = local_ray_cpus(cfg, plan, cores=2)
    assert ray_cpus == 32 + 4  # one per role (the buffer asks none), + room for 4 generators added by `scale`
    text = format_plan(plan, {"CPU": ray_cpus, "GPU": 0}, "this machine's Ray", cores=2, ray_cpus=ray_cpus)
    assert "fits this machine's Ray (36 CPU, 0 GPU): yes" in text and "short of" not in text
    assert "32 roles on 2 cores: each step will be slower, see docs/hardware.md" in text
    assert "Ray is started with 36 logical CPUs" in text
    assert local_ray_cpus(cfg, plan, cores=64) == 64  # never fewer than the cores
    small = plan_placement(load_config(None, []), generators=1, learners=1)
    assert "2 roles on 2 cores: one core or more each" in format_plan(small, cores=2)
    capped = load_config(None, ["generators=16", "learners=16", "run.num_cpus=8"])
    assert local_ray_cpus(capped, plan, cores=2) == 8
    assert "fits this machine's Ray (8 CPU, 0 GPU): no, short of CPU (32 needed)" in format_plan(
        plan, {"CPU": 8, "GPU": 0}, "this machine's Ray", cores=2)
    with pytest.raises(ConfigError, match="CPU: the plan needs 32, this machine has 8"):
        check_fits(plan, {"CPU": 8, "GPU": 0}, "this machine")
