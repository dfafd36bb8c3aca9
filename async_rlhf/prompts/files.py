"""Prompts from a JSONL or Parquet file, read with the ``datasets`` library, reshuffled every epoch and dealt to
the generators in disjoint strides (:func:`epochs`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from async_rlhf.env.base import Prompt
from async_rlhf.prompts.base import IterablePrompts, to_prompt

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_records(path: str) -> list[dict[str, Any]]:
    """Every record of the file as a dict (the ``train`` split of ``datasets.load_dataset``)."""
    from datasets import load_dataset  # heavy import at the edge

    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise ValueError(f"prompts.path={path}: unknown format; use a .jsonl, .json or .parquet file")
    ds = load_dataset(kind, data_files=str(path), split="train")
    return [dict(r) for r in ds]


def epochs(records: list[dict[str, Any]], text_field: str, seed: int, lane: int = 0,
           lanes: int = 1) -> Iterator[Prompt]:
    """Every record once per epoch, in a new seeded order each epoch, forever.

    With ``lanes`` > 1 the fleet shares one such sequence (same ``seed``) and lane ``i`` yields its global
    positions ``i, i + lanes, i + 2 * lanes, ...``: the generators draw disjoint strides, so each record is
    drawn once per epoch across the fleet. A lane is a pure function of its index, so a restarted generator
    (same index) replays and continues exactly its own stride.

        seq of epochs (seed):  [c a d b] [b d a c] ...      lanes=2:  lane 0 -> c d b a ...
                                                                      lane 1 -> a b d c ...
    """
    if not records:
        raise ValueError("the prompt file holds no records")
    if not 0 <= lane < lanes:
        raise ValueError(f"lane {lane} of {lanes}: a lane must lie in 0..{lanes - 1}")
    prompts = [to_prompt(r, text_field) for r in records]  # a bad record is refused before training starts
    n = len(prompts)
    rng = random.Random(seed)
    order: list[int] = []
    epoch = -1
    k = lane
    while True:
        e, offset = divmod(k, n)
        while epoch < e:  # every lane draws the same orders from the same seed, epoch by epoch
            order = list(range(n))
            rng.shuffle(order)
            epoch += 1
        yield prompts[order[offset]]
        k += lanes


def file_prompts(path: str, text_field: str = "prompt", seed: int = 0, lane: int = 0,
                 lanes: int = 1) -> IterablePrompts:
    return IterablePrompts(epochs(load_records(path), text_field, seed, lane, lanes), text_field)
