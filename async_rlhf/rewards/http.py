"""A remote scorer over HTTP: one POST per prompt group on the generator's event loop (asyncio streams, no
thread per request), so hundreds of slow requests can be outstanding while the engine keeps stepping.

Request body (JSON): ``{"prompt": str, "completions": [str, ...], "data": {...}}``;
answer: ``{"rewards": [float, ...]}``, one per completion. ``async_rlhf.rewards.scorer_server`` is a
reference server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from urllib.parse import urlsplit

from async_rlhf.env.base import Prompt
from async_rlhf.rewards.base import RewardError, RewardSource, check_rewards


async def post_json(url: str, payload: object, timeout_s: float) -> object:
    """POST ``payload`` as JSON with HTTP/1.1 (connection closed after the answer); the decoded JSON answer."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RewardError(f"scorer url {url!r} must be http://host[:port]/path or https://...")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    body = json.dumps(payload).encode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

    async def exchange() -> bytes:
        reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=parts.scheme == "https")
        try:
            writer.write(head + body)
            await writer.drain()
            return await reader.read()
        finally:
            writer.close()

    try:
        raw = await asyncio.wait_for(exchange(), timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise RewardError(f"scorer {url} failed: {type(exc).__name__} {exc}") from None
    header, _, content = raw.partition(b"\r\n\r\n")
    status_line = header.split(b"\r\n", 1)[0].decode(errors="replace")
    fields = status_line.split(" ", 2)
    if len(fields) < 2 or fields[1] != "200":
        raise RewardError(f"scorer {url} answered {status_line!r}")
    if b"transfer-encoding: chunked" in header.lower():
        raise RewardError(f"scorer {url} answered with chunked encoding; send a Content-Length")
    try:
        return json.loads(content)
    except json.JSONDecodeError as exc:
        raise RewardError(f"scorer {url} answered something that is not JSON: {exc}") from None


class HttpScorer(RewardSource):
    name = "http"

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        payload = {"prompt": prompt.text, "completions": list(completions), "data": prompt.data}
        answer = await post_json(self.url, payload, self.timeout_s)
        if not isinstance(answer, dict) or "rewards" not in answer:
            raise RewardError(f"scorer {self.url} answered {answer!r:.80}; expected {{\"rewards\": [...]}}")
        return check_rewards(answer["rewards"], len(completions), f"scorer {self.url}")
