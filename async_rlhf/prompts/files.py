"""Prompts from a JSONL or Parquet file, read with the ``datasets`` library, reshuffled every epoch."""

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


def epochs(records: list[dict[str, Any]], text_field: str, seed: int) -> Iterator[Prompt]:
    if not records:
        raise ValueError("the prompt file holds no records")
    prompts = [to_prompt(r, text_field) for r in records]  # a bad record is refused before training starts
    rng = random.Random(seed)
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            yield prompts[i]


def file_prompts(path: str, text_field: str = "prompt", seed: int = 0) -> IterablePrompts:
    return IterablePrompts(epochs(load_records(path), text_field, seed), text_field)
