"""Peak memory and speed of one learner step at long sequences and a real vocabulary: padded, packed, chunked.

    python bench/learner_memory.py --out FILE [--quick]

A small Qwen2 (hidden 64, 2 layers) with a 32k vocabulary is built locally (no hub), so the [tokens, vocabulary]
tensors dominate memory as they do in a real model's learner. For each ``seq_len`` S one batch of 2 sequences of
S and S/4 tokens (the longest against a typical one: the long-tail task pads 17 tokens to 47) takes one policy
step, forward and backward of the decoupled PPO loss, through the learner's own code
(``async_rlhf.learner.microbatch.accumulate_policy_grads``), in each mode:

    padded          the 2 rows right-padded to S (the learner before packing): 2 S tokens through the model
    packed          the 2 sequences end to end in one row (learner.pack=true): 1.25 S tokens
    packed_chunked  packed, and log-probs / entropies over 1024 positions at a time
                    (learner.logprob_chunk_tokens=1024): no full [tokens, vocabulary] log-softmax

Every row runs in a fresh process (``--row``), so ``peak_mb`` is that process's own peak resident set
(``ru_maxrss``), which sees torch's allocations; ``base_mb`` is its resident set after the model was built,
before the step. ``samples_per_s`` is sequences per second of the timed step (after one untimed warm-up step,
``--quick``: none), one torch thread. Writes ``{"rows": [{"seq_len", "vocab", "mode", "peak_mb",
"samples_per_s", "base_mb", "tokens"}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VOCAB = 32768
MODES = ("padded", "packed", "packed_chunked")
CHUNK = 1024


def _model(max_len: int) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                      tie_word_embeddings=True, use_cache=False)
    return Qwen2ForCausalLM(cfg).to(torch.float32)


def _batch(seq_len: int) -> Any:
    import numpy as np

    from async_rlhf.learner.batch import collate
    from async_rlhf.types import Group, Sample

    rng = np.random.default_rng(0)
    prompt = 16
    samples = []
    for i, n in enumerate([seq_len, seq_len // 4]):
        k = n - prompt
        samples.append(Sample(rng.integers(4, VOCAB, k).astype(np.int32), -rng.random(k).astype(np.float32),
                              np.zeros(k, np.int32), float(i % 2)))
    return collate([Group("g", rng.integers(4, VOCAB, prompt).astype(np.int32), samples)], 0, "grpo")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_row(seq_len: int, mode: str, warmup: bool) -> dict[str, Any]:
    """One measurement, in this process (called in a fresh one by ``main``)."""
    import torch

    from async_rlhf.config import ObjectiveConfig
    from async_rlhf.learner.microbatch import ForwardOptions, PolicyStep, accumulate_policy_grads
    from async_rlhf.learner.objectives import LossNorm

    torch.set_num_threads(1)
    model = _model(seq_len)
    batch = _batch(seq_len)
    opts = ForwardOptions(pack=mode != "padded", chunk_tokens=CHUNK if mode == "packed_chunked" else 0)
    n = batch.input_ids.shape[0]
    step = PolicyStep(batch.advantages.unsqueeze(1).expand_as(batch.behav_logp), None, 0, 0)
    obj = ObjectiveConfig(kind="decoupled_ppo")
    norm = LossNorm.of(batch.loss_mask, max_tokens=seq_len)

    def one_step() -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        accumulate_policy_grads(model, batch, [list(range(n))], step, obj, norm, opts,
                                lambda loss, last: loss.backward())
        return time.perf_counter() - t0

    base = _rss_mb()
    if warmup:
        one_step()
    seconds = one_step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    tokens = int(batch.attention_mask.sum()) if opts.pack else int(batch.attention_mask.numel())
    return {"seq_len": seq_len, "vocab": VOCAB, "mode": mode, "peak_mb": round(peak, 1),
            "samples_per_s": round(n / seconds, 3), "base_mb": round(base, 1), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the JSON here (its directory is created)")
    ap.add_argument("--quick", action="store_true", help="no warm-up step (a couple of minutes)")
    ap.add_argument("--seq-lens", default="2048,8192", help="sequence lengths to measure (comma-separated)")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: SEQ_LEN,MODE[,warmup] measured in this process
    args = ap.parse_args(argv)
    if args.row:
        seq_len, mode, *flags = args.row.split(",")
        print(json.dumps(run_row(int(seq_len), mode, "warmup" in flags)), flush=True)
        return 0
    if not args.out:
        ap.error("--out FILE is required")
    out = Path(args.out)
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for mode in MODES:
            spec = f"{seq_len},{mode}" + ("" if args.quick else ",warmup")
            proc = subprocess.run([sys.executable, __file__, "--row", spec], capture_output=True, text=True,
                                  check=False)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"row {spec} failed (exit {proc.returncode})")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
