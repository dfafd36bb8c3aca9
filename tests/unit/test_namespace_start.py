"""How tests/cluster/nodes.py waits for its Ray nodes (the cluster tier starts them for real): the wait ends when the
count is reached, fails at once when a node's ``ray start`` ended, and a head that ended while starting restarts
the whole cluster (its Ray client server gives up 30 s after it started when the head's raylet has not registered)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))
import nodes as ns_nodes  # noqa: E402


class Start:
    """A ``ray start`` process: ``code`` None while it runs."""

    def __init__(self, ns: str, code: int | None = None, pid: int = 0) -> None:
        self.args = ["ip", "netns", "exec", ns, "ray", "start"]
        self.returncode = code
        self.pid = pid

    def poll(self) -> int | None:
        return self.returncode


class Counts:
    def __init__(self, *seen: str) -> None:
        self.seen = list(seen)

    def latest(self) -> str:
        return self.seen.pop(0) if len(self.seen) > 1 else self.seen[0]


def make(tmp_path: Path) -> ns_nodes.Nodes:
    return ns_nodes.Nodes("t", "10.0.0", 3, tmp_path)


def test_the_wait_ends_when_the_count_is_reached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ns_nodes.time, "sleep", lambda s: None)
    alive = Counts("(probe starting)", "1", "1", "2")
    make(tmp_path).wait_nodes(2, alive, [Start("tn0"), Start("tn1")])  # type: ignore[arg-type]
    assert alive.seen == ["2"]


def test_a_start_that_ended_fails_the_wait_at_once_naming_its_node(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ns_nodes.time, "sleep", lambda s: None)
    with pytest.raises(ns_nodes.NamespaceError, match=r"exit 1, namespace tn0\) with 1 of 2"):
        make(tmp_path).wait_nodes(2, Counts("1"), [Start("tn0", code=1), Start("tn1")],  # type: ignore[arg-type]
                                  timeout_s=3600)


def test_the_wait_gives_up_past_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(0, 10_000, 50))
    monkeypatch.setattr(ns_nodes.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(ns_nodes.time, "sleep", lambda s: None)
    with pytest.raises(ns_nodes.NamespaceError, match="2 nodes wanted, saw '1'"):
        make(tmp_path).wait_nodes(2, Counts("1"), [Start("tn0")], timeout_s=120)  # type: ignore[arg-type]


def test_a_head_that_ended_restarts_the_cluster_a_live_head_does_not(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = make(tmp_path)
    tried: list[int] = []
    stopped: list[Any] = []

    def start_nodes(logs: Path, cpus: int, head_attempt: int, attempts: int) -> None:
        tried.append(head_attempt)
        nodes.node_procs[0] = Start("tn0", code=1 if head_attempt < 2 else None)
        nodes.node_procs[1] = Start("tn1")
        if head_attempt < 2:
            raise ns_nodes.NamespaceError("the head ended")

    monkeypatch.setattr(nodes, "_start_nodes", start_nodes)
    monkeypatch.setattr(nodes, "stop_all", lambda procs: stopped.append(procs))
    nodes.start_ray(tmp_path / "logs", cpus=2)
    assert tried == [0, 1, 2] and len(stopped) == 2 and all(len(p) == 2 for p in stopped)

    def worker_fails(logs: Path, cpus: int, head_attempt: int, attempts: int) -> None:
        tried.append(head_attempt)
        nodes.node_procs[0] = Start("tn0")  # the head runs: a worker that never joined is not the head's fault
        raise ns_nodes.NamespaceError("node 1 did not join")

    tried.clear()
    monkeypatch.setattr(nodes, "_start_nodes", worker_fails)
    with pytest.raises(ns_nodes.NamespaceError, match="did not join"):
        nodes.start_ray(tmp_path / "logs", cpus=2)
    assert tried == [0]


def test_the_last_attempt_of_a_dying_head_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = make(tmp_path)

    def start_nodes(logs: Path, cpus: int, head_attempt: int, attempts: int) -> None:
        nodes.node_procs[0] = Start("tn0", code=1)
        raise ns_nodes.NamespaceError(f"the head ended ({head_attempt})")

    monkeypatch.setattr(nodes, "_start_nodes", start_nodes)
    monkeypatch.setattr(nodes, "stop_all", lambda procs: None)
    with pytest.raises(ns_nodes.NamespaceError, match=r"the head ended \(2\)"):
        nodes.start_ray(tmp_path / "logs", cpus=2, attempts=3)
