"""The names of prompts and prompt groups: a prompt's key (generator id, position in its stream) and the id of
the group made from it, which carries its key (and the positions passed over right before it).

    prompt_key(3, 17)            -> "3:17"
    group_id(3, "ab12cd", 17, 2) -> "g3-ab12cd-17~2"
    key_of_group("g3-ab12cd-17~2")  -> "3:17"
    keys_of_group("g3-ab12cd-17~2") -> ["3:15", "3:16", "3:17"]

Pure and below every package that speaks it: the generator names its groups with it, the buffer
(``async_rlhf.prompt_window``) and the driver's ledger read them back (issue 46: the grammar lived in
``generator/stream.py``, which made the buffer import the generator package and the two a circle).
"""

from __future__ import annotations


def prompt_key(gen_id: int, seq: int) -> str:
    return f"{gen_id}:{seq}"


def group_id(gen_id: int, tag: str, seq: int, passed_over: int = 0) -> str:
    """The id of one prompt group; :func:`key_of_group` recovers its prompt key from it. ``passed_over``: how
    many prompts drawn right before it (positions ``seq - passed_over .. seq - 1``) the prompt filter skipped;
    they are used up with this group (:func:`keys_of_group`), so no ledger keeps them outstanding."""
    return f"g{gen_id}-{tag}-{seq}" + (f"~{passed_over}" if passed_over else "")


def _parse(group_id: str) -> tuple[int, int, int]:
    head, _, tail = group_id.rpartition("-")
    seq, marked, passed = tail.partition("~")
    gen = head.split("-", 1)[0]
    if (not gen.startswith("g") or not gen[1:].isdigit() or not seq.isdigit()
            or (marked and (not passed.isdigit() or int(passed) >= int(seq)))):
        raise ValueError(f"group id {group_id!r} does not name a prompt (expected g<gen>-<tag>-<seq>[~<passed>])")
    return int(gen[1:]), int(seq), int(passed or 0)


def key_of_group(group_id: str) -> str:
    """``g3-ab12cd-17`` (or ``g3-ab12cd-17~2``) -> ``3:17``; raises ValueError for an id not made by
    :func:`group_id`."""
    gen, seq, _ = _parse(group_id)
    return prompt_key(gen, seq)


def keys_of_group(group_id: str) -> list[str]:
    """Every prompt key a group uses up: the prompts passed over right before it, then its own
    (``g3-ab12cd-17~2`` -> ``3:15, 3:16, 3:17``)."""
    gen, seq, passed = _parse(group_id)
    return [prompt_key(gen, s) for s in range(seq - passed, seq + 1)]
