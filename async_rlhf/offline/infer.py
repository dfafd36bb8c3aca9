"""Batch inference with vLLM: completions (and optionally rewards) for every prompt of a file.

    python -m async_rlhf.offline.infer --model DIR --prompts prompts.jsonl --out completions.jsonl \
        [--reward addition | --reward-model RM_DIR] [--n 4 --temperature 1 --max-new-tokens 16]

Prompts: ``{"prompt", ...}`` rows (.jsonl or .parquet); prompts are rendered with the tokenizer's chat template
when it has one and handed to vLLM as token ids (the project's tokenizer, not whatever vLLM would load). One output
line per sample: ``{"prompt", "sample", "completion", "tokens", "finish_reason", "reward"}`` plus the prompt row's
other columns. ``--reward addition`` scores ``aa+bb=`` prompts with the task's exact-answer rule; ``--reward-model``
scores prompt + completion with a sequence-classification reward model (e.g. from ``offline.reward_model``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from async_rlhf.offline import common
from async_rlhf.offline.data import DataError, Encoded, encode, load_rows, render_prompt

logger = logging.getLogger(__name__)
ADDITION = re.compile(r"^\s*(\d+)\+(\d+)=\s*$")


def addition_rewards(rows: list[dict[str, Any]], completions: list[list[str]]) -> list[list[float]]:
    """Exact-answer rewards of ``aa+bb=`` prompts; a prompt of another shape is a :class:`DataError`."""
    from async_rlhf.env.arithmetic import AdditionTask, score_completion

    out: list[list[float]] = []
    for i, (row, samples) in enumerate(zip(rows, completions)):
        match = ADDITION.match(row["prompt"])
        if match is None:
            raise DataError(f"--reward addition: prompt {i} {row['prompt']!r} is not of the form 'aa+bb='; "
                            "use --reward-model DIR for other prompts")
        a, b = match.group(1), match.group(2)
        problem = AdditionTask(digits=len(a), heldout_size=0).make(int(a), int(b))
        out.append([score_completion(problem, text) for text in samples])
    return out


def model_rewards(rm_dir: Path, rows: list[dict[str, Any]], completions: list[list[str]], max_length: int,
                  batch_size: int = 64) -> list[list[float]]:
    """Scores of prompt + completion under the reward model in ``rm_dir`` (its own tokenizer)."""
    import torch

    from async_rlhf.offline.reward_model import load_reward_model
    from async_rlhf.offline.scoring import reward_scores

    tok = common.load_tokenizer(rm_dir)
    model = load_reward_model(rm_dir, tok.pad_token_id, "--reward-model").eval()
    flat: list[Encoded] = []
    for row, samples in zip(rows, completions):
        prompt = render_prompt(tok, row["prompt"])
        for text in samples:
            enc = encode(tok, prompt, text, max_length, eos=False)
            if enc is None:
                raise DataError(f"--reward-model: prompt {row['prompt'][:40]!r} is longer than --max-length")
            if len(enc.ids) == enc.n_prompt:  # an empty completion: score the prompt as it stands
                enc = Encoded(ids=enc.ids, n_prompt=enc.n_prompt - 1)
            flat.append(enc)
    scores: list[float] = []
    with torch.no_grad():
        for start in range(0, len(flat), batch_size):
            scores.extend(reward_scores(model, flat[start:start + batch_size], tok.pad_token_id).tolist())
    out, k = [], 0
    for samples in completions:
        out.append(scores[k:k + len(samples)])
        k += len(samples)
    return out


def vllm_env(threads: int, kv_cache_gib: float) -> dict[str, str]:
    """The environment vLLM's CPU engine needs in-process (the generators' own, see ``engine_env``)."""
    from async_rlhf.config import Config
    from async_rlhf.generator.engine_args import engine_env

    cfg = Config()
    cfg.generator.threads = threads
    cfg.generator.kv_cache_gib = kv_cache_gib
    return engine_env(cfg)


def generate(model_dir: Path, prompt_ids: list[list[int]], args: argparse.Namespace, tok: Any) -> list[list[Any]]:
    """vLLM samples for each prompt: a list per prompt of (text, n tokens, finish reason)."""
    for key, value in vllm_env(args.threads, args.kv_cache_gib).items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    from async_rlhf.generator.engine_args import kv_cache_bytes
    from async_rlhf.tokenizer import stop_token_ids

    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=args.seed,
              max_model_len=args.max_model_len, gpu_memory_utilization=0.3,
              kv_cache_memory_bytes=kv_cache_bytes(args.kv_cache_gib))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_new_tokens, seed=args.seed,
                            stop_token_ids=stop_token_ids(model_dir, tok))  # generation_config.json's eos too
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [[(tok.decode(list(c.token_ids), skip_special_tokens=True), len(c.token_ids), c.finish_reason)
             for c in out.outputs] for out in outputs]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m async_rlhf.offline.infer", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="causal-LM directory to sample from")
    p.add_argument("--prompts", required=True, help="prompt rows {prompt, ...}: .jsonl or .parquet")
    p.add_argument("--out", required=True, help="output .jsonl (written atomically)")
    rewards = p.add_mutually_exclusive_group()
    rewards.add_argument("--reward", choices=("addition",), default=None, help="a verifiable reward function")
    rewards.add_argument("--reward-model", default=None, help="a sequence-classification reward-model directory")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=64, help="vLLM context length (prompt + completion)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM CPU KV cache (GiB, fractions too)")
    p.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise common.CliError("need --n >= 1, --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    if not args.out.endswith(".jsonl"):
        raise common.CliError(f"--out {args.out}: the output is JSON lines; name it *.jsonl")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model_dir = common.check_model_dir(args.model)
    rm_dir = common.check_model_dir(args.reward_model, "--reward-model") if args.reward_model else None
    rows = load_rows(args.prompts, "prompts", "--prompts")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    tok = common.load_tokenizer(model_dir)
    prompt_ids = []
    for i, row in enumerate(rows):
        ids = tok.encode(render_prompt(tok, row["prompt"]), add_special_tokens=False)
        if not ids or len(ids) + args.max_new_tokens > args.max_model_len:
            raise DataError(f"--prompts row {i}: {len(ids)} prompt tokens + --max-new-tokens {args.max_new_tokens} "
                            f"do not fit in --max-model-len {args.max_model_len} (or the prompt is empty)")
        prompt_ids.append(ids)
    t0 = time.perf_counter()
    samples = generate(model_dir, prompt_ids, args, tok)
    gen_s = time.perf_counter() - t0
    texts = [[s[0] for s in per_prompt] for per_prompt in samples]
    rewards: list[list[float]] | None = None
    if args.reward == "addition":
        rewards = addition_rewards(rows, texts)
    elif rm_dir is not None:
        rewards = model_rewards(rm_dir, rows, texts, args.max_model_len)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    n_tokens = 0
    with tmp.open("w") as fh:
        for i, (row, per_prompt) in enumerate(zip(rows, samples)):
            for k, (text, n_tok, finish) in enumerate(per_prompt):
                n_tokens += n_tok
                record = {**row, "sample": k, "completion": text, "tokens": n_tok, "finish_reason": finish,
                          "reward": rewards[i][k] if rewards is not None else None}
                fh.write(json.dumps(record) + "\n")
    tmp.replace(out)
    flat = [r for per in rewards for r in per] if rewards is not None else []
    logger.info("infer: %d prompts x %d samples in %.1f s (%.0f tokens/s)%s -> %s", len(rows), args.n, gen_s,
                n_tokens / max(gen_s, 1e-9), f", mean reward {sum(flat) / len(flat):.3f}" if flat else "", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main))
