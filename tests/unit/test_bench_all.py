"""bench/all.py's aggregation, from fake bench outputs: each bench's own target and pass/fail, its rows, and a
row that measured nothing (a rate of 0) or a bench that failed turned into an error, never a figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def all_bench(load_bench: Any) -> Any:
    return load_bench("all.py")


def by_name(all_bench: Any, name: str) -> Any:
    return next(b for b in all_bench.BENCHES if b.name == name)


BUFFER = {"machine": {"cpu_model": "X"}, "commit": "abc", "target": "relay >= 0.5", "holds": True,
          "rows": [{"store": "memory", "payload_bytes": 1024, "msgs_per_s": 40000.0, "raw_msgs_per_s": 700000.0,
                    "ratio": 0.06, "relay_msgs_per_s": 280000.0, "relay_ratio": 0.15, "cpu_us_per_msg": {}}]}


def test_a_bench_entry_carries_its_target_its_pass_fail_and_its_rows(all_bench: Any) -> None:
    got = all_bench.entry(by_name(all_bench, "buffer"), BUFFER, 12.0, None)
    assert got["name"] == "buffer" and got["target"] == "relay >= 0.5" and got["holds"] is True
    assert got["error"] is None and got["rows"][0]["msgs_per_s"] == 40000.0 and "cpu_us_per_msg" not in got["rows"][0]
    assert got["commit"] == "abc" and got["machine"] == {"cpu_model": "X"}
    missed = all_bench.entry(by_name(all_bench, "buffer"), {**BUFFER, "holds": False}, 12.0, None)
    assert missed["holds"] is False and missed["error"] is None


def test_a_row_with_a_rate_of_0_is_an_error_naming_it(all_bench: Any) -> None:
    zero = {**BUFFER, "rows": [*BUFFER["rows"], {**BUFFER["rows"][0], "store": "redis", "payload_bytes": 262144,
                                                 "msgs_per_s": 0.0}]}
    got = all_bench.entry(by_name(all_bench, "buffer"), zero, 12.0, None)
    assert got["holds"] is False and got["error"] == "buffer row 1 (redis 262144): msgs_per_s = 0.0"


def test_a_failed_or_silent_bench_does_not_hold(all_bench: Any) -> None:
    bench = by_name(all_bench, "weight_sync")
    failed = all_bench.entry(bench, None, 3.0, "weight_sync exited with 1: TooFewEvents: ...")
    assert failed["holds"] is False and failed["rows"] == [] and failed["error"].startswith("weight_sync exited")
    empty = all_bench.entry(bench, {"rows": [], "holds": True, "target": "t"}, 3.0, None)
    assert empty["holds"] is False and empty["error"] == "weight_sync: no rows"
    malformed = all_bench.entry(by_name(all_bench, "pipeline"), {"holds": True}, 3.0, None)
    assert malformed["holds"] is False and "lacks" in malformed["error"]


def test_pipeline_and_vs_trl_rows(all_bench: Any) -> None:
    variant = {"standalone": {"generator_samples_per_s": 500.0, "learner_samples_per_s": 300.0},
               "async": {"samples_per_s": 280.0, "generated_samples_per_s": 560.0, "generator_busy_fraction": 0.8},
               "sync": {"samples_per_s": 150.0}, "kept_fraction": 0.5, "bottleneck": "generator",
               "efficiency": 0.95, "efficiency_basis": "samples generated", "async_over_sync": 1.87}
    (row,) = all_bench.entry(by_name(all_bench, "pipeline"), {"variants": {"tiny": variant}, "holds": True,
                                                              "target": "t"}, 1.0, None)["rows"]
    assert row["variant"] == "tiny" and row["efficiency"] == 0.95 and row["async_generated_per_s"] == 560.0
    task = {"task": "addition3", "trl_accuracy_end": 0.9, "trl_time_s": 90.0, "time_to_trl_accuracy_s": None,
            "trl_samples_per_s": 900.0, "ours_samples_per_s": 500.0, "ours_generated_samples_per_s": 900.0}
    got = all_bench.entry(by_name(all_bench, "vs_trl"), {"tasks": [task], "holds": False, "target": "t"}, 1.0, None)
    assert got["rows"][0]["ratio_to_trl_time"] is None and got["error"] is None and got["holds"] is False


def test_main_runs_each_bench_and_writes_one_json(all_bench: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With fake bench scripts: one that holds, one that exits with an error naming its row."""
    scripts = tmp_path / "bench"
    scripts.mkdir()
    ok = json.dumps({"target": "fast", "holds": True, "rows": [{"raw_s": 1.0, "push_s": 1.1}]})
    (scripts / "good.py").write_text(
        "import sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        f"assert '--quick' in sys.argv and '-x' in sys.argv\nout.write_text({ok!r})\n")
    (scripts / "bad.py").write_text("raise SystemExit('memory 256 KB buffer: measured 0 events')\n")
    monkeypatch.setattr(all_bench, "ROOT", tmp_path)
    monkeypatch.setattr(all_bench, "BENCHES", [
        all_bench.Bench("good", "good.py", lambda d: d["rows"], ("raw_s", "push_s"), ["--quick"]),
        all_bench.Bench("bad", "bad.py", lambda d: d["rows"], ("msgs_per_s",), ["--quick"])])
    out = tmp_path / "all.json"
    assert all_bench.main(["--quick", "--out", str(out), "--args", "good=-x"]) == 1  # a bench failed
    data = json.loads(out.read_text())
    assert {"machine", "commit", "benches"} <= set(data) and data["quick"] is True and data["holds"] is False
    assert data["machine"]["load_average_after"] is not None
    good, bad = data["benches"]
    assert (good["name"], good["holds"], good["target"], good["error"]) == ("good", True, "fast", None)
    assert bad["holds"] is False and "measured 0 events" in bad["error"] and bad["rows"] == []


def test_weight_sync_states_its_quick_target_and_reads_the_flat_median(load_bench: Any) -> None:
    ws = load_bench("weight_sync.py")
    rows = [{"storage": "flat", "ratio": x, "pause_s": 0.5, "raw_s": 1.0} for x in (0.82, 0.85, 0.95)]
    rows.append({"storage": "separate", "ratio": 0.5, "pause_s": 0.5, "raw_s": 1.0})  # reported, not held
    assert ws.summary_target(rows, quick=True) == (True, "target holds: flat median ratio 0.85 over 3 rows, "
                                                         "largest pause / raw 0.50")
    assert ws.summary_target(rows, quick=False)[0] is False
    assert "0.8, not 0.9" in ws.target_text(True) and "0.8" not in ws.target_text(False)
