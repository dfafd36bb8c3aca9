"""Supervised fine-tuning CLI: loss on completions only, with sample packing.

    python -m async_rlhf.offline.sft --data sft.jsonl --model BASE_DIR --out SFT_DIR [--steps 200 --lr 1e-3]

Rows: ``{"prompt", "completion"}`` or ``{"messages"}``. The output is a causal-LM directory (model, tokenizer,
``train_metrics.jsonl``) that ``launch/cluster.py --model`` and the other trainers accept.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from async_rlhf.offline import common
from async_rlhf.offline.batching import TokenBatch, pack_batch, pad_batch
from async_rlhf.offline.data import Encoded, encode_sft, load_rows

logger = logging.getLogger(__name__)


def load_causal_lm(model_dir: Path, flag: str = "--model") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except (ValueError, OSError) as exc:
        raise common.CliError(f"{flag} {model_dir} does not load as a causal LM ({str(exc).splitlines()[0][:160]})")
    model.config.use_cache = False
    return model


def sft_loss(model: Any, batch: TokenBatch) -> tuple[Any, dict[str, float]]:
    """Mean next-token cross entropy over the trained (completion + eos) tokens of the batch."""
    import torch.nn.functional as F

    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids).logits[:, :-1].float()
    nll = F.cross_entropy(logits.transpose(1, 2), batch.input_ids[:, 1:], reduction="none")
    n_tokens = batch.loss_mask.sum().clamp(min=1.0)
    loss = (nll * batch.loss_mask).sum() / n_tokens
    return loss, {"tokens": float(batch.loss_mask.sum()), "rows": float(batch.input_ids.shape[0])}


def make_batch(examples: list[Encoded], pad_id: int, max_length: int, packing: bool) -> TokenBatch:
    return pack_batch(examples, max_length, pad_id) if packing else pad_batch(examples, pad_id)


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser("python -m async_rlhf.offline.sft", "Supervised fine-tuning (loss on completions).")
    p.add_argument("--no-packing", dest="packing", action="store_false",
                   help="pad each example to the batch's longest instead of packing several per row")
    args = p.parse_args(argv)
    common.check_args(args)
    model_dir = common.check_model_dir(args.model)
    rows = load_rows(args.data, "sft")
    common.setup(args)
    tok = common.load_tokenizer(model_dir)
    examples = encode_sft(tok, rows, args.max_length)
    model = load_causal_lm(model_dir)
    engine = common.build_engine_from_args(model, args)
    steps = common.total_steps(args, len(examples))
    logger.info("sft: %d examples, %d steps, batch %d, packing %s", len(examples), steps, args.batch_size,
                "on" if args.packing else "off")
    batches = (make_batch(b, tok.pad_token_id, args.max_length, args.packing)
               for b in common.minibatches(examples, args.batch_size, args.seed))
    history = common.train_loop(engine, batches, steps, lambda b: sft_loss(engine, b), "sft", args.log_every)

    common.save_causal_lm(engine, model_dir, Path(args.out), args.overwrite, history,
                          {"kind": "sft", "data": str(args.data), "steps": steps, "examples": len(examples),
                           "lr": args.lr, "packing": args.packing})
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main))
