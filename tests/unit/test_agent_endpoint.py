"""The agent endpoint's HTTP layer (async_rlhf/agent/endpoint.py, episodes.py) under the stock ``openai`` SDK.

Unit tier: the subject is the HTTP layer (OpenAI schema, streaming, idempotency, deadlines, errors,
serialization), so the engine is a scripted fake ``TokenEngine`` that answers with the token ids of a chosen text
(one id per streamed chunk) and records what it was given and what it produced; a real uvicorn server runs in a
thread on a free port. The real vLLM engine behind the seam is a later session's (the generator actor).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import uvicorn
from agent_templates import QWEN25_TEMPLATE, TOOLS, fresh_tokenizer  # tests/agent_templates.py

from async_rlhf.agent.endpoint import build_app
from async_rlhf.agent.engine import EngineChunk, EngineResult, SamplingSpec
from async_rlhf.agent.episodes import EpisodeRegistry

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12+30"}}\n</tool_call>'


class ScriptedEngine:
    """Answers ``reply(prompt text)`` encoded, + the stop id; log-prob -0.5, version 3 on every id."""

    def __init__(self, tokenizer, stop_id: int, reply: Callable[[str], str], delay: float = 0.0,
                 fail_first: int = 0) -> None:
        self.tokenizer, self.stop_id, self.reply, self.delay = tokenizer, stop_id, reply, delay
        self.fail_first = fail_first
        self.calls: list[tuple[list[int], list[int]]] = []
        self.params: list[SamplingSpec] = []
        self.active = self.max_active = 0

    def _output(self, prompt_ids: list[int]) -> list[int]:
        text = self.reply(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.stop_id]

    async def _enter(self, prompt_ids: list[int], params: SamplingSpec) -> list[int]:
        self.params.append(params)
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("scripted engine failure")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        out = self._output(prompt_ids)
        self.calls.append((list(prompt_ids), out))
        return out

    async def generate(self, prompt_ids: list[int], params: SamplingSpec) -> EngineResult:
        out = await self._enter(prompt_ids, params)
        return EngineResult(out, [-0.5] * len(out), [3] * len(out), "stop")

    async def stream(self, prompt_ids: list[int], params: SamplingSpec):
        out = await self._enter(prompt_ids, params)
        for i, tid in enumerate(out):
            await asyncio.sleep(0)
            yield EngineChunk([tid], [-0.5], [3], "stop" if i == len(out) - 1 else None)


@contextlib.contextmanager
def serve(app) -> Iterator[str]:
    """A real uvicorn server for ``app`` on a free port, in a thread; its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive(), "uvicorn did not shut down"


