"""The arithmetic of bench/pipeline.py: steady-state rates and the figures of its JSON."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def bench(load_bench: Any) -> Any:
    return load_bench("pipeline.py")


def test_steady_rate_skips_the_first_fifth(bench: Any) -> None:
    # 10 steps of 128 samples; the first two are slow (start-up), then one step per 0.5 s
    times = [5.0, 8.0] + [8.0 + 0.5 * i for i in range(1, 9)]
    records = [{"time": t, "rollout/samples": 128} for t in times]
    rate, start, end = bench.steady_rate(records)
    assert (start, end) == (8.0, 12.0)
    assert rate == pytest.approx(8 * 128 / 4.0)
    with pytest.raises(RuntimeError, match="raise --steps"):
        bench.steady_rate(records[:2])


def test_summary_divides_by_the_smaller_capacity_and_picks_generator_bound_busy(bench: Any) -> None:
    def variant(gen: float, learn: float, pipe: float, busy: float, sync: float) -> dict[str, Any]:
        """What run_variant records: the standalone capacities, the runs and bench.compare's figures of them
        (every group kept: samples trained = samples generated)."""
        alone = {"generator_samples_per_s": gen, "learner_samples_per_s": learn}
        asyn = {"samples_per_s": pipe, "generated_samples_per_s": pipe, "generator_busy_fraction": busy}
        return {"standalone": alone, "async": asyn, **bench.compare(alone, asyn, {"samples_per_s": sync})}

    out = bench.summarize({"tiny": variant(100, 300, 95, 0.97, 60), "longtail": variant(50, 40, 36, 0.7, 20)}, "1")
    assert out["efficiency_tiny"] == pytest.approx(0.95)
    assert out["efficiency_longtail"] == pytest.approx(0.9)
    assert out["async_over_sync_longtail"] == pytest.approx(1.8)
    assert out["generator_busy_fraction"] == pytest.approx(0.97)  # longtail is learner-bound: not counted
    assert out["holds"] is True and bench.summarize({"tiny": variant(100, 300, 80, 0.97, 60)}, "1")["holds"] is False
    assert out["standalone_learner_samples_per_s_longtail"] == 40


def test_efficiency_counts_the_same_thing_on_both_sides(bench: Any) -> None:
    # the async run trains half of what it generates (uniform groups are dropped before training)
    asyn = {"samples_per_s": 200.0, "generated_samples_per_s": 400.0}
    sync = {"samples_per_s": 100.0}
    # generator-bound: 420 generated alone = 210 trained, below the learner's 600
    out = bench.compare({"generator_samples_per_s": 420.0, "learner_samples_per_s": 600.0}, asyn, sync)
    assert out["bottleneck"] == "generator" and out["kept_fraction"] == pytest.approx(0.5)
    assert out["efficiency"] == pytest.approx(400 / 420)  # generated against generated, not 200 / 420
    assert "generated" in out["efficiency_basis"] and out["bound_samples_per_s"] == pytest.approx(210)
    # learner-bound: the generators alone (500 generated = 250 trained) outrun the learner's 220 trained
    out = bench.compare({"generator_samples_per_s": 500.0, "learner_samples_per_s": 220.0}, asyn, sync)
    assert out["bottleneck"] == "learner" and out["efficiency"] == pytest.approx(200 / 220)
    assert "trained" in out["efficiency_basis"]
    assert out["async_over_sync"] == pytest.approx(2.0) and "trained" in out["async_over_sync_basis"]


def test_generated_rate_reads_the_buffer_put_counter_over_the_steady_window(bench: Any) -> None:
    records = [{"time": float(i), "rollout/samples": 64, "buffer/put": 10 * i} for i in range(10)]
    # window: end of step 2 (index 1) to the last; 80 groups of 8 in 8 s
    assert bench.generated_rate(records, group_size=8) == pytest.approx(80 * 8 / 8.0)
    with pytest.raises(RuntimeError, match="buffer/put"):
        bench.generated_rate([{k: v for k, v in r.items() if k != "buffer/put"} for r in records], 8)


def test_learner_time_split_is_per_step_over_the_steady_window(bench: Any) -> None:
    records = [{"time": 0.1 * i, "time/data_wait_s": 0.03, "time/forward_backward_s": 0.05, "time/train_s": 0.06}
               for i in range(10)]
    split = bench.learner_time_split(records)
    assert split["data_wait_ms"] == pytest.approx(30) and split["forward_backward_ms"] == pytest.approx(50)
    assert split["other_compute_ms"] == pytest.approx(10) and split["step_ms"] == pytest.approx(100)


def test_the_target_holds_per_variant_and_states_its_quick_reason(bench: Any) -> None:
    def variant(efficiency: float, over_sync: float) -> dict[str, Any]:
        return {"standalone": {"generator_samples_per_s": 1.0, "learner_samples_per_s": 1.0},
                "bottleneck": "learner", "efficiency": efficiency, "async_over_sync": over_sync,
                "async": {"generator_busy_fraction": 0.9}}

    results = {"tiny": variant(0.84, 3.5), "longtail": variant(0.78, 1.7)}
    assert bench.summarize(results, "1", quick=True)["holds"] is True
    assert bench.summarize(results, "1", quick=False)["holds"] is False
    assert bench.summarize({"tiny": variant(0.95, 0.9)}, "1")["holds"] is False  # async slower than sync
    assert "0.75, not 0.9" in bench.summarize(results, "1", quick=True)["target"]
