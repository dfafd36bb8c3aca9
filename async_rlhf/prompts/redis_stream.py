"""Prompts from a Redis stream that external producers append to while training runs.

    producer:   XADD async_rlhf:prompts * prompt "12+30=" answer "042"     (or push_prompts(...) below)
    generators: XREADGROUP GROUP async_rlhf-generators <consumer> COUNT n STREAMS async_rlhf:prompts >
                (non-blocking); every prompt goes to exactly one generator

Fields are strings on the wire; a field holding JSON (``{"answer": 42}`` as the ``data`` field) is decoded.

A generator's prompts are numbered (its stream positions, ``generator/stream.py``): the driver's ledger re-issues
positions drawn but never trained after a restart or a resume. A deterministic source reaches a position by
drawing it again; a Redis stream cannot (its entries are read once), so the source keeps its positions in Redis
itself (issue 44, defect 3)::

    S:drawn:<run id>:<consumer>   HASH   position -> {"id": entry id, "f": fields}   and "top" -> last position
    draw:  XREADGROUP (this consumer's own pending entries first, then entries idle on a consumer that never came
           back, then new ones) ; MULTI  HSET positions, "top" ; XACK  EXEC

An entry is acknowledged in the same transaction that records it under a position: delivered and not
acknowledged means not recorded (read again by this consumer at its next start, or claimed by another after
``CLAIM_IDLE_S``); acknowledged means the ledger owns it under its key. :meth:`RedisStreamPrompts.seek` continues
after the driver's position from the record (positions drawn that the driver never saw come back under their own
keys; nothing is read to reach it) and :meth:`recorded` gives the prompts of re-issued positions. The record is
scoped by the run id (``run.id``): a fresh run on the same stream starts at position 1 with new entries. The
record grows by one small field per prompt drawn.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from async_rlhf.env.base import Prompt
from async_rlhf.prompts.base import PromptSource, to_prompt

log = logging.getLogger(__name__)
GROUP = "async_rlhf-generators"
CLAIM_IDLE_S = 60.0
"""An entry delivered to a consumer but not recorded for this long belongs to a consumer that died between the
read and the record and never came back (a generator scaled away): another consumer claims it."""
TOP = "top"


def _decode(fields: Mapping[bytes, bytes] | Mapping[str, str], text_field: str) -> Prompt:
    record: dict[str, Any] = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                              for k, v in fields.items()}
    data = record.pop("data", None)
    if data:
        record.update(json.loads(data))
    return to_prompt(record, text_field)


def drawn_key(stream: str, consumer: str, scope: str = "") -> str:
    """The Redis hash of ``consumer``'s positions in ``stream`` for the run ``scope``."""
    return f"{stream}:drawn:{scope}:{consumer}" if scope else f"{stream}:drawn:{consumer}"


