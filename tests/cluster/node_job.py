"""A training job driven from node 0 of the namespace cluster (run inside node 0's namespace by the tests).

    python tests/cluster/node_job.py --address HEAD:PORT --run-dir D --out result.json [--nodes-out F] [key=value ...]

Prints nothing the tests read; writes ``--out``: the records, where every role ran, the addresses handed out,
the generators' final versions, vLLM's log-probs of fixed sequences after the last push and the held-out
accuracy before and after; ``--nodes-out``, as soon as every role started: the node of each role's ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SEQUENCES = [[5, 9, 17, 8, 3, 20, 11, 4, 2], [12, 3, 3, 17, 6, 7, 20, 9, 10, 3], [1, 4, 20, 4, 2]]


def _score(generator) -> list[list[float]] | None:
    """vLLM's log-probs of SEQUENCES in this generator's engine; None if it is gone (a lost node)."""
    import ray

    try:
        return ray.get(generator.score.remote(SEQUENCES), timeout=60)
    except (ray.exceptions.RayError, TimeoutError):
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--nodes-out", default="")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import ray

    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train
    from async_rlhf.policy_source import resolve_model

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"run.dir={run_dir}", "generators=2", "learners=2", "generator.eval_every=0",
                             "run.log_every_s=5", *args.overrides])
    model = resolve_model(cfg, ROOT / "runs" / "cache")
    cluster = Cluster(cfg, model, args.address, heldout=True)  # evaluated as the launcher does (Cluster.heldout)
    if args.nodes_out:
        placed = {role: [n["node"] for n in found] for role, found in cluster.nodes.items()}
        Path(args.nodes_out).write_text(json.dumps(placed))
    try:
        figures = train(cfg, cluster, run_dir)
        policy = cluster.save_policy(run_dir / "policy")
        logprobs = [_score(g) for g in cluster.generators]
        result = {"nodes": cluster.nodes, "buffer_address": cluster.buffer_address, "master": list(cluster.master),
                  "push": [cluster.push_host, cluster.push_port], "records": figures["records"],
                  "generator_versions": [s["version"] for s in figures["generator_stats"]],
                  "fleet": figures["fleet"],
                  "policy": policy, "sequences": SEQUENCES, "vllm_logprobs": logprobs,
                  "driver_node": ray.util.get_node_ip_address(),
                  "accuracy_start": ray.get(cluster.heldout_start)[0],
                  "accuracy_end": ray.get(cluster.heldout(policy))[0]}
    finally:
        cluster.shutdown()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
