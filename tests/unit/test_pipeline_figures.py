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
        bound = min(gen, learn)
        return {"standalone": {"generator_samples_per_s": gen, "learner_samples_per_s": learn},
                "bound_samples_per_s": bound, "bottleneck": "generator" if gen <= learn else "learner",
                "efficiency": pipe / bound, "async_over_sync": pipe / sync,
                "async": {"generator_busy_fraction": busy}}

    out = bench.summarize({"tiny": variant(100, 300, 95, 0.97, 60), "longtail": variant(50, 40, 36, 0.7, 20)}, "1")
    assert out["efficiency_tiny"] == pytest.approx(0.95)
    assert out["efficiency_longtail"] == pytest.approx(0.9)
    assert out["async_over_sync_longtail"] == pytest.approx(1.8)
    assert out["generator_busy_fraction"] == pytest.approx(0.97)  # longtail is learner-bound: not counted
    assert out["standalone_learner_samples_per_s_longtail"] == 40