def client(base: str, episode: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/s/{episode}/v1", api_key="x", **kw)


@pytest.fixture(scope="module")
def qwen_tok(llama_bpe_dir):
    return fresh_tokenizer(llama_bpe_dir, QWEN25_TEMPLATE, qwen_tokens=True)


@pytest.fixture(scope="module")
def im_end(qwen_tok) -> int:
    return qwen_tok.convert_tokens_to_ids("<|im_end|>")


def calculator(prompt: str) -> str:
    """Calls the tool until a tool response is in the context, then answers."""
    return "The answer is 42 ✓." if "<tool_response>" in prompt else CALL


def check_exact(ledger, engine: ScriptedEngine) -> None:
    """Each branch holds the engine's ids exactly, mask 1 exactly on them; each prompt extends the last."""
    [b] = ledger.branches()
    spans = [(t.start, t.end) for t in b.turns]
    assert [b.ids[s:e] for s, e in spans] == [out for _, out in engine.calls]
    assert [i for i, m in enumerate(b.mask) if m] == [i for s, e in spans for i in range(s, e)]
    for (p0, o0), (p1, _) in zip(engine.calls, engine.calls[1:], strict=False):
        assert p1[:len(p0) + len(o0)] == p0 + o0
    last_prompt, last_out = engine.calls[-1]
    assert b.ids == last_prompt + last_out
    assert ledger.counters["token_mismatch"] == 0


def test_sdk_tools_and_streaming_are_token_exact(qwen_tok, im_end) -> None:
    engine = ScriptedEngine(qwen_tok, im_end, calculator)
    registry = EpisodeRegistry(qwen_tok, stop_token_ids=[im_end])

    async def episode(base: str, name: str, stream: bool) -> tuple[str, object]:
        c = client(base, name)
        messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 12+30?"}]
        first = await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=0.7)
        message = first.choices[0].message
        assert first.id == f"chatcmpl-{name}-0" and first.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls
        assert call.id == f"call_{name}_0" and call.function.name == "calc"
        assert json.loads(call.function.arguments) == {"expression": "12+30"} and not message.content
        assert first.usage.completion_tokens == len(engine.calls[-1][1])
        assert first.usage.prompt_tokens == len(engine.calls[-1][0])
        messages += [message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        if not stream:
            second = await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            assert second.choices[0].finish_reason == "stop" and second.id == f"chatcmpl-{name}-1"
            return second.choices[0].message.content, second
        text, finish, ids = "", None, set()
        async for chunk in await c.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                           stream=True, stream_options={"include_usage": True}):
            ids.add(chunk.id)
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        assert finish == "stop" and ids == {f"chatcmpl-{name}-1"} and usage.completion_tokens > 0
        return text, None

    async def main(base: str) -> None:
        plain, _ = await episode(base, "ep1", stream=False)
        check_exact(registry.episodes["ep1"].ledger, engine)
        engine.calls.clear()
        streamed, _ = await episode(base, "ep2", stream=True)
        assert streamed == plain == "The answer is 42 ✓."
        check_exact(registry.episodes["ep2"].ledger, engine)

    with serve(build_app(registry, engine, "policy")) as base:
        asyncio.run(main(base))
    assert engine.params[0].temperature == 0.7
    b = registry.episodes["ep1"].ledger.branches()[0]
    assert set(b.versions[b.turns[0].start:]) == {3} and set(b.logprobs[b.turns[0].start:b.turns[0].end]) == {-0.5}


def test_streamed_text_comes_in_deltas_that_join_to_the_content(llama_bpe_dir) -> None:
    from async_rlhf.tokenizer import load_tokenizer, stop_token_ids

    tok = load_tokenizer(llama_bpe_dir)
    stops = stop_token_ids(llama_bpe_dir, tok)
    answer = "Sure: 12 + 30 = 42 ✓ (naïve check)."
    engine = ScriptedEngine(tok, stops[0], lambda _: answer)
    registry = EpisodeRegistry(tok, stop_token_ids=stops)

    async def main(base: str) -> None:
        messages = [{"role": "user", "content": "What is 12+30?"}]
        whole = await client(base, "a").chat.completions.create(model="m", messages=messages, max_tokens=64,
                                                                stop=["\n\n"], seed=5)
        deltas = [chunk.choices[0].delta.content
                  async for chunk in await client(base, "b").chat.completions.create(model="m", messages=messages,
                                                                                     stream=True)
                  if chunk.choices and chunk.choices[0].delta.content]
        assert "".join(deltas) == whole.choices[0].message.content == answer
        assert len(deltas) > 5, "streamed as the tokens come, not in one piece"
        assert all("\ufffd" not in d for d in deltas), "no partial UTF-8 character is sent"

    with serve(build_app(registry, engine, "m")) as base:
        asyncio.run(main(base))
    assert (engine.params[0].max_tokens, engine.params[0].stop, engine.params[0].seed) == (64, ("\n\n",), 5)


