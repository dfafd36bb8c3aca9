"""Elastic generators and a generator killed with SIGKILL, on the real stack, in one run.

    step >= 3      scale 1 -> 2 (the new engine late-joins the push group: current weights first)
    gen 1 serving  SIGKILL generator 0's process: Ray restarts it, the driver re-joins it and re-issues
                   the prompts it had in flight
    re-issued prompts trained -> scale 2 -> 1 (generator 1 finishes its groups, then leaves)
    3 more steps   stop (learners end at a common step, with a checkpoint)

The episodes are played by an agent (``task.name=agent``: the shipped stock-SDK agent through each generator's
own endpoint, issue 45), so the same run shows agent episodes surviving their generator's death: they die with its
process, their groups were never put, and their prompts are issued again and trained once on the generators left.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for

from async_rlhf.config import load_config
from async_rlhf.generator.stream import key_of_group

pytestmark = pytest.mark.integration

MAX_STEPS = 100_000  # an upper bound: the scenario stops the run once it has played out
IN_FLIGHT = 4


def scenario(box: dict[str, Any], cluster: Any, log: list[tuple[str, int, float]]) -> None:
    import ray

    def step() -> int:
        return ray.get(cluster.learners[0].current_step.remote())

    def mark(what: str) -> None:
        log.append((what, step(), time.time()))

    try:
        wait_for(lambda: "fleet" in box, "the fleet")
        fleet = box["fleet"]
        wait_for(lambda: step() >= 3, "step 3")
        mark("scale_up")
        fleet.request_scale(2)
        wait_for(lambda: fleet.last_stats.get(1, {}).get("groups", 0) >= 2, "generator 1 to put groups")
        mark("sigkill")
        os.kill(ray.get(fleet.handles[0].pid.remote()), signal.SIGKILL)
        wait_for(lambda: fleet.counters["restarts"] >= 1, "generator 0 to restart", 400)
        mark("restarted")

        def accounted() -> set[str]:  # trained (or used up as zero-advantage), or dropped with a reason (stale)
            dropped = ray.get(cluster.buffer.stats.remote(True))["ledger"]["dropped"]
            return set(fleet.ledger.trained) | {key_of_group(g) for g in dropped}

        wait_for(lambda: set(f"0:{s}" for s in list(fleet.ledger.reissued.get(0, []))) <= accounted(),
                 "the re-issued prompts to be trained or dropped with a reason")
        mark("reissued_trained")
        fleet.request_scale(1)
        wait_for(lambda: fleet.counters["removed"] >= 1, "generator 1 to leave")
        mark("scaled_down")
        start = step()
        wait_for(lambda: step() >= start + 3, "three more steps")
    except Exception as exc:  # noqa: BLE001 - reported by the test, the run must still end
        box["error"] = repr(exc)
    finally:
        mark("stop")
        box["fleet"].request_stop() if "fleet" in box else None


@pytest.fixture(scope="module")
def elastic_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> dict[str, Any]:
    import ray

    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train

    run_dir = tmp_path_factory.mktemp("elastic")
    cfg = load_config(None, [
        f"train.steps={MAX_STEPS}", "train.max_staleness=1", "train.batch_size=4", "train.group_size=4",
        "generators=1", "learners=1", f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "task.name=agent",
        "generator.eval_every=0", f"generator.groups_in_flight={IN_FLIGHT}", "sync.timeout_s=20",
    ])
    cluster = Cluster(cfg, str(tiny_model_dir))
    box: dict[str, Any] = {}
    log: list[tuple[str, int, float]] = []
    thread = threading.Thread(target=scenario, args=(box, cluster, log), daemon=True)
    thread.start()
    try:
        figures = train(cfg, cluster, run_dir, on_fleet=lambda f: box.__setitem__("fleet", f))
        thread.join(timeout=30)
        buffer = ray.get(cluster.buffer.stats.remote(True))
        yield {"cfg": cfg, "figures": figures, "buffer": buffer, "log": log, "box": box, "run_dir": run_dir}
    finally:
        cluster.close()


def test_scenario_played_out(elastic_run: dict[str, Any]) -> None:
    assert "error" not in elastic_run["box"], elastic_run["box"].get("error")
    assert [e[0] for e in elastic_run["log"]] == ["scale_up", "sigkill", "restarted", "reissued_trained",
                                                  "scaled_down", "stop"]
    events = [(e["event"], e["generator"]) for e in elastic_run["figures"]["fleet"]["events"]]
    for expected in [("added", 1), ("died", 0), ("restarted", 0), ("draining", 1), ("removed", 1)]:
        assert expected in events, events
    assert events.index(("added", 1)) < events.index(("died", 0)) < events.index(("removed", 1))


def test_training_continued_and_versions_kept_increasing(elastic_run: dict[str, Any]) -> None:
    records = elastic_run["figures"]["records"]
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(records) + 1))
    assert [r["version"] for r in records] == steps
    kill_step = next(s for what, s, _ in elastic_run["log"] if what == "sigkill")
    assert len(records) >= kill_step + 6, "training must go on after the kill, and after the scale-down"
    sizes = [r["fleet/generators"] for r in records]
    assert 2.0 in sizes and sizes[-1] == 1.0
    assert records[-1]["fleet/restarts"] == 1
    # no push waited for the dead generator (the driver told the sender): the learner never stalled for as
    # long as a push timeout (sync.timeout_s=20 here; before, a killed generator stalled it about 60 s)
    t_kill = next(t for what, _, t in elastic_run["log"] if what == "sigkill")
    after = [r["time"] for r in records if r["time"] >= t_kill]
    assert after and max((b - a for a, b in zip(after, after[1:])), default=0.0) < 20.0
    # the restarted generator follows the pushes again: it serves the final version
    final = {s["gen_id"]: s for s in elastic_run["figures"]["generator_stats"]}
    assert final[0]["version"] == records[-1]["version"]
    assert final[0]["groups"] > 0, "the restarted generator produced groups"


def test_no_prompt_group_lost_or_trained_twice(elastic_run: dict[str, Any]) -> None:
    ledger = elastic_run["figures"]["prompt_ledger"]
    ids = [gid for line in (elastic_run["run_dir"] / "data_ledger.jsonl").read_text().splitlines()
           for gid in __import__("json").loads(line)["group_ids"]]
    keys = [key_of_group(g) for g in ids]
    assert len(ids) == len(elastic_run["figures"]["records"]) * elastic_run["cfg"].train.batch_size
    assert len(keys) == len(set(keys)), "a prompt was trained twice"
    assert ledger.duplicates == []
    buf = elastic_run["buffer"]["ledger"]
    in_buffer = {key_of_group(g) for g in [*buf["held"], *buf["delivered"], *buf["dropped"]]}
    # everything generator 0 had drawn when it was killed (in flight, or put since the last poll) was
    # trained: in-flight prompts were issued again (re-issue, or the stream continued from the last seen
    # position), prompts already in the buffer were not
    died = next(e for e in elastic_run["figures"]["fleet"]["events"] if e["event"] == "died")
    drawn_before_kill = {f"0:{s}" for s in range(1, died["position"] + 1)}
    missing = drawn_before_kill - set(keys) - in_buffer
    assert not missing, f"prompts of the killed generator never trained: {sorted(missing)[:10]}"
    assert {f"0:{s}" for s in ledger.reissued.get(0, [])} <= set(keys) | in_buffer
    # the removed generator finished what it started: every prompt it drew was trained or is in the buffer
    assert {f"1:{s}" for s in ledger.outstanding.get(1, set())} <= in_buffer
    # nothing else is missing: what is outstanding at the end is in the buffer, or was in flight at the stop
    in_flight_at_stop = {f"0:{s}" for s in ledger.outstanding.get(0, set())} - in_buffer
    assert len(in_flight_at_stop) <= IN_FLIGHT


def test_agent_episodes_ran_after_the_restart_and_trained_exactly(elastic_run: dict[str, Any]) -> None:
    stats = elastic_run["figures"]["generator_stats"]  # the generators at the end: the restarted generator 0
    assert [s["gen_id"] for s in stats if s.get("agent_episodes", 0) > 0] == [0]
    assert sum(s["agent_token_mismatch"] for s in stats) == 0
    assert sum(s["agent_errors"] for s in stats) == 0
