"""CLI of the tiny policy.

    python -m async_rlhf.tiny build --out DIR [--seed N]
    python -m async_rlhf.tiny sft --base DIR --out DIR --steps N [--digits D] [--forget-carry P] [--clean-share F]
        [--seed N]
    python -m async_rlhf.tiny prepare --cache DIR [--digits D] [--sft-steps N] [--seed N]
    python -m async_rlhf.tiny llama-bpe --cache DIR      (the Llama + byte-level BPE chat model of the tests)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from async_rlhf.config import TaskConfig


def main(argv: list[str] | None = None) -> int:
    defaults = TaskConfig()
    parser = argparse.ArgumentParser(prog="python -m async_rlhf.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_build = sub.add_parser("build", help="save a randomly initialised tiny Qwen2 + tokenizer")
    p_build.add_argument("--out", type=Path, required=True)
    p_build.add_argument("--seed", type=int, default=0)
    p_sft = sub.add_parser("sft", help="SFT warm start of a built model on the addition task")
    p_sft.add_argument("--base", type=Path, required=True)
    p_sft.add_argument("--out", type=Path, required=True)
    p_sft.add_argument("--steps", type=int, default=defaults.sft_steps)
    p_sft.add_argument("--digits", type=int, default=defaults.digits)
    p_sft.add_argument("--heldout-size", type=int, default=defaults.heldout_size)
    p_sft.add_argument("--batch-size", type=int, default=None)
    p_sft.add_argument("--lr", type=float, default=None)
    p_sft.add_argument("--forget-carry", type=float, default=None, help="sloppy-teacher rate (default 0.65)")
    p_sft.add_argument("--clean-share", type=float, default=None,
                       help="share of the steps, first, by the correct teacher alone (default 0.5)")
    p_sft.add_argument("--seed", type=int, default=0)
    p_prep = sub.add_parser("prepare", help="build + SFT into a cache dir (once); print path, accuracy")
    p_prep.add_argument("--cache", type=Path, required=True)
    p_prep.add_argument("--digits", type=int, default=defaults.digits)
    p_prep.add_argument("--heldout-size", type=int, default=defaults.heldout_size)
    p_prep.add_argument("--sft-steps", type=int, default=defaults.sft_steps)
    p_prep.add_argument("--seed", type=int, default=0)
    p_llama = sub.add_parser("llama-bpe", help="build the Llama/BPE chat model into a cache dir (once); print path")
    p_llama.add_argument("--cache", type=Path, required=True)
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    import torch

    torch.set_num_threads(args.threads)
    from async_rlhf.env.arithmetic import AdditionTask
    from async_rlhf.tiny import sft
    from async_rlhf.tiny.model import build_tiny_model

    if args.cmd == "build":
        print(build_tiny_model(args.out, seed=args.seed))
    elif args.cmd == "llama-bpe":
        from async_rlhf.tiny.llama_bpe import prepare_llama_bpe

        print(prepare_llama_bpe(args.cache))
    elif args.cmd == "sft":
        task = AdditionTask(digits=args.digits, heldout_size=args.heldout_size)  # canonical held-out split
        options = (("batch_size", args.batch_size), ("lr", args.lr), ("forget_carry", args.forget_carry),
                   ("clean_share", args.clean_share))
        kwargs = {k: v for k, v in options if v is not None}
        print(sft.sft_warm_start(args.base, args.out, task, steps=args.steps, seed=args.seed, **kwargs))
    else:
        cfg = TaskConfig(digits=args.digits, heldout_size=args.heldout_size, sft_steps=args.sft_steps)
        path = sft.prepare_tiny_policy(args.cache, cfg, seed=args.seed)
        info = sft.read_tiny_info(path)
        print(path)
        print(f"held-out greedy accuracy: {info['heldout_greedy_accuracy']:.3f}")
        print(f"held-out sampled (T=1) accuracy: {info['heldout_sampled_accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
