"""The open part of the driver's prompt ledger, as a small message: what it asks the buffer about (pure).

Per generator the ledger knows its stream ``position`` and the positions up to it not yet used up (``pending``);
every other position up to ``position`` is settled. So a group whose prompt keys all lie at or below
``position`` and outside ``pending`` can change no decision of the driver (it was trained already), and the
buffer leaves it out of a windowed ledger reply: that reply holds what is in flight, not the run's history
(issue 44, defect 11: the whole trained/dropped sets outgrew ``buffer.max_message_mb`` past ~2 M groups).

    windows = {0: (120, {97, 101})}            generator 0: drawn up to 120, 97 and 101 not yet used up
    is_open("g0-ab12-101", windows) -> True     pending
    is_open("g0-ab12-50", windows)  -> False    settled
    is_open("g0-ab12-121", windows) -> True     beyond the position (drawn since the driver's last poll)
    is_open("g5-cd34-3", windows)   -> False    a generator not asked about (one the ledger has not seen is
                                                asked about as (0, {}): all of its groups are open)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from async_rlhf.prompt_keys import keys_of_group

Windows = dict[int, tuple[int, frozenset[int]]]


def encode_windows(windows: Mapping[int, tuple[int, Iterable[int]]]) -> list[list[Any]]:
    """``{gen: (position, pending)}`` as plain lists for the wire: ``[[gen, position, [pending...]], ...]``."""
    return [[int(g), int(p), sorted(int(s) for s in pending)] for g, (p, pending) in sorted(windows.items())]


def decode_windows(raw: Any) -> Windows:
    """The inverse of :func:`encode_windows`; ValueError for anything else (it comes off a socket)."""
    if not isinstance(raw, (list, tuple)):
        raise ValueError("ledger_of must be a list of [generator, position, [pending positions]]")
    out: Windows = {}
    for entry in raw:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[2], (list, tuple))
                or not all(type(x) is int for x in (entry[0], entry[1], *entry[2]))):
            raise ValueError("ledger_of entries must be [generator, position, [pending positions]] of integers")
        out[entry[0]] = (entry[1], frozenset(entry[2]))
    return out


def is_open(group_id: str, windows: Windows) -> bool:
    """Whether a group's prompts are still open in the ledger ``windows`` describe (see the module's doc); a
    group of a generator ``windows`` leaves out, or an id that names no prompt (not made by
    ``prompt_keys.group_id``), is not: False."""
    try:
        keys = keys_of_group(group_id)
    except ValueError:
        return False
    for key in keys:
        gen, _, seq_text = key.partition(":")
        seq = int(seq_text)
        window = windows.get(int(gen))
        if window is not None and (seq > window[0] or seq in window[1]):
            return True
    return False
