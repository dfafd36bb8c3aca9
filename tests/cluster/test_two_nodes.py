"""The RL loop across two Ray nodes (network namespaces, see nodes.py): roles on both nodes, every address
discovered (no loopback crosses a node), two learner ranks on different nodes, generators on the other node.

    node A (driver, head)                       node B (worker)
      driver, buffer, learner rank r            learner rank 1-r, generators 0 and 1
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import sequence_logprobs
from nodes import DASHBOARD_PORT, GCS_PORT, PY, ROOT, TwoNodes, build_namespaces, remove_namespaces
from nodes import RAY as RAY_BIN

from async_rlhf.config import Config

pytestmark = [pytest.mark.cluster, pytest.mark.integration]

STEPS = 20


# the fixture lives here, not in a conftest.py: a second conftest module would shadow tests/conftest.py for the
# other tiers' ``from conftest import ...``
@pytest.fixture(scope="module")  # torn down with the module: no idle Ray nodes through the rest of the suite
def two_nodes(tmp_path_factory: pytest.TempPathFactory):
    tag = f"ar{os.getpid() % 100000}"
    sub = 100 + os.getpid() % 100
    nodes = TwoNodes(tag, f"10.231.{sub}.1", f"10.231.{sub}.2", tmp_path_factory.mktemp("ray"))
    logs = tmp_path_factory.mktemp("ray_logs")
    try:
        build_namespaces(nodes)
        # logical CPUs (both nodes share this machine's cores): room for 2 learners, a generator rescheduled
        # from a lost node B, and the buffer on A; 2 generators and a learner on B
        nodes.popen(nodes.ns_a, [RAY_BIN, "start", "--head", "--block", "--node-ip-address", nodes.ip_a,
                                 "--port", str(GCS_PORT), "--num-cpus", "4", "--resources", '{"head": 4}',
                                 "--dashboard-host", nodes.ip_a, "--dashboard-port", str(DASHBOARD_PORT),
                                 "--temp-dir", str(nodes.temp_dir)],  # the dashboard serves `ray job submit`
                    logs / "head.log")
        time.sleep(5)
        nodes.worker_proc = nodes.popen(nodes.ns_b, [RAY_BIN, "start", "--block", "--address", nodes.address,
                                                     "--node-ip-address", nodes.ip_b, "--num-cpus", "3",
                                                     "--resources", '{"worker": 3}'], logs / "worker.log")
        nodes.wait_nodes(2)
        yield nodes
    finally:
        for proc in reversed(nodes.procs):
            nodes.stop(proc)
        remove_namespaces(nodes)


def run_job(nodes: TwoNodes, work: Path, *overrides: str, timeout_s: float = 600) -> dict[str, Any]:
    out = work / "result.json"
    proc = nodes.run(nodes.ns_a, [PY, str(ROOT / "tests" / "cluster" / "two_node_job.py"), "--address", nodes.address,
                                  "--run-dir", str(work / "run"), "--out", str(out), *overrides], timeout_s=timeout_s)
    (work / "job.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"the two-node job failed:\n{(proc.stdout + proc.stderr)[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def zero2_job(two_nodes: TwoNodes, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_job(two_nodes, tmp_path_factory.mktemp("zero2"), f"train.steps={STEPS}", "learner.zero_stage=2",
                   "resources.placement=spread", "resources.generator_custom=worker:1")


def test_roles_span_both_nodes_on_discovered_addresses(two_nodes: TwoNodes, zero2_job: dict[str, Any]) -> None:
    nodes = zero2_job["nodes"]
    assert zero2_job["driver_node"] == two_nodes.ip_a
    assert {n["node"] for n in nodes["generators"]} == {two_nodes.ip_b}, "generators asked for node B's resource"
    assert {n["node"] for n in nodes["learners"]} == {two_nodes.ip_a, two_nodes.ip_b}, "ranks spread over nodes"
    rank0 = nodes["learners"][0]["node"]
    assert zero2_job["master"][0] == rank0 and zero2_job["push"][0] == rank0, "rendezvous on rank 0's node IP"
    buffer_node = nodes["buffer"][0]["node"]
    assert zero2_job["buffer_address"].startswith(f"tcp://{buffer_node}:"), "the buffer hands out its node's IP"


def test_two_ranks_train_and_every_version_reaches_every_generator(zero2_job: dict[str, Any]) -> None:
    records = zero2_job["records"]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1)), "one version per step"
    assert zero2_job["generator_versions"] == [STEPS, STEPS]
    assert all(r["learner_ranks"] == 2 for r in records)
    train = Config().train
    assert all(r["rollout/samples"] == train.batch_size * train.group_size for r in records), "both ranks' shares"
    assert zero2_job["accuracy_end"] > zero2_job["accuracy_start"] + 0.1, "learning goes up"


def test_pushed_weights_match_the_learner_in_vllm_on_the_other_node(zero2_job: dict[str, Any]) -> None:
    check_logprobs(zero2_job)


def check_logprobs(job: dict[str, Any]) -> None:
    """vLLM's log-probs after the last push equal a transformers forward of the learner's final weights, in every
    generator that serves the final version (one restarted after the last push still serves its first)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["policy"], dtype=torch.float32).eval()
    final = job["records"][-1]["version"]
    scored = [lp for lp, v in zip(job["vllm_logprobs"], job["generator_versions"]) if lp is not None and v == final]
    assert scored, f"no generator serves the final version {final}: {job['generator_versions']}"
    wanted = sequence_logprobs(model, job["sequences"])  # the learner's weights, once for every generator
    for gen_logprobs in scored:
        for seq, got, want in zip(job["sequences"], gen_logprobs, wanted):
            assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_every_prompt_trained_once(zero2_job: dict[str, Any]) -> None:
    check_prompts_once(Path(zero2_job["policy"]).parent, STEPS)