class RedisStreamPrompts(PromptSource):
    """A consumer of the stream whose prompts keep their positions in Redis (see the module's docstring).

    ``position``: the position of the prompt ``next()`` returned last."""

    def __init__(self, url: str, stream: str, consumer: str, text_field: str = "prompt", scope: str = "") -> None:
        import redis

        super().__init__()
        self.redis = redis.Redis.from_url(url)
        self.stream = stream
        self.consumer = consumer
        self.text_field = text_field
        self.k_drawn = drawn_key(stream, consumer, scope)
        self.bad = 0
        self.position = 0
        self._ready_pos: deque[int] = deque()
        self._cursor = 0  # position of the last prompt put in _ready
        self._top = 0  # the last position recorded
        self._skip: set[int] = set()
        self._own_pending = True  # this consumer's unrecorded entries are read first (once per start)
        self._next_claim = 0.0
        try:
            self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self.seek(0)

    def seek(self, start: int, skip: Iterable[int] = ()) -> None:
        """Continue after position ``start``: positions recorded beyond it (drawn, but not seen by the driver) come
        back under their keys, then new entries; positions in ``skip`` are passed over (the buffer holds them, or
        they were trained)."""
        self._ready.clear()
        self._ready_pos.clear()
        self._cursor = self.position = int(start)
        self._skip = {int(s) for s in skip if int(s) > start}
        self._top = max(int(self.redis.hget(self.k_drawn, TOP) or 0), self._cursor)

    def recorded(self, positions: list[int]) -> list[Prompt | None]:
        """The prompts recorded at ``positions`` (re-issued ones); None where none is recorded (the record was lost:
        Redis kept nothing on disk, said in the log) or where it was given back to the stream (``requeue_drawn``)."""
        if not positions:
            return []
        out: list[Prompt | None] = []
        for seq, raw in zip(positions, self.redis.hmget(self.k_drawn, [str(s) for s in positions]), strict=True):
            if raw is None:
                log.error("prompt stream %s: position %d of %s has no record in %s (lost with Redis data?): it "
                          "cannot be issued again", self.stream, seq, self.consumer, self.k_drawn)
                out.append(None)
            elif json.loads(raw).get("requeued"):  # given back to the stream (requeue_drawn): drawn anew elsewhere
                out.append(None)
            else:
                out.append(_decode(json.loads(raw)["f"], self.text_field))
        return out

    def _fetch(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        if n <= 0:
            return out
        while len(out) < n and self._cursor < self._top:  # recorded beyond the position: drawn, not trained or held
            seqs = [s for s in range(self._cursor + 1, self._top + 1) if s not in self._skip][:n - len(out)]
            for seq, prompt in zip(seqs, self.recorded(seqs), strict=True):
                if prompt is not None:
                    out.append(prompt)
                    self._ready_pos.append(seq)
            self._cursor = seqs[-1] if seqs else self._top
        if len(out) < n:
            out += self._draw_new(n - len(out))
        return out

    def _read(self, n: int) -> list[tuple[bytes, Any]]:
        """Up to ``n`` entries for this consumer: its own unrecorded ones, those of a consumer that died between its
        read and its record, then new ones."""
        entries: list[tuple[bytes, Any]] = []
        if self._own_pending:
            for _, got in self.redis.xreadgroup(GROUP, self.consumer, {self.stream: "0"}, count=n) or []:
                entries += got
            if len(entries) < n:
                self._own_pending = False
        now = time.monotonic()
        if len(entries) < n and now >= self._next_claim:
            self._next_claim = now + CLAIM_IDLE_S / 4
            claimed = self.redis.xautoclaim(self.stream, GROUP, self.consumer, int(CLAIM_IDLE_S * 1000),
                                            start_id="0-0", count=n - len(entries))
            entries += claimed[1] if len(claimed) > 1 else []
        if len(entries) < n:
            for _, got in self.redis.xreadgroup(GROUP, self.consumer, {self.stream: ">"}, count=n - len(entries)) or []:
                entries += got
        return entries

    def _draw_new(self, n: int) -> list[Prompt]:
        entries = self._read(n)
        if not entries:
            return []
        out: list[Prompt] = []
        records: dict[str, str] = {}
        positions: list[int] = []
        seq = self._top
        for entry_id, fields in entries:
            if not fields:  # deleted from the stream (XDEL, XTRIM) before it was recorded
                self.bad += 1
                continue
            try:
                prompt = _decode(fields, self.text_field)
            except (ValueError, UnicodeDecodeError) as exc:  # a bad record is skipped and counted
                self.bad += 1
                log.warning("prompt stream %s: skipped %s: %s", self.stream, entry_id, exc)
                continue
            seq += 1
            while seq in self._skip:  # (only after a lost record: a skipped position is drawn already)
                seq += 1
            records[str(seq)] = json.dumps({"id": entry_id.decode(), "f": {k.decode(): v.decode()
                                                                          for k, v in fields.items()}})
            out.append(prompt)
            positions.append(seq)
        pipe = self.redis.pipeline(transaction=True)
        if records:
            pipe.hset(self.k_drawn, mapping={**records, TOP: seq})
        pipe.xack(self.stream, GROUP, *[entry_id for entry_id, _ in entries])
        pipe.execute()
        self._top = self._cursor = seq
        self._ready_pos.extend(positions)
        return out

    def __next__(self) -> Prompt:
        prompt = super().__next__()
        self.position = self._ready_pos.popleft()
        return prompt

    def close(self) -> None:
        self.redis.close()


def push_prompts(url: str, stream: str, prompts: Iterable[Prompt | str | Mapping[str, Any]],
                 text_field: str = "prompt") -> int:
    """Append prompts to the stream (what an external producer does); returns how many."""
    import redis

    r = redis.Redis.from_url(url)
    count = 0
    try:
        for item in prompts:
            p = to_prompt(item, text_field)
            r.xadd(stream, {text_field: p.text, "data": json.dumps(p.data)})
            count += 1
    finally:
        r.close()
    return count


def requeue_drawn(url: str, stream: str, consumer: str, scope: str, open_positions: Iterable[int], position: int,
                  keep: Iterable[int] = ()) -> tuple[list[int], int]:
    """Give back to the stream, as new entries, the prompts ``consumer`` drew that nobody trained: a generator a
    resume no longer runs (fewer ``--generators``). Its positions would otherwise never be issued again: the
    positions ``open_positions`` (outstanding in the driver's ledger) and those recorded beyond ``position`` (drawn,
    never seen by the driver), less ``keep`` (a durable buffer holds them: trained under their own keys).

    Each requeued record is marked in the same transaction as its new entry, so a resume that dies and runs again
    requeues nothing twice; a marked position counts as given back. Returns the positions given back (now or
    before) and the consumer's last recorded position."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        key = drawn_key(stream, consumer, scope)
        top = int(r.hget(key, TOP) or 0)
        wanted = sorted((set(int(s) for s in open_positions) | set(range(position + 1, top + 1)))
                        - set(int(s) for s in keep))
        if not wanted:
            return [], top
        given: list[int] = []
        pipe = r.pipeline(transaction=True)
        for seq, raw in zip(wanted, r.hmget(key, [str(s) for s in wanted]), strict=True):
            if raw is None:
                log.error("prompt stream %s: position %d of %s has no record in %s (lost with Redis data?): it "
                          "cannot be given back", stream, seq, consumer, key)
                continue
            rec = json.loads(raw)
            given.append(seq)
            if rec.get("requeued"):
                continue
            pipe.xadd(stream, rec["f"])
            pipe.hset(key, str(seq), json.dumps({**rec, "requeued": True}))
        pipe.execute()
        return given, top
    finally:
        r.close()
