"""Reward-model CLI: a Bradley-Terry scalar head on a causal-LM base, trained on preference pairs.

    python -m async_rlhf.offline.reward_model --pairs pairs.jsonl --model BASE_DIR --out RM_DIR [--steps 100]

Rows: ``{"prompt", "chosen", "rejected"}`` (optional ``margin``). The base's transformer is kept and a new
one-output ``score`` head is added (``AutoModelForSequenceClassification``, ``num_labels=1``); the score of a
sequence is read at its last non-pad token, with no eos appended. The output directory loads with
``AutoModelForSequenceClassification.from_pretrained`` and carries the base's tokenizer files unchanged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from async_rlhf.offline import common
from async_rlhf.offline.data import Encoded, encode_pairs, load_rows

logger = logging.getLogger(__name__)


def load_reward_model(model_dir: Path, pad_id: int, flag: str = "--model") -> Any:
    """A one-output sequence classifier from a causal-LM base (new head) or from a saved reward model."""
    import torch
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32)
    except (ValueError, OSError, KeyError) as exc:
        raise common.CliError(f"{flag} {model_dir} cannot carry a sequence-classification head "
                              f"({str(exc).splitlines()[0][:160]}); pass a causal-LM or reward-model directory")
    model.config.pad_token_id = pad_id
    model.config.use_cache = False
    return model


def pairs_loss(model: Any, batch: list[tuple[Encoded, Encoded, float]], pad_id: int) -> tuple[Any, dict[str, float]]:
    """Bradley-Terry loss of one minibatch of (chosen, rejected, margin); chosen and rejected in one forward."""
    import torch

    from async_rlhf.learner.losses import bradley_terry_loss
    from async_rlhf.offline.scoring import reward_scores

    n = len(batch)
    scores = reward_scores(model, [c for c, _, _ in batch] + [r for _, r, _ in batch], pad_id)
    margins = torch.tensor([m for _, _, m in batch], dtype=scores.dtype)
    margin = margins if bool((margins != 0).any()) else None
    return bradley_terry_loss(scores[:n], scores[n:], margin)


def main(argv: list[str] | None = None) -> int:
    p = common.base_parser("python -m async_rlhf.offline.reward_model",
                           "Reward model (Bradley-Terry) on preference pairs.", data_aliases=("--pairs",))
    args = p.parse_args(argv)
    common.check_args(args)
    model_dir = common.check_model_dir(args.model)
    rows = load_rows(args.data, "pairs")
    common.setup(args)
    tok = common.load_tokenizer(model_dir)
    pairs = encode_pairs(tok, rows, args.max_length, eos=False)
    model = load_reward_model(model_dir, tok.pad_token_id)
    engine = common.build_engine_from_args(model, args)
    steps = common.total_steps(args, len(pairs))
    logger.info("reward model: %d pairs, %d steps, batch %d", len(pairs), steps, args.batch_size)
    history = common.train_loop(engine, common.minibatches(pairs, args.batch_size, args.seed), steps,
                                lambda b: pairs_loss(engine, b, tok.pad_token_id), "reward_model", args.log_every)

    def write(tmp: Path) -> None:
        engine.module.save_pretrained(str(tmp))
        common.copy_tokenizer(model_dir, tmp)
        common.write_metrics(tmp, history, {"kind": "reward_model", "base": str(model_dir), "data": str(args.data),
                                            "steps": steps, "pairs": len(pairs), "lr": args.lr})

    out = common.atomic_output(Path(args.out), write, args.overwrite)
    logger.info("reward model: wrote %s (train accuracy over the last 10 steps %.3f)", out,
                sum(h["reward/accuracy"] for h in history[-10:]) / len(history[-10:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run_main(main))