def check_prompts_once(run_dir: Path, steps: int) -> None:
    lines = [json.loads(x) for x in (run_dir / "data_ledger.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, steps + 1))
    keys = [k for x in lines for k in x["prompt_keys"]]
    assert len(keys) == len(set(keys)) == steps * Config().train.batch_size


def learner_steps(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if "step" in rec and "rollout/samples" in rec:
            out.append(rec)
    return out


def test_the_launcher_under_ray_job_submit(two_nodes: TwoNodes, tmp_path: Path) -> None:
    """``ray job submit -- python launch/cluster.py ...``: the job finds its cluster through RAY_ADDRESS, passes
    Ray nothing but that address, and trains to the end."""
    run_dir = tmp_path / "run"
    # from the repository, as a user's job would run from its project (the tiny model's cache is there)
    entrypoint = (f"cd {ROOT} && exec {PY} launch/cluster.py --generators 1 --learners 1 --run-dir {run_dir} "
                  "train.steps=4 generator.eval_every=0")
    proc = two_nodes.run(two_nodes.ns_a, [RAY_BIN, "job", "submit", "--address",
                                          f"http://{two_nodes.ip_a}:{DASHBOARD_PORT}", "--", "bash", "-c", entrypoint],
                         timeout_s=600)
    log = proc.stdout + proc.stderr
    (tmp_path / "job.log").write_text(log)
    assert proc.returncode == 0, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_version"] == 4, summary


LOSS_STEPS = 80
KILL_AT = 4


def test_losing_a_generator_node_mid_run(two_nodes: TwoNodes, tmp_path: Path) -> None:
    """ZeRO-3 with both learner ranks and the buffer on node A, one generator on each node. Every process of
    node B is killed (its Ray node's process group, SIGKILL) mid-run: the generator there is restarted on node A
    (or the fleet shrinks) and training goes on to the last step; nothing trained twice; the pushes of the
    ZeRO-3 learners still reach vLLM exactly. Runs last: node B stays dead."""
    import signal
    import time

    run_dir, out = tmp_path / "run", tmp_path / "result.json"
    job = two_nodes.popen(two_nodes.ns_a, [PY, str(ROOT / "tests" / "cluster" / "two_node_job.py"), "--address",
                                           two_nodes.address, "--run-dir", str(run_dir), "--out", str(out),
                                           f"train.steps={LOSS_STEPS}", "learner.zero_stage=3",
                                           "resources.placement=spread", "resources.learner_custom=head:1",
                                           "resources.buffer_custom=head:1"], tmp_path / "job.log")
    deadline = time.monotonic() + 420
    while len(learner_steps(run_dir)) < KILL_AT:
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the job did not reach the step to kill at"
        time.sleep(0.5)
    killed_at = time.time()
    two_nodes.stop(two_nodes.worker_proc, signal.SIGKILL, grace_s=10)
    assert job.wait(timeout=600) == 0, (tmp_path / "job.log").read_text()[-3000:]
    result = json.loads(out.read_text())
    assert {n["node"] for n in result["nodes"]["learners"] + result["nodes"]["buffer"]} == {two_nodes.ip_a}
    assert two_nodes.ip_b in {n["node"] for n in result["nodes"]["generators"]}, "a generator started on node B"
    records = result["records"]
    assert [r["version"] for r in records] == list(range(1, LOSS_STEPS + 1))
    after = [r["time"] for r in records if r["time"] > killed_at]
    assert after, "training went on after the node was lost"
    events = [e["event"] for e in result["fleet"]["events"]]
    assert "died" in events and ("restarted" in events or "lost" in events), events
    check_prompts_once(run_dir, LOSS_STEPS)
    check_logprobs(result)
    gaps = [b - a for a, b in zip([killed_at] + after, after)]
    print(f"node B lost at step {KILL_AT}: first step after it {after[0] - killed_at:.1f} s later, largest gap "
          f"{max(gaps):.1f} s; fleet events {events}")
