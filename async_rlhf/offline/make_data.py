"""Offline data built from the tiny addition task: SFT rows, preference pairs, KTO rows and prompt files.

    python -m async_rlhf.offline.make_data --out DIR [--train 2000 --heldout 200 --digits 2 --seed 0]

Writes ``sft.jsonl`` ({prompt, completion}), ``pairs.jsonl`` ({prompt, chosen, rejected}), ``kto.jsonl``
({prompt, completion, label}, half desirable), and for the task's held-out split ``pairs_heldout.jsonl`` and
``prompts.jsonl`` ({prompt, answer}). Chosen is the right sum; rejected is a plausible mistake
(:func:`plausible_wrong`): every carry forgotten, one carry forgotten, or one digit off by one.
Train rows never use a held-out problem.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from async_rlhf.env.arithmetic import AdditionTask, Problem


def plausible_wrong(task: AdditionTask, problem: Problem, rng: random.Random) -> str:
    """A wrong answer of the same width that a student could give (never the right one)."""
    width = len(problem.answer)
    a, b, right = problem.a, problem.b, problem.answer
    carry = {task.carry_free_answer(problem)}  # every carry forgotten
    for col in range(task.digits):  # the carry out of one column forgotten
        low = 10**col
        if (a % (10 * low)) + (b % (10 * low)) >= 10 * low:
            carry.add(f"{a + b - 10 * low:0{width}d}")
    carry.discard(right)
    digit_slips = set()
    for pos in range(width):  # one digit off by one (no wrap-around: 0 - 1 is not a slip anyone makes)
        for delta in (1, -1):
            if 0 <= int(right[pos]) + delta <= 9:
                digit_slips.add(right[:pos] + str(int(right[pos]) + delta) + right[pos + 1:])
    digit_slips.discard(right)
    # the carry mistakes the sloppy teacher makes two times in three when there are any
    if carry and rng.random() < 2 / 3:
        return rng.choice(sorted(carry))
    return rng.choice(sorted(digit_slips | carry))


def build_rows(task: AdditionTask, problems: list[Problem], seed: int) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(f"make-data-{seed}")
    sft, pairs, kto = [], [], []
    for i, p in enumerate(problems):
        wrong = plausible_wrong(task, p, rng)
        sft.append({"prompt": p.prompt, "completion": p.answer})
        pairs.append({"prompt": p.prompt, "chosen": p.answer, "rejected": wrong})
        desirable = i % 2 == 0
        kto.append({"prompt": p.prompt, "completion": p.answer if desirable else wrong, "label": desirable})
    return {"sft": sft, "pairs": pairs, "kto": kto}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    tmp.replace(path)


def make_data(out: Path, train: int, heldout: int, digits: int = 2, seed: int = 0,
              heldout_size: int = 200) -> dict[str, Path]:
    """Write the files of the module docstring into ``out``; returns name -> path."""
    task = AdditionTask(digits=digits, heldout_size=heldout_size)
    stream = task.train_problems(seed=10_000 + seed)  # a stream apart from the SFT warm start's
    train_problems = [next(stream) for _ in range(train)]
    held = task.heldout()[:heldout]
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, rows in build_rows(task, train_problems, seed).items():
        paths[name] = out / f"{name}.jsonl"
        write_jsonl(paths[name], rows)
    paths["pairs_heldout"] = out / "pairs_heldout.jsonl"
    write_jsonl(paths["pairs_heldout"], build_rows(task, held, seed + 1)["pairs"])
    paths["prompts"] = out / "prompts.jsonl"
    write_jsonl(paths["prompts"], [{"prompt": p.prompt, "answer": p.answer} for p in held])
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m async_rlhf.offline.make_data", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSONL files")
    p.add_argument("--train", type=int, default=2000, help="training problems")
    p.add_argument("--heldout", type=int, default=200, help="held-out problems (at most --heldout-size)")
    p.add_argument("--digits", type=int, default=2, help="operand digits of the addition task")
    p.add_argument("--heldout-size", type=int, default=200, help="size of the task's held-out split")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.train < 1 or not 0 <= args.heldout <= args.heldout_size:
        print(f"error: need --train >= 1 and 0 <= --heldout <= --heldout-size ({args.heldout_size})", file=sys.stderr)
        return 2
    try:
        paths = make_data(Path(args.out), args.train, args.heldout, args.digits, args.seed, args.heldout_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
