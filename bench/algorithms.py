"""PPO with a critic, GRPO and online DPO on the tiny task, each asynchronous on the real stack, in one run.

    (1) SFT        the cached warm start of the tiny policy (async_rlhf.tiny.sft), held-out accuracy measured
    (2) RM         preference pairs built from the task (python -m async_rlhf.offline.make_data), then a
                   Bradley-Terry reward model on the SFT policy's body (python -m async_rlhf.offline.reward_model);
                   its accuracy on held-out pairs is reported
    (3) PPO        train.algorithm=ppo: critic beside the actor, the RM's score as the reward, KL to the reference;
                   its held-out figures on both rewards: accuracy (the task's verifiable rule) and the RM's mean
                   score of the same greedy completions, and the training-time task reward beside the RM score
    (3b) ppo_mix   the same PPO with the task reward mixed in (train.ppo.generator_reward_weight=--task-weight)
    (4) GRPO       train.algorithm=grpo with the task's verifiable reward
    (5) online DPO train.algorithm=online_dpo: best against worst sample of each group, by the task's reward

Every RL run goes through async_rlhf.driver.runner (Ray, vLLM generators, DeepSpeed learner, ZeroMQ buffer, weight
push) with the same seeds, batch and staleness. Writes, beside ``--out``: ``accuracy.png`` (held-out greedy
accuracy against samples trained, the three algorithms in one plot), ``table.md``, the run directories, and
``--out`` itself: JSON ``{"runs": [{"algorithm", "accuracy_start", "accuracy_end", "wall_time_s", ...}, ...]}``.

    python bench/algorithms.py [--quick] [--steps N] [--algorithms ppo,ppo_mix,grpo,online_dpo]
                               [--task-weight W] [--out runs/algorithms/results.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ALGORITHMS = ("ppo", "ppo_mix", "grpo", "online_dpo")
DEFAULT_ALGORITHMS = ("ppo", "grpo", "online_dpo")


def train_reward_model(policy: str, out_dir: Path, steps: int, digits: int) -> tuple[str, float]:
    """Pairs from the task, then the reward-model CLI; returns (RM directory, accuracy on held-out pairs)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from async_rlhf.offline.common import load_tokenizer
    from async_rlhf.offline.data import encode_pairs, load_rows
    from async_rlhf.offline.make_data import make_data
    from async_rlhf.offline.scoring import reward_scores

    data = make_data(out_dir / "data", train=max(2000, steps * 32), heldout=200, digits=digits)
    rm_dir = out_dir / "reward_model"
    cmd = [sys.executable, "-m", "async_rlhf.offline.reward_model", "--pairs", str(data["pairs"]), "--model", policy,
           "--out", str(rm_dir), "--steps", str(steps), "--lr", "1e-3", "--batch-size", "32", "--threads", "2",
           "--log-every", "50", "--overwrite"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32).eval()
    tok = load_tokenizer(rm_dir)
    pairs = encode_pairs(tok, load_rows(data["pairs_heldout"], "pairs"), 64, eos=False)
    with torch.no_grad():
        chosen = reward_scores(model, [c for c, _, _ in pairs], tok.pad_token_id)
        rejected = reward_scores(model, [r for _, r, _ in pairs], tok.pad_token_id)
    return str(rm_dir), float((chosen > rejected).float().mean())


def algorithm_overrides(algorithm: str, rm_dir: str, task_weight: float = 0.0) -> list[str]:
    if algorithm == "ppo":
        return ["train.algorithm=ppo", f"train.ppo.reward_models={rm_dir}"]
    if algorithm == "ppo_mix":  # the same reward model, plus the task's verifiable reward (the generator's)
        return ["train.algorithm=ppo", f"train.ppo.reward_models={rm_dir}",
                f"train.ppo.generator_reward_weight={task_weight:g}"]
    return [f"train.algorithm={algorithm}"]


