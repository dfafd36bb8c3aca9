"""KTO CLI: Kahneman-Tversky optimization on completions labelled desirable or not.

    python -m async_rlhf.offline.kto --data kto.jsonl --model SFT_DIR --out KTO_DIR [--beta 0.1 --steps 100]

Rows: ``{"prompt", "completion", "label"}``. The KL reference point of each batch is the policy-vs-reference
log-ratio of mismatched pairs (prompt i with completion i+1), averaged and clamped at 0, without gradient.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from async_rlhf.offline import common
from async_rlhf.offline.data import Encoded, encode_kto, load_rows
from async_rlhf.offline.dpo import add_preference_args, load_reference
from async_rlhf.offline.sft import load_causal_lm

logger = logging.getLogger(__name__)


def kto_batch_loss(policy: Any, ref: Any, batch: list[tuple[Encoded, bool]], pad_id: int, beta: float,
                   desirable_weight: float, undesirable_weight: float) -> tuple[Any, dict[str, float]]:
    import torch

    from async_rlhf.learner.losses import kto_loss
    from async_rlhf.offline.scoring import completion_logps, mismatched

    seqs = [e for e, _ in batch]
    desirable = torch.tensor([d for _, d in batch], dtype=torch.bool)
    with torch.no_grad():
        ref_logp = completion_logps(ref, seqs, pad_id)
        if len(seqs) > 1:
            shifted = mismatched(seqs)
            kl = (completion_logps(policy, shifted, pad_id) - completion_logps(ref, shifted, pad_id)).mean()
        else:
            kl = torch.zeros(())
    logp = completion_logps(policy, seqs, pad_id)
    return kto_loss(logp, ref_logp, desirable, kl, beta, desirable_weight, undesirable_weight)


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser("python -m async_rlhf.offline.kto", "KTO on completions labelled desirable or not.")
    add_preference_args(p)
    p.add_argument("--desirable-weight", type=float, default=1.0, help="loss weight of desirable examples")
    p.add_argument("--undesirable-weight", type=float, default=1.0, help="loss weight of undesirable examples")
    args = p.parse_args(argv)
    common.check_args(args)
    if args.beta <= 0:
        raise common.CliError(f"--beta must be > 0, got {args.beta}")
    if args.desirable_weight < 0 or args.undesirable_weight < 0:
        raise common.CliError("--desirable-weight and --undesirable-weight must be >= 0")
    model_dir = common.check_model_dir(args.model)
    rows = load_rows(args.data, "kto")
    common.setup(args)
    tok = common.load_tokenizer(model_dir)
    examples = encode_kto(tok, rows, args.max_length)
    ref = load_reference(args, model_dir)
    engine = common.build_engine_from_args(load_causal_lm(model_dir), args)
    steps = common.total_steps(args, len(examples))
    logger.info("kto: %d examples (%d desirable), %d steps, batch %d, beta %g", len(examples),
                sum(d for _, d in examples), steps, args.batch_size, args.beta)
    history = common.train_loop(
        engine, common.minibatches(examples, args.batch_size, args.seed), steps,
        lambda b: kto_batch_loss(engine, ref, b, tok.pad_token_id, args.beta, args.desirable_weight,
                                 args.undesirable_weight),
        "kto", args.log_every)
    common.save_causal_lm(engine, model_dir, Path(args.out), args.overwrite, history,
                          {"kind": "kto", "data": str(args.data), "steps": steps, "examples": len(examples),
                           "lr": args.lr, "beta": args.beta})
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main))
