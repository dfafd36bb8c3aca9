"""Datasets of the offline trainers: reading JSONL / Parquet through ``datasets``, checking columns, rendering
prompts (chat template when the tokenizer has one) and turning rows into token ids.

Formats (one row per example):

* ``sft``: ``{"prompt", "completion"}`` or ``{"messages": [{"role", "content"}, ...]}`` (the last message is the
  completion);
* ``pairs``: ``{"prompt", "chosen", "rejected"}`` (optional numeric ``margin`` for the reward model);
* ``kto``: ``{"prompt", "completion", "label"}`` (``label`` true for a desirable completion);
* ``prompts``: ``{"prompt"}`` (batch inference; other columns are carried to the output).

Every encoded example is ``prompt ids + completion ids + [eos]``; the trainers put the loss on the completion
and the eos only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMATS: dict[str, tuple[tuple[str, ...], ...]] = {
    "sft": (("prompt", "completion"), ("messages",)),
    "pairs": (("prompt", "chosen", "rejected"),),
    "kto": (("prompt", "completion", "label"),),
    "prompts": (("prompt",),),
}
"""Format name -> the alternative sets of required columns."""
SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A data file that cannot be used; the message names the file, the problem and the fix."""


def _describe(fmt: str) -> str:
    return " or ".join("{" + ", ".join(f'"{c}"' for c in cols) + "}" for cols in FORMATS[fmt])


def load_rows(path: str | Path, fmt: str, flag: str = "--data") -> list[dict[str, Any]]:
    """All rows of a JSONL or Parquet file, checked against ``fmt``; raises :class:`DataError` naming the fix."""
    import datasets

    if fmt not in FORMATS:
        raise ValueError(f"unknown data format {fmt!r}; expected one of {sorted(FORMATS)}")
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{flag} {path}: no such file")
    if p.suffix not in SUFFIXES:
        raise DataError(f"{flag} {path}: unknown file type {p.suffix!r}; use one of {', '.join(SUFFIXES)}")
    builder = "parquet" if p.suffix == ".parquet" else "json"
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        ds = datasets.load_dataset(builder, data_files=str(p), split="train", keep_in_memory=True)
    except Exception as exc:  # datasets wraps parse errors in several exception types
        raise DataError(f"{flag} {path}: cannot be read as {builder.upper()} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); expected rows like {_describe(fmt)}")
    columns = set(ds.column_names)
    if not any(set(cols) <= columns for cols in FORMATS[fmt]):
        raise DataError(f"{flag} {path} has columns {sorted(columns)}; the {fmt} format needs {_describe(fmt)}")
    if len(ds) == 0:
        raise DataError(f"{flag} {path} has no rows")
    rows = ds.to_list()
    _check_values(rows, fmt, flag, str(path))
    return rows


def _check_values(rows: list[dict[str, Any]], fmt: str, flag: str, path: str) -> None:
    text_cols = {"sft": ("prompt", "completion"), "pairs": ("prompt", "chosen", "rejected"),
                 "kto": ("prompt", "completion"), "prompts": ("prompt",)}[fmt]
    for i, row in enumerate(rows):
        if fmt == "sft" and row.get("messages") is not None:
            msgs = row["messages"]
            if not isinstance(msgs, list) or len(msgs) < 2 or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
                raise DataError(f"{flag} {path} row {i}: 'messages' must be a list of at least two "
                                "{\"role\", \"content\"} objects (the last one is the completion)")
            continue
        for col in text_cols:
            if not isinstance(row.get(col), str):
                raise DataError(f"{flag} {path} row {i}: column {col!r} must be a string, got {row.get(col)!r}")
        if fmt == "kto" and not isinstance(row.get("label"), bool):
            raise DataError(f"{flag} {path} row {i}: column 'label' must be true or false, got {row.get('label')!r}")


@dataclass(frozen=True)
class Encoded:
    """Token ids of prompt + completion + eos; the first ``n_prompt`` ids are the prompt."""

    ids: list[int]
    n_prompt: int


def render_prompt(tokenizer: Any, prompt: str) -> str:
    """The prompt as the model sees it: through the chat template when the tokenizer has one, else verbatim."""
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True))
    return prompt


def split_messages(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, str]:
    """(rendered prompt, completion text) of a conversation whose last message is the completion."""
    if getattr(tokenizer, "chat_template", None):
        prompt = str(tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))
        return prompt, messages[-1]["content"]
    return "".join(m["content"] for m in messages[:-1]), messages[-1]["content"]


def encode(tokenizer: Any, prompt_text: str, completion: str, max_length: int, eos: bool = True) -> Encoded | None:
    """Encode an already rendered prompt and its completion (+ eos unless ``eos=False``), cut to ``max_length``.

    Returns None when the prompt alone leaves no room for a completion token (the caller counts it).
    """
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    completion_ids = tokenizer.encode(completion, add_special_tokens=False)
    if eos:
        completion_ids.append(tokenizer.eos_token_id)
    if len(prompt_ids) >= max_length:
        return None
    return Encoded(ids=(prompt_ids + completion_ids)[:max_length], n_prompt=len(prompt_ids))


def encode_sft(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> list[Encoded]:
    """SFT rows -> encoded examples; rows that cannot fit are skipped and counted in a warning."""
    out: list[Encoded] = []
    for row in rows:
        if row.get("messages") is not None:
            prompt, completion = split_messages(tokenizer, row["messages"])
        else:
            prompt, completion = render_prompt(tokenizer, row["prompt"]), row["completion"]
        enc = encode(tokenizer, prompt, completion, max_length)
        if enc is not None:
            out.append(enc)
    _warn_skipped(len(rows), len(out), max_length)
    return out


def encode_pairs(tokenizer: Any, rows: list[dict[str, Any]], max_length: int,
                 eos: bool = True) -> list[tuple[Encoded, Encoded, float]]:
    """Pair rows -> (chosen, rejected, margin) with one rendered prompt; unfit rows skipped with a warning."""
    out: list[tuple[Encoded, Encoded, float]] = []
    for row in rows:
        prompt = render_prompt(tokenizer, row["prompt"])
        chosen = encode(tokenizer, prompt, row["chosen"], max_length, eos)
        rejected = encode(tokenizer, prompt, row["rejected"], max_length, eos)
        if chosen is not None and rejected is not None:
            out.append((chosen, rejected, float(row.get("margin") or 0.0)))
    _warn_skipped(len(rows), len(out), max_length)
    return out


def encode_kto(tokenizer: Any, rows: list[dict[str, Any]], max_length: int) -> list[tuple[Encoded, bool]]:
    """KTO rows -> (example, desirable); unfit rows skipped with a warning."""
    out: list[tuple[Encoded, bool]] = []
    for row in rows:
        enc = encode(tokenizer, render_prompt(tokenizer, row["prompt"]), row["completion"], max_length)
        if enc is not None:
            out.append((enc, bool(row["label"])))
    _warn_skipped(len(rows), len(out), max_length)
    return out


def _warn_skipped(total: int, kept: int, max_length: int) -> None:
    if kept == 0:
        raise DataError(f"no row fits in --max-length {max_length} tokens; raise --max-length")
    if kept < total:
        logger.warning("skipped %d of %d rows whose prompt alone reaches --max-length %d", total - kept, total,
                       max_length)