def heldout_rm_score(model_dir: str, rm_dir: str, cfg: Any) -> float:
    """Mean reward-model score of the policy's greedy completions of the held-out prompts (the prompts
    ``heldout_accuracy`` scores with the task's rule): what the RM thinks of the same answers."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_rlhf.env.registry import make_task
    from async_rlhf.rewards.model import RewardModelScorer
    from async_rlhf.tiny.sft import generate_batch
    from async_rlhf.tiny.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = load_tokenizer(model_dir)
    problems = make_task(cfg.task).heldout()
    outs = generate_batch(model, [tok.encode(p.prompt, add_special_tokens=False) for p in problems],
                          cfg.generator.max_new_tokens, tok.pad_token_id, tok.eos_token_id)
    texts = [p.prompt + tok.decode(o, skip_special_tokens=True) for p, o in zip(problems, outs)]
    scores = RewardModelScorer(rm_dir).score(texts)
    return sum(scores) / max(1, len(scores))


def _mean(records: list[dict[str, Any]], key: str) -> float:
    return sum(float(r.get(key, 0.0)) for r in records) / max(1, len(records))


def one_run(algorithm: str, steps: int, model_path: str, rm_dir: str, out_dir: Path, accuracy_start: float,
            extra: list[str], task_weight: float = 0.0, rm_start: float | None = None) -> dict[str, Any]:

    from async_rlhf.config import load_config
    from async_rlhf.driver.cluster import Cluster
    from async_rlhf.driver.runner import train
    from async_rlhf.policy_source import heldout_accuracy

    run_dir = out_dir / algorithm
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"train.steps={steps}", f"model.path={model_path}", f"run.dir={run_dir}",
                             "run.log_every_s=30", *algorithm_overrides(algorithm, rm_dir, task_weight), *extra])
    t0 = time.time()
    cluster = Cluster(cfg, model_path)
    try:
        figures = train(cfg, cluster, run_dir)
        policy = cluster.save_policy(run_dir / "policy")
    finally:
        cluster.close()
    records = figures["records"]
    samples_per_step = cfg.train.batch_size * cfg.train.group_size
    curve = [{"samples": e["version"] * samples_per_step // cfg.train.push_every, "version": e["version"],
              "accuracy": e["accuracy"]} for e in figures["evals"]]
    tail = records[-10:]
    summary = {
        "algorithm": algorithm,
        "accuracy_start": accuracy_start,
        "accuracy_end": heldout_accuracy(policy, cfg),
        "wall_time_s": figures["wall_time_s"],
        "setup_s": time.time() - t0 - figures["wall_time_s"],
        "steps": len(records),
        "samples_trained": sum(r["rollout/samples"] for r in records),
        "task_reward_last10": sum(r["rollout/reward_mean"] for r in tail) / max(1, len(tail)),
        "mean_staleness": sum(r["staleness/mean"] for r in records) / max(1, len(records)),
        "curve": [{"samples": 0, "version": 0, "accuracy": accuracy_start}] + [c for c in curve if c["version"] > 0],
    }
    if algorithm.startswith("ppo"):  # both rewards, in training and on the held-out prompts
        head = records[:10]
        summary.update({
            "task_weight": task_weight if algorithm == "ppo_mix" else 0.0,
            "task_reward_first10": _mean(head, "rollout/task_reward_mean"),
            "rm_score_first10": _mean(head, "rollout/rm_score_mean"),
            "rm_score_last10": _mean(tail, "rollout/rm_score_mean"),
            "rm_score_std_last10": _mean(tail, "ppo/rm_score_std"),
            "rm_task_corr_last10": _mean(tail, "ppo/rm_task_corr"),
            "critic_explained_variance_last10": _mean(tail, "critic/explained_variance"),
            "heldout_rm_score_start": rm_start,
            "heldout_rm_score_end": heldout_rm_score(policy, rm_dir, cfg),
        })
    if algorithm == "online_dpo":
        summary["dpo_margin_last10"] = sum(r.get("dpo/reward_margin", 0.0) for r in tail) / max(1, len(tail))
    return summary


def write_report(runs: list[dict[str, Any]], rm_accuracy: float, out_dir: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Reward model accuracy on held-out preference pairs: {rm_accuracy:.3f}", "",
             "| algorithm | held-out acc start | end | task reward (last 10 steps) | samples | mean staleness | "
             "RL wall s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['algorithm']} | {r['accuracy_start']:.3f} | {r['accuracy_end']:.3f} | "
                     f"{r['task_reward_last10']:.3f} | {r['samples_trained']} | {r['mean_staleness']:.2f} | "
                     f"{r['wall_time_s']:.0f} |")
    ppo = [r for r in runs if r["algorithm"].startswith("ppo")]
    if ppo:  # what PPO optimised (the RM's score) beside what it was meant to (the task's reward)
        lines += ["", "| PPO run | task weight | held-out acc start -> end | held-out RM score start -> end | "
                  "train task reward first -> last 10 | train RM score first -> last 10 | corr(RM, task) last 10 |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in ppo:
            lines.append(f"| {r['algorithm']} | {r['task_weight']:g} | {r['accuracy_start']:.3f} -> "
                         f"{r['accuracy_end']:.3f} | {r['heldout_rm_score_start']:.3f} -> "
                         f"{r['heldout_rm_score_end']:.3f} | {r['task_reward_first10']:.3f} -> "
                         f"{r['task_reward_last10']:.3f} | {r['rm_score_first10']:.3f} -> {r['rm_score_last10']:.3f} | "
                         f"{r['rm_task_corr_last10']:.2f} |")
    table = "\n".join(lines) + "\n"
    (out_dir / "table.md").write_text(table)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        xs = [c["samples"] for c in r["curve"]] + [r["samples_trained"]]
        ys = [c["accuracy"] for c in r["curve"]] + [r["accuracy_end"]]
        ax.plot(xs, ys, "o-", label=f"{r['algorithm']} ({r['accuracy_start']:.2f} -> {r['accuracy_end']:.2f})")
    ax.set_xlabel("samples trained")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("asynchronous PPO (critic + RM), GRPO and online DPO on the tiny task")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "accuracy.png", dpi=100)
    plt.close(fig)
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer learner steps and reward-model steps")
    p.add_argument("--steps", type=int, help="learner steps per algorithm")
    p.add_argument("--rm-steps", type=int, help="reward-model optimizer steps")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHMS)}")
    p.add_argument("--task-weight", type=float, default=1.0,
                   help="ppo_mix: train.ppo.generator_reward_weight, the task reward's share beside the RM's score")
    p.add_argument("--reward-model", help="a reward-model directory to use instead of training one")
    p.add_argument("--out", default="runs/algorithms/results.json")
    p.add_argument("overrides", nargs="*", help="config overrides applied to every run")
    args = p.parse_args()

    from async_rlhf.config import load_config
    from async_rlhf.policy_source import heldout_accuracy, resolve_model

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(algorithms) - set(ALGORITHMS))
    if unknown:
        p.error(f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    out = Path(args.out)
    out_dir = out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (60 if args.quick else 200)
    rm_steps = args.rm_steps or (200 if args.quick else 600)
    extra = [f"generator.eval_every={max(5, steps // 6)}", *args.overrides]
    base_cfg = load_config(None, extra)
    t0 = time.time()
    policy = resolve_model(base_cfg, ROOT / "runs" / "cache")  # (1) SFT warm start, cached
    accuracy_start = heldout_accuracy(policy, base_cfg)
    print(f"== SFT policy {policy}: held-out greedy accuracy {accuracy_start:.3f} ({time.time() - t0:.0f}s)",
          flush=True)
    rm_dir, rm_accuracy = "", float("nan")
    rm_start = None
    if any(a.startswith("ppo") for a in algorithms):
        t1 = time.time()
        if args.reward_model:
            rm_dir = str(Path(args.reward_model).resolve())
        else:
            rm_dir, rm_accuracy = train_reward_model(policy, out_dir, rm_steps, base_cfg.task.digits)  # (2)
        rm_start = heldout_rm_score(policy, rm_dir, base_cfg)
        print(f"== reward model {rm_dir}: held-out pair accuracy {rm_accuracy:.3f}, mean score of the SFT policy's "
              f"held-out answers {rm_start:.3f} ({time.time() - t1:.0f}s)", flush=True)
    runs: list[dict[str, Any]] = []
    for algorithm in algorithms:  # (3)-(5)
        print(f"== {algorithm} ({steps} steps)", flush=True)
        runs.append(one_run(algorithm, steps, policy, rm_dir, out_dir, accuracy_start, extra, args.task_weight,
                            rm_start))
        r = runs[-1]
        print(f"   held-out accuracy {r['accuracy_start']:.3f} -> {r['accuracy_end']:.3f} in {r['wall_time_s']:.0f}s",
              flush=True)
        out.write_text(json.dumps({"reward_model_heldout_pair_accuracy": rm_accuracy, "runs": runs}, indent=2))
    import ray

    ray.shutdown()
    print(write_report(runs, rm_accuracy, out_dir))
    print(f"wrote {out}, {out_dir / 'table.md'}, {out_dir / 'accuracy.png'}")


if __name__ == "__main__":
    main()