def test_retries_record_one_turn(qwen_tok, im_end) -> None:
    registry = EpisodeRegistry(qwen_tok, stop_token_ids=[im_end])
    engine = ScriptedEngine(qwen_tok, im_end, lambda _: "42", fail_first=1)
    messages = [{"role": "user", "content": "What is 12+30?"}]

    async def main(base: str) -> None:
        # the engine fails once: 500, the SDK retries, one turn
        r = await client(base, "fail").chat.completions.create(model="m", messages=messages)
        assert r.choices[0].message.content == "42"
        assert registry.episodes["fail"].ledger.counters["turns"] == 1 and len(engine.calls) == 1
        # the first attempt's response is lost (the client's read times out while the engine samples): the SDK
        # retries the same body (no idempotency header: x-stainless-retry-count), and gets the recorded turn
        engine.delay = 0.6
        r = await client(base, "slow", timeout=0.4, max_retries=2).chat.completions.create(model="m",
                                                                                          messages=messages)
        ledger = registry.episodes["slow"].ledger
        assert r.id == "chatcmpl-slow-0" and ledger.counters["turns"] == 1 and ledger.counters["retries"] == 1
        assert len(engine.calls) == 2
        # two requests with one Idempotency-Key, the second while the first samples: one engine call, one turn
        engine.delay = 0.3
        async with httpx.AsyncClient(base_url=f"{base}/s/keyed/v1") as http:
            def post():
                return http.post("/chat/completions", json={"model": "m", "messages": messages},
                                 headers={"Idempotency-Key": "k1"})
            a, b = await asyncio.gather(post(), post())
            c = await post()
        assert a.status_code == b.status_code == c.status_code == 200
        assert a.json()["id"] == b.json()["id"] == c.json()["id"] == "chatcmpl-keyed-0"
        ledger = registry.episodes["keyed"].ledger
        assert ledger.counters["turns"] == 1 and ledger.counters["retries"] == 2 and len(engine.calls) == 3
        # a client that goes away mid-stream does not cancel the generation: the turn is recorded
        async with httpx.AsyncClient(base_url=f"{base}/s/gone/v1") as http:
            async with http.stream("POST", "/chat/completions",
                                   json={"model": "m", "messages": messages, "stream": True}) as r:
                async for line in r.aiter_lines():
                    assert line.startswith("data: {")
                    break
        for _ in range(100):
            if "gone" in registry.episodes and registry.episodes["gone"].ledger.counters["turns"]:
                break
            await asyncio.sleep(0.02)
        assert registry.episodes["gone"].ledger.counters["turns"] == 1 and len(engine.calls) == 4
        # the same body sent again as a new call (not a retry) is a new turn
        engine.delay = 0.0
        again = client(base, "keyed")
        await again.chat.completions.create(model="m", messages=messages)
        await again.chat.completions.create(model="m", messages=messages)
        assert ledger.counters["turns"] == 3

    with serve(build_app(registry, engine, "m")) as base:
        asyncio.run(main(base))


def test_episode_deadline_ends_it_as_timeout(qwen_tok, im_end) -> None:
    now = [100.0]
    registry = EpisodeRegistry(qwen_tok, stop_token_ids=[im_end], timeout_s=10, clock=lambda: now[0])
    engine = ScriptedEngine(qwen_tok, im_end, lambda _: "42")
    messages = [{"role": "user", "content": "What is 12+30?"}]

    async def main(base: str) -> None:
        c = client(base, "ep")
        r = await c.chat.completions.create(model="m", messages=messages)
        now[0] += 11
        messages.extend([r.choices[0].message.model_dump(), {"role": "user", "content": "Sure?"}])
        with pytest.raises(openai.APIStatusError) as err:
            await c.chat.completions.create(model="m", messages=messages)
        assert err.value.status_code == 408 and err.value.response.headers["x-should-retry"] == "false"
        body = err.value.response.json()["error"]
        assert body["code"] == "episode_timeout" and "deadline" in body["message"]
        with pytest.raises(openai.APIStatusError):  # a stream is refused the same way, before any chunk
            await c.chat.completions.create(model="m", messages=messages, stream=True)

    with serve(build_app(registry, engine, "m")) as base:
        asyncio.run(main(base))
    ep = registry.episodes["ep"]
    assert ep.status == "timeout" and registry.counters["timeouts"] == 1
    assert ep.ledger.counters["turns"] == 1 and len(engine.calls) == 1


