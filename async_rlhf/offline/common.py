"""What every offline trainer CLI shares: arguments, checks that fail in one line (exit 2), model and tokenizer
loading, the training loop with progress lines, and atomic output directories."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from async_rlhf.offline.data import DataError

logger = logging.getLogger(__name__)
T = TypeVar("T")

METRICS_FILE = "train_metrics.jsonl"
"""One JSON line per logged step in every output directory (step, loss and the loss's own metrics)."""


class CliError(Exception):
    """A bad argument or input: printed as one line, exit status 2."""


def base_parser(prog: str, description: str, data_aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    alias = f" (alias {', '.join(data_aliases)})" if data_aliases else ""
    p.add_argument("--data", *data_aliases, dest="data", required=True,
                   help=f"training rows: a .jsonl or .parquet file{alias}")
    p.add_argument("--model", required=True, help="Hugging Face causal-LM directory to start from")
    p.add_argument("--out", required=True, help="output directory (written atomically; must not exist)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the data when --steps is not given")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--batch-size", type=int, default=16, help="examples (or pairs) per optimizer step")
    p.add_argument("--max-length", type=int, default=512, help="tokens per example (longer ones are cut)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage")
    p.add_argument("--seed", type=int, default=0, help="shuffling and initialization seed")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "max_length", "log_every"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        raise CliError(f"--steps must be at least 1, got {args.steps}")
    if args.epochs <= 0:
        raise CliError(f"--epochs must be > 0, got {args.epochs}")
    if not args.lr > 0:
        raise CliError(f"--lr must be > 0, got {args.lr}")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise CliError(f"--out {out} already exists; choose a new directory or pass --overwrite")


def check_model_dir(path: str, flag: str = "--model") -> Path:
    """A directory with config.json and a tokenizer, else :class:`CliError` saying what is missing."""
    p = Path(path)
    if not p.is_dir():
        raise CliError(f"{flag} {path}: no such directory; pass a Hugging Face model directory")
    if not (p / "config.json").is_file():
        raise CliError(f"{flag} {path} has no config.json: it is not a Hugging Face model directory")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise CliError(f"{flag} {path} has no tokenizer files; save the tokenizer into the model directory")
    return p


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's own tokenizer (``async_rlhf.tokenizer.load_tokenizer``: a pad token guaranteed);
    one without an eos token is refused (the trainers append one to every completion)."""
    from async_rlhf.tokenizer import load_tokenizer as load_own

    tok = load_own(model_dir)
    if tok.eos_token_id is None:
        raise CliError("the tokenizer has no eos token; the trainers append one to every completion")
    return tok


def copy_tokenizer(src: Path, dst: Path, generation_config: bool = False) -> None:
    """Copy the tokenizer files and chat template verbatim (and generation_config.json if asked), so the output
    loads exactly as the input did."""
    from async_rlhf.tokenizer import copy_tokenizer_files

    copy_tokenizer_files(src, dst, generation_config)


def atomic_output(out: Path, write: Callable[[Path], None], overwrite: bool) -> Path:
    """Run ``write(tmp_dir)`` in a sibling temporary directory, then rename it to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        if out.exists() and overwrite:
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def save_causal_lm(engine: Any, model_dir: Path, out: Path, overwrite: bool, history: list[dict[str, float]],
                   summary: dict[str, Any]) -> Path:
    """Save the trained causal LM atomically: weights, the base's tokenizer files and generation config, metrics."""
    def write(tmp: Path) -> None:
        engine.module.save_pretrained(str(tmp))
        copy_tokenizer(model_dir, tmp, generation_config=True)
        write_metrics(tmp, history, {**summary, "base": str(model_dir)})

    atomic_output(out, write, overwrite)
    logger.info("%s: wrote %s (loss %.4f -> %.4f)", summary.get("kind", "train"), out, history[0]["loss"],
                history[-1]["loss"])
    return out


def build_engine_from_args(model: Any, args: argparse.Namespace) -> Any:
    """The one-rank DeepSpeed engine every offline trainer uses, from the shared flags of :func:`base_parser`."""
    from async_rlhf.learner.engine import build_engine

    return build_engine(model, lr=args.lr, micro_batch=args.batch_size, grad_clip=args.grad_clip,
                        zero_stage=args.zero_stage)


def total_steps(args: argparse.Namespace, n_examples: int) -> int:
    return args.steps if args.steps is not None else max(1, math.ceil(args.epochs * n_examples / args.batch_size))


def minibatches(items: Sequence[T], batch_size: int, seed: int) -> Iterator[list[T]]:
    """Endless shuffled minibatches; every item is seen once per epoch (the last partial batch is kept)."""
    rng = random.Random(seed)
    order = list(range(len(items)))
    while True:
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield [items[i] for i in order[start:start + batch_size]]


def train_loop(engine: Any, batches: Iterator[T], steps: int, loss_fn: Callable[[T], tuple[Any, dict[str, float]]],
               name: str, log_every: int) -> list[dict[str, float]]:
    """``steps`` optimizer steps of ``loss_fn`` on successive batches; logs a progress line every ``log_every``.

    Returns one metrics record per step (the loss plus whatever ``loss_fn`` reports).
    """
    engine.train()
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        loss, metrics = loss_fn(next(batches))
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise RuntimeError(f"{name}: loss is {loss_value} at step {step}; lower --lr or check the data")
        engine.backward(loss)
        engine.step()
        record = {"step": float(step), "loss": loss_value, **metrics, "time_s": time.perf_counter() - t0}
        history.append(record)
        if step % log_every == 0 or step == steps:
            extras = " ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith(("reward/accuracy",
                                                                                              "reward/margin")))
            logger.info("%s step %d/%d loss %.4f %s(%.1f s)", name, step, steps, loss_value,
                        f"{extras} " if extras else "", record["time_s"])
    return history


def write_metrics(out_dir: Path, history: list[dict[str, float]], summary: dict[str, Any]) -> None:
    with (out_dir / METRICS_FILE).open("w") as fh:
        for record in history:
            fh.write(json.dumps(record) + "\n")
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def setup(args: argparse.Namespace) -> None:
    """Logging to stderr, thread count, seeds; the environment DeepSpeed's one-rank group needs is set later."""
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call ``main``; a :class:`CliError` or :class:`DataError` becomes one ``error:`` line and exit status 2."""
    try:
        return main(argv)
    except (CliError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
