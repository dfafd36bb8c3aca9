"""Prompts from a Redis stream that external producers append to while training runs.

    producer:   XADD async_rlhf:prompts * prompt "12+30=" answer "042"     (or push_prompts(...) below)
    generators: XREADGROUP GROUP async_rlhf-generators <consumer> COUNT n STREAMS async_rlhf:prompts >
                (non-blocking), then XACK: every prompt goes to exactly one generator

Fields are strings on the wire; a field holding JSON (``{"answer": 42}`` as the ``data`` field) is decoded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from async_rlhf.env.base import Prompt
from async_rlhf.prompts.base import PromptSource, to_prompt

log = logging.getLogger(__name__)
GROUP = "async_rlhf-generators"


def _decode(fields: Mapping[bytes, bytes], text_field: str) -> Prompt:
    record: dict[str, Any] = {k.decode(): v.decode() for k, v in fields.items()}
    data = record.pop("data", None)
    if data:
        record.update(json.loads(data))
    return to_prompt(record, text_field)


class RedisStreamPrompts(PromptSource):
    def __init__(self, url: str, stream: str, consumer: str, text_field: str = "prompt") -> None:
        import redis

        super().__init__()
        self.redis = redis.Redis.from_url(url)
        self.stream = stream
        self.consumer = consumer
        self.text_field = text_field
        self.bad = 0
        try:
            self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _fetch(self, n: int) -> list[Prompt]:
        if n <= 0:
            return []
        reply = self.redis.xreadgroup(GROUP, self.consumer, {self.stream: ">"}, count=n)
        out: list[Prompt] = []
        ids = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                ids.append(entry_id)
                try:
                    out.append(_decode(fields, self.text_field))
                except (ValueError, UnicodeDecodeError) as exc:  # a bad record is skipped and counted
                    self.bad += 1
                    log.warning("prompt stream %s: skipped %s: %s", self.stream,
                                                        entry_id, exc)
        if ids:
            self.redis.xack(self.stream, GROUP, *ids)
        return out

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
