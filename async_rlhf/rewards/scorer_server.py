"""A reference HTTP scorer (the protocol of ``async_rlhf.rewards.http``), with optional artificial delays and
dropped requests: the integration test and ``bench/delayed_rewards.py`` use it as a slow remote verifier.

    python -m async_rlhf.rewards.scorer_server --port 8000 --delay 2 --jitter 1 --drop 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from async_rlhf.env.arithmetic import leading_digits

ScoreFn = Callable[[str, str, dict[str, Any]], float]


def exact_answer(prompt: str, completion: str, data: dict[str, Any]) -> float:
    """The addition task's rule on the prompt's ``answer``."""
    return 1.0 if leading_digits(completion) == str(data.get("answer")) else 0.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many generators' requests arrive at once; the default backlog of 5 drops SYNs


class ScorerServer:
    """Threaded HTTP server on loopback; each request sleeps ``delay + U(0, jitter)`` s, and a share ``drop`` of
    requests is never answered (the connection is held until the client gives up)."""

    def __init__(self, fn: ScoreFn = exact_answer, delay_s: float = 0.0, jitter_s: float = 0.0,
                 drop: float = 0.0, port: int = 0, seed: int = 0) -> None:
        self.fn, self.delay_s, self.jitter_s, self.drop = fn, delay_s, jitter_s, drop
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.requests = 0
        self.connections = 0
        self.connections_closed = 0
        self.dropped = 0
        self._closing = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a client's connection serves request after request

            def setup(self) -> None:
                super().setup()
                with server.lock:
                    server.connections += 1

            def finish(self) -> None:
                super().finish()
                with server.lock:
                    server.connections_closed += 1

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with server.lock:
                    server.requests += 1
                    wait = server.delay_s + server.rng.uniform(0, server.jitter_s)
                    silent = server.rng.random() < server.drop
                    server.dropped += silent
                if silent:
                    server._closing.wait(600)
                    return
                time.sleep(wait)
                rewards = [server.fn(body["prompt"], c, body.get("data") or {}) for c in body["completions"]]
                out = json.dumps({"rewards": rewards}).encode()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = _Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    ap.add_argument("--jitter", type=float, default=0.0, help="extra uniform random delay, seconds")
    ap.add_argument("--drop", type=float, default=0.0, help="share of requests never answered")
    args = ap.parse_args()
    server = ScorerServer(delay_s=args.delay, jitter_s=args.jitter, drop=args.drop, port=args.port)
    print(f"scoring addition answers at {server.url}", flush=True)
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
