"""An OpenAI-compatible endpoint over an episode registry and a token engine: the user's own agent (the stock
``openai`` SDK, any HTTP client) drives rollouts, and what is trained is exactly what was sampled (issue 45).

    app = build_app(EpisodeRegistry(tokenizer, timeout_s=600, stop_token_ids=stops), engine, "policy")
    # the agent: openai.AsyncOpenAI(base_url="http://<generator>/s/<episode id>/v1", api_key="-")

    POST /s/{episode_id}/v1/chat/completions   messages, tools, tool_choice auto|none, stream, n=1, max_tokens |
                                               max_completion_tokens, temperature, top_p, stop, seed, logprobs
    GET  /s/{episode_id}/v1/models             the one model served
    POST /s/{episode_id}/v1/completions        404 with the reason: the ledger records chat turns only (``plan``
                                               takes messages; a raw prompt has no template to splice into)

A library over the ``TokenEngine`` seam (``engine.py``). Each generator serves it (``serving.py``: uvicorn on a thread
of its own) over its own engine loop (``policy_engine.py``), opens each episode before its agent gets the URL, and
turns closed episodes into samples (``environment.py``).

Responses follow the OpenAI schema: ``id`` is the ledger's ``RecordedTurn.response_id``, ``choices[0].message``
its message (content, tool calls with the ledger's ids), ``finish_reason`` (``tool_calls`` when it called tools),
``usage`` (``prompt_tokens``: the episode's context before the turn; ``completion_tokens``: the sampled ids).
Errors are ``{"error": {"message", "type", "param", "code"}}`` naming the problem and the fix; no input crashes
the server (an unexpected failure is a 500 with its reason, which the SDK retries; the plan it left is not
recorded).

Decisions:
  - **Streaming** sends content deltas as the engine's tokens come, decoded incrementally (held back while the
    text ends in a partial UTF-8 character), and the rest of the final content, tool calls and finish at the end:
    the deltas join to the recorded content. With ``tools`` in the request all of it comes at the end (a
    completion may turn out to be a tool call, whose text is not content; vLLM's streaming tool parsers are a
    later refinement). Without ``tools``, a completion that writes a tool call anyway has streamed that text as
    content before the final chunk carries the parsed call. The chunks carry the id the ledger gives the turn (the
    episode's ``turns`` count: calls are serialized). ``stream_options.include_usage`` is honoured.
  - ``tool_choice`` ``auto`` (default) or ``none``; with ``none`` the tools are still rendered (so the history
    stays one branch, as vLLM does by default) and a completion that calls one anyway comes back as tool calls.
  - ``stop`` strings are passed to the engine; the sampled text that spells one stays in the content (it is what
    was sampled and trained, and the history the agent sends back must match the ledger).
  - ``logprobs: true`` returns the sampled tokens' behaviour log-probs (non-streamed only); ``top_logprobs`` > 0
    is refused (the engine returns no alternatives).
  - The request's ``model`` is not checked (agents name models freely); responses name ``model_name``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from async_rlhf.agent.engine import EPISODE, EngineResult, SamplingSpec, TokenEngine, stream_of
from async_rlhf.agent.episodes import EndpointError, Episode, EpisodeRegistry
from async_rlhf.agent.turns import RecordedTurn

log = logging.getLogger(__name__)
ROUTES = "POST /s/<episode id>/v1/chat/completions and GET /s/<episode id>/v1/models"


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> EndpointError:
    return EndpointError(400, message, code=code, param=param)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise _bad(f"'{name}' must be a number in [{lo:g}, {hi:g}], got {value!r}", name)
    return float(value)


def _int(body: dict[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(f"'{name}' must be an integer >= {lo}, got {value!r}", name)
    return value


def parse_chat_request(body: Any) -> tuple[list[Any], list[Any] | None, SamplingSpec, dict[str, Any]]:
    """A chat completions body -> (messages, tools, sampling spec, options); EndpointError 400 naming the fix."""
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of chat messages", "messages")
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad(f"n={n!r} is not supported: this endpoint samples one choice per call (n=1; omit it) so that "
                   "each call is one turn of the episode; make n calls (or n episodes) for n samples", "n",
                   "unsupported_n")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list)
                              or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                         and isinstance(t.get("function"), dict) for t in tools)):
        raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}",
                   "tools")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise _bad(f"tool_choice={json.dumps(choice)} is not supported: use \"auto\" (the default) or \"none\"; "
                   "forcing a call (\"required\" or a named function) needs guided decoding, which this endpoint "
                   "does not do", "tool_choice", "unsupported_tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format is not supported (only {\"type\": \"text\"}): structured output needs guided "
                   "decoding; ask for the format in the prompt instead", "response_format")
    if body.get("stream") not in (None, True, False):
        raise _bad(f"'stream' must be true or false, got {body['stream']!r}", "stream")
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise _bad(f"'stop' must be a string or a list of non-empty strings, got {body['stop']!r}", "stop")
    top_logprobs = _int(body, "top_logprobs", 0)
    if top_logprobs:
        raise _bad("top_logprobs > 0 is not supported: the engine returns the sampled tokens' log-probs only; "
                   "send logprobs=true without top_logprobs", "top_logprobs")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"'seed' must be an integer, got {seed!r}", "seed")
    spec = SamplingSpec(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0), max_tokens=max_tokens,
                        stop=tuple(stop or ()), seed=seed)
    stream_options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    options = {"stream": bool(body.get("stream")), "logprobs": bool(body.get("logprobs")),
               "include_usage": bool(stream_options.get("include_usage"))}
    return messages, tools or None, spec, options


def _usage(turn: RecordedTurn) -> dict[str, int]:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}


def _logprobs(ep: Episode, turn: RecordedTurn) -> dict[str, Any]:
    branch = ep.ledger.branches()[turn.branch]
    out = []
    for i in range(turn.start, turn.end):
        piece = ep.ledger.tokenizer.decode([branch.ids[i]], skip_special_tokens=False)
        out.append({"token": piece, "logprob": branch.logprobs[i], "bytes": list(piece.encode()),
                    "top_logprobs": []})
    return {"content": out, "refusal": None}


def completion_body(ep: Episode, turn: RecordedTurn, model: str, logprobs: bool = False) -> dict[str, Any]:
    """The ``chat.completion`` object of a recorded turn."""
    return {"id": turn.response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": dict(turn.message), "finish_reason": turn.finish_reason,
                         "logprobs": _logprobs(ep, turn) if logprobs else None}],
            "usage": _usage(turn), "system_fingerprint": None}


class _Deltas:
    """Incremental content of a streamed turn: ids in, text deltas out, joining to the recorded content. Each push
    decodes the ids of the last delta (context) + the new ones (as vLLM's incremental detokenizer), not the whole
    text again."""

    def __init__(self, ep: Episode) -> None:
        self.tokenizer = ep.ledger.tokenizer
        self.stops = ep.ledger.stop_token_ids
        self.ids: list[int] = []
        self.sent = ""
        self.prefix = self.read = 0
        """``ids[prefix:read]``: context already sent (decoded again so a leading space or a merge stays right);
        ``ids[read:]``: not sent yet."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, ids: list[int]) -> str:
        self.ids += [i for i in ids if i not in self.stops]  # a stop id ends the turn; it is not content
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""  # a partial UTF-8 character (or a decoding that moved): wait for more ids
        delta = text[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.sent += delta
        return delta


def build_app(registry: EpisodeRegistry, engine: TokenEngine, model_name: str) -> FastAPI:
    """The FastAPI app serving ``registry``'s episodes with ``engine`` (see the module docstring)."""
    app = FastAPI(title="async_rlhf agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def error(exc: EndpointError) -> JSONResponse:
        headers = {} if exc.retry is None else {"x-should-retry": "true" if exc.retry else "false"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: this endpoint serves {ROUTES}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}: this endpoint serves {ROUTES}"
        else:
            message = str(exc.detail)
        return error(EndpointError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(_bad(f"invalid request: {exc.errors()}"))

    @app.get("/s/{episode_id}/v1/models")
    async def models(episode_id: str) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "async_rlhf"}]}

    @app.post("/s/{episode_id}/v1/completions")
    async def completions(episode_id: str) -> JSONResponse:
        return error(EndpointError(404, "/completions is not served: the episode ledger records chat turns "
                                   "(messages rendered through the chat template), not raw prompts; use "
                                   f"/s/{episode_id}/v1/chat/completions", code="not_supported"))

    @app.post("/s/{episode_id}/v1/chat/completions")
    async def chat_completions(episode_id: str, request: Request) -> Any:
        try:
            return await _chat(episode_id, request)
        except EndpointError as exc:
            return error(exc)
        except Exception as exc:  # never take the server down; the SDK retries a 500 (nothing was recorded)
            log.exception("agent endpoint: chat completion of episode %s failed", episode_id)
            return error(EndpointError(500, f"the call failed on the server: {type(exc).__name__}: {exc}",
                                       type_="server_error", code="internal_error"))

    async def _chat(episode_id: str, request: Request) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise _bad(f"the request body is not valid JSON ({exc}): send a JSON object with "
                       "Content-Type: application/json", code="invalid_json") from exc
        messages, tools, spec, options = parse_chat_request(body)
        header = request.headers.get("idempotency-key")
        try:
            retry_count = int(request.headers.get("x-stainless-retry-count", "0"))
        except ValueError:
            retry_count = 0
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]

        def key(ep: Episode) -> str:
            return ep.key(header, digest, retry_count)

        if not options["stream"]:
            async def sample(prompt_ids: list[int]) -> EngineResult:
                EPISODE.set(episode_id)  # this call's own task: the context ends with it
                return await engine.generate(prompt_ids, spec)

            future = registry.submit(episode_id, key, messages, tools, sample)
            turn = await asyncio.shield(future)
            ep = registry.episodes[episode_id]
            return completion_body(ep, turn, model_name, options["logprobs"])

        queue: asyncio.Queue[Any] = asyncio.Queue()
        ep_holder: list[Episode] = []

        async def stream_sample(prompt_ids: list[int]) -> EngineResult:
            EPISODE.set(episode_id)
            ep = registry.episodes[episode_id]
            queue.put_nowait(("id", f"chatcmpl-{episode_id}-{ep.ledger.counters['turns']}"))
            ids: list[int] = []
            logprobs: list[float] = []
            versions: list[int] = []
            finish = None
            async for chunk in stream_of(engine, prompt_ids, spec):
                ids += chunk.token_ids
                logprobs += chunk.logprobs
                versions += chunk.versions
                finish = chunk.finish_reason or finish
                if chunk.token_ids:
                    queue.put_nowait(("ids", list(chunk.token_ids)))
            return EngineResult(ids, logprobs, versions, finish or "stop")

        future = registry.submit(episode_id, key, messages, tools, stream_sample)
        ep_holder.append(registry.episodes[episode_id])
        future.add_done_callback(lambda _: queue.put_nowait(("done", None)))
        first = await queue.get()
        if first[0] == "done" and future.exception() is not None:  # refused before sampling: a plain error
            exc = future.exception()
            raise exc if isinstance(exc, EndpointError) else EndpointError(
                500, f"the call failed on the server: {type(exc).__name__}: {exc}", type_="server_error")

        async def events() -> AsyncIterator[str]:
            ep = ep_holder[0]
            deltas = _Deltas(ep)
            item = first
            rid = item[1] if item[0] == "id" else None
            created = int(time.time())

            def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                        "system_fingerprint": None, **extra}
                return f"data: {json.dumps(body)}\n\n"

            started = False
            while item[0] != "done":
                if item[0] == "ids":
                    text = deltas.push(item[1])
                    if text and not tools:
                        yield chunk({"role": "assistant", "content": text} if not started else {"content": text})
                        started = True
                item = await queue.get()
            try:
                turn = future.result()
            except Exception as exc:
                err = exc if isinstance(exc, EndpointError) else EndpointError(
                    500, f"the call failed on the server: {type(exc).__name__}: {exc}", type_="server_error")
                yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n"
                return
            if rid != turn.response_id:
                rid = turn.response_id
            sent = deltas.sent if not tools else ""
            content = turn.message.get("content") or ""
            rest = content[len(sent):] if content.startswith(sent) else content
            delta: dict[str, Any] = {} if started else {"role": "assistant"}
            if rest or not started:
                delta["content"] = rest if (rest or turn.message.get("content") is not None) else None
            if turn.message.get("tool_calls"):
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(turn.message["tool_calls"])]
            if delta:
                yield chunk(delta)
            yield chunk({}, turn.finish_reason)
            if options["include_usage"]:
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [], "usage": _usage(turn)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    return app
