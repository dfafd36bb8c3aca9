"""DPO CLI: direct preference optimization against a frozen reference (the starting model by default).

    python -m async_rlhf.offline.dpo --data pairs.jsonl --model SFT_DIR --out DPO_DIR [--beta 0.1 --steps 100]

Rows: ``{"prompt", "chosen", "rejected"}``. The output is a causal-LM directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from async_rlhf.offline import common
from async_rlhf.offline.data import Encoded, encode_pairs, load_rows
from async_rlhf.offline.sft import load_causal_lm

logger = logging.getLogger(__name__)


def load_reference(args: Any, model_dir: Path) -> Any:
    """The frozen reference: ``--ref-model`` when given, else a second copy of ``--model``."""
    ref_dir = common.check_model_dir(args.ref_model, "--ref-model") if args.ref_model else model_dir
    ref = load_causal_lm(ref_dir, "--ref-model" if args.ref_model else "--model").eval()
    ref.requires_grad_(False)
    return ref


def dpo_batch_loss(policy: Any, ref: Any, batch: list[tuple[Encoded, Encoded, float]], pad_id: int, beta: float,
                   label_smoothing: float) -> tuple[Any, dict[str, float]]:
    """One forward of chosen + rejected through the policy (and, without gradient, the reference)."""
    import torch

    from async_rlhf.learner.losses import dpo_loss
    from async_rlhf.offline.scoring import completion_logps

    n = len(batch)
    seqs = [c for c, _, _ in batch] + [r for _, r, _ in batch]
    with torch.no_grad():
        ref_logp = completion_logps(ref, seqs, pad_id)
    logp = completion_logps(policy, seqs, pad_id)
    return dpo_loss(logp[:n], logp[n:], ref_logp[:n], ref_logp[n:], beta, label_smoothing)


def add_preference_args(p: Any) -> None:
    p.add_argument("--beta", type=float, default=0.1, help="strength of the implicit KL to the reference")
    p.add_argument("--ref-model", default=None, help="reference model directory (default: --model)")


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser("python -m async_rlhf.offline.dpo", "Direct preference optimization on pairs.")
    add_preference_args(p)
    p.add_argument("--label-smoothing", type=float, default=0.0, help="assumed share of flipped labels, [0, 0.5)")
    args = p.parse_args(argv)
    common.check_args(args)
    if args.beta <= 0:
        raise common.CliError(f"--beta must be > 0, got {args.beta}")
    if not 0 <= args.label_smoothing < 0.5:
        raise common.CliError(f"--label-smoothing must be in [0, 0.5), got {args.label_smoothing}")
    model_dir = common.check_model_dir(args.model)
    rows = load_rows(args.data, "pairs")
    common.setup(args)
    tok = common.load_tokenizer(model_dir)
    pairs = encode_pairs(tok, rows, args.max_length)
    ref = load_reference(args, model_dir)
    engine = common.build_engine_from_args(load_causal_lm(model_dir), args)
    steps = common.total_steps(args, len(pairs))
    logger.info("dpo: %d pairs, %d steps, batch %d, beta %g", len(pairs), steps, args.batch_size, args.beta)
    history = common.train_loop(
        engine, common.minibatches(pairs, args.batch_size, args.seed), steps,
        lambda b: dpo_batch_loss(engine, ref, b, tok.pad_token_id, args.beta, args.label_smoothing),
        "dpo", args.log_every)
    common.save_causal_lm(engine, model_dir, Path(args.out), args.overwrite, history,
                          {"kind": "dpo", "data": str(args.data), "steps": steps, "pairs": len(pairs),
                           "lr": args.lr, "beta": args.beta, "label_smoothing": args.label_smoothing})
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main))
