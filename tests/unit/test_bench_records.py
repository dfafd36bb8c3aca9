"""The pure parts every bench shares: how many events a rate needs (and the error when a row has fewer), and the
machine and commit record each result file and table carries."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def events(load_bench: Any) -> Any:
    return load_bench("events.py")


@pytest.fixture(scope="module")
def machine(load_bench: Any) -> Any:
    return load_bench("machine.py")


def test_needed_events_covers_counting_noise_and_the_count_quantum(events: Any) -> None:
    assert events.needed_events(0.1) == 100  # 1/sqrt(100) = 10%
    assert events.needed_events(0.05) == 400
    assert events.needed_events(0.1, quantum=64) == 1280  # 64 can land either side of both edges
    assert events.needed_events(0.1, quantum=4) == 100
    with pytest.raises(ValueError):
        events.needed_events(0.0)


def test_a_row_that_measured_nothing_or_too_little_is_an_error_naming_it(events: Any) -> None:
    events.check_events("redis 256 KB buffer", 1280, 1280)
    with pytest.raises(events.TooFewEvents, match=r"^redis 256 KB buffer: measured 0 events in 1\.0 s, needs at le"):
        events.check_events("redis 256 KB buffer", 0, 0, 1.0)
    with pytest.raises(events.TooFewEvents, match="memory 1 KB raw relay: measured 1279 events"):
        events.check_events("memory 1 KB raw relay", 1279, 1280)


def test_machine_record_has_cpu_cores_and_load_before_and_after(machine: Any) -> None:
    rec = machine.machine_record()
    assert rec["cpu_model"] and rec["cores"] >= 1 and 1 <= rec["usable_cores"] <= rec["cores"]
    assert len(rec["load_average_before"]) == 3 and rec["load_average_after"] is None
    machine.finish(rec)
    assert len(rec["load_average_after"]) == 3
    line = machine.describe(rec, "abc123")
    assert rec["cpu_model"] in line and "before" in line and "after" in line and "commit abc123" in line
    out = machine.stamp({"rows": [1]}, rec, "abc123")
    assert list(out)[:2] == ["machine", "commit"] and out["rows"] == [1]


def test_cpu_model_reads_cpuinfo(machine: Any) -> None:
    assert machine.cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n") == "AMD EPYC 7B13"


def test_cpu_model_falls_back_to_platform_then_unknown(machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine.platform, "processor", lambda: "")
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    assert machine.cpu_model("processor\t: 0\n") == "x86_64"
    monkeypatch.setattr(machine.platform, "machine", lambda: "")
    assert machine.cpu_model("processor\t: 0\n") == "unknown"


def test_git_commit_is_head_and_says_when_the_tree_differs(machine: Any, tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    assert machine.git_commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "x")
    head = git("rev-parse", "HEAD")
    assert machine.git_commit(tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert machine.git_commit(tmp_path) == head + "+dirty"
