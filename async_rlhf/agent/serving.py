"""One generator's agent side: the endpoint served on a thread of its own, and the user's agent episodes on another.

    generator process
    ├── loop thread          vLLM engine steps; GroupRunner's event loop: AgentEnv.rollout_group per admitted group
    ├── "agent-endpoint"     uvicorn + FastAPI (endpoint.py) on its own event loop; the EpisodeRegistry lives here;
    │                        engine calls go to the loop thread (PolicyEngine)
    └── "agent-episodes"     the user's ``async def run(task, client)`` coroutines on their own event loop, at most
                             agent.episodes_per_generator at once; ``client``: a stock openai.AsyncOpenAI whose base
                             URL is http://<this node>:<port>/s/<episode id>/v1

Why three threads: an agent that blocks (a synchronous tool, a slow sandbox) stalls only other episodes' agent code,
never the engine; the endpoint keeps answering calls while agents think. Every call of an episode reaches the
generator that started it (the URL names this generator's own port): its prefix cache holds the history. When the
generator dies its episodes die with it (they run in its process); their group was never put, so the driver's
prompt ledger issues the prompt again on the generators left: the episode starts over, nothing half-trained.

Everything that touches the registry runs on the endpoint's loop (``on_endpoint``), as the registry is not
thread-safe; the generator's loop waits on the returned futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from async_rlhf.agent.episodes import Episode, EpisodeRegistry

log = logging.getLogger(__name__)

AgentFn = Callable[[dict[str, Any], Any], Awaitable[Any]]


def load_agent(spec: str) -> AgentFn:
    """``agent.entry`` -> the user's ``async def run(task, client)``; ValueError naming what is wrong."""
    from async_rlhf.rewards.base import load_callable

    fn = load_callable(spec, "agent.entry")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent.entry={spec!r} must be a coroutine function: `async def run(task, client)` returning "
                         "the episode's reward (a number) or {'reward': r, 'turn_rewards': [...]}")
    return fn


class _LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)


class AgentServer:
    """The endpoint and the agent episodes of one generator (see the module docstring)."""

    def __init__(self, registry: EpisodeRegistry, engine: Any, model_name: str, agent: AgentFn, host: str,
                 max_episodes: int, request_timeout_s: float) -> None:
        import uvicorn

        from async_rlhf.agent.endpoint import build_app

        self.registry = registry
        self.engine = engine
        self.agent = agent
        self.host = host
        self._timeout_s = request_timeout_s
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))  # our own socket: the port is known before the server runs, no race for a free one
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(build_app(registry, engine, model_name), log_level="warning", access_log=False,
                                lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._endpoint = _LoopThread("agent-endpoint")
        self._serving = self._endpoint.submit(self._server.serve(sockets=[sock]))
        self._episodes = _LoopThread("agent-episodes")
        self._limit = asyncio.Semaphore(max(1, max_episodes))  # used on the episodes' loop only
        self._idle_http: list[Any] = []
        """One HTTP connection pool per running episode, reused by the next: a single pool shared by tens of
        concurrent episodes spent a third of the agents' CPU in httpcore assigning requests to connections
        (its cost grows with requests x connections)."""
        self._all_http: list[Any] = []

    def url(self, episode_id: str) -> str:
        return f"http://{self.host}:{self.port}/s/{episode_id}/v1"

    def on_endpoint(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on the endpoint's loop (where the registry lives)."""
        async def call() -> Any:
            result = fn()
            return await result if inspect.isawaitable(result) else result
        return self._endpoint.submit(call())

    def open(self, episode_id: str) -> concurrent.futures.Future[Any]:
        return self.on_endpoint(lambda: self.registry.open(episode_id))

    def close(self, episode_id: str, wait_s: float = 5.0) -> concurrent.futures.Future[tuple[Episode, bool]]:
        """End the episode once its calls in flight are recorded (at most ``wait_s``): (it, whether it had timed
        out). The registry forgets it (later calls get 404); the caller takes its ledger."""
        async def close() -> tuple[Episode, bool]:
            ep = self.registry.episodes[episode_id]
            if ep.inflight:
                await asyncio.wait(list(ep.inflight.values()), timeout=wait_s)
            timed_out = ep.status == "timeout"
            self.registry.close(episode_id)
            del self.registry.episodes[episode_id]
            return ep, timed_out
        return self.on_endpoint(close)

    def run_agent(self, task: dict[str, Any], episode_id: str) -> concurrent.futures.Future[Any]:
        """The user's agent on this episode: the future of what it returned (or raised)."""
        return self._episodes.submit(self._run_agent(task, episode_id))

    async def _run_agent(self, task: dict[str, Any], episode_id: str) -> Any:
        import httpx
        import openai

        async with self._limit:
            if self._idle_http:
                http = self._idle_http.pop()
            else:
                http = httpx.AsyncClient(trust_env=False, timeout=self._timeout_s)
                self._all_http.append(http)
            try:
                client = openai.AsyncOpenAI(base_url=self.url(episode_id), api_key="async-rlhf", max_retries=2,
                                            timeout=self._timeout_s, http_client=http)
                return await self.agent(task, client)
            finally:
                self._idle_http.append(http)

    def stop(self) -> None:
        self._server.should_exit = True
        try:
            self._serving.result(timeout=5.0)
        except Exception:  # noqa: BLE001 - stopping: a server that did not end in time is left to the process exit
            log.debug("agent endpoint did not stop in time", exc_info=True)
        pools, self._all_http, self._idle_http = self._all_http, [], []
        if pools:
            async def close_all() -> None:
                await asyncio.gather(*(http.aclose() for http in pools), return_exceptions=True)
            try:
                self._episodes.submit(close_all()).result(timeout=5.0)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                log.debug("closing the agents' connection pools failed", exc_info=True)
        self._endpoint.stop()
        self._episodes.stop()