def test_bad_requests_get_openai_errors_and_the_server_goes_on(qwen_tok, im_end) -> None:
    registry = EpisodeRegistry(qwen_tok, stop_token_ids=[im_end])
    engine = ScriptedEngine(qwen_tok, im_end, lambda _: "42")
    ok = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}

    async def main(base: str) -> None:
        with pytest.raises(openai.BadRequestError) as err:
            await client(base, "e").chat.completions.create(model="m", messages=ok["messages"], n=2)
        assert "n=2 is not supported" in err.value.message and "n=1" in err.value.message
        async with httpx.AsyncClient(base_url=base) as http:
            def error(r: httpx.Response, status: int) -> dict:
                assert r.status_code == status, r.text
                return r.json()["error"]

            e = error(await http.post("/s/e/v1/chat/completions", content=b"{not json",
                                      headers={"content-type": "application/json"}), 400)
            assert e["code"] == "invalid_json" and "not valid JSON" in e["message"]
            e = error(await http.post("/s/e/v1/chat/completions", json={**ok, "tool_choice": "required"}), 400)
            assert '"auto"' in e["message"] and '"none"' in e["message"]
            e = error(await http.post("/s/e/v1/chat/completions", json={"model": "m", "messages": []}), 400)
            assert e["param"] == "messages"
            e = error(await http.post("/s/e/v1/chat/completions", json=[1, 2]), 400)
            e = error(await http.post("/s/e/v1/chat/completions", json={"messages": [{"content": "no role"}]}), 400)
            assert e["code"] == "invalid_messages" and "role" in e["message"]
            e = error(await http.post("/s/e/v1/chat/completions", json={**ok, "temperature": "hot"}), 400)
            assert e["param"] == "temperature"
            e = error(await http.post("/s/e/v1/completions", json={"model": "m", "prompt": "Hi"}), 404)
            assert "chat/completions" in e["message"]
            e = error(await http.get("/v1/models"), 404)
            assert "/s/<episode id>/v1" in e["message"]
            e = error(await http.get("/s/e/v1/chat/completions"), 405)
            models = (await http.get("/s/e/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m"]
        r = await client(base, "e").chat.completions.create(model="m", messages=ok["messages"])
        assert r.choices[0].message.content == "42" and registry.episodes["e"].ledger.counters["turns"] == 1
        assert [m.id async for m in client(base, "e").models.list()] == ["m"]

    with serve(build_app(registry, engine, "m")) as base:
        asyncio.run(main(base))


def test_episodes_run_concurrently_and_one_episodes_calls_in_turn(qwen_tok, im_end) -> None:
    registry = EpisodeRegistry(qwen_tok, stop_token_ids=[im_end])
    engine = ScriptedEngine(qwen_tok, im_end, lambda _: "42", delay=0.3)

    def ask(base: str, episode: str, question: str):
        return client(base, episode).chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}])

    async def main(base: str) -> None:
        await asyncio.gather(ask(base, "one", "What is 1+1?"), ask(base, "one", "What is 2+2?"))
        assert engine.max_active == 1, "calls of one episode are serialized"
        await asyncio.gather(ask(base, "x", "What is 1+1?"), ask(base, "y", "What is 1+1?"))
        assert engine.max_active == 2, "episodes run concurrently"

    with serve(build_app(registry, engine, "m")) as base:
        asyncio.run(main(base))
    ledger = registry.episodes["one"].ledger
    assert ledger.counters["turns"] == 2 and len(ledger.branches()) == 2 and ledger.counters["forks"] == 0
