"""A real vLLM engine with the weight-sync worker extension, in a process of its own driven by commands: shared by
the weight-sync integration tests (CPU) and the GPU tests. vLLM binds threads and never lets go of its
process, so each engine lives in its own and answers on a queue:

    ("layout", wire)   -> ("layout", None)           every worker switches to a new bucket layout
    ("receive", r)     -> ("received", [per worker])  receive_update (r: refresh_lm_head; None: the default)
    ("score", seqs)    -> ("scores", log-probs)        prompt log-prob of every token after the first
    ("fetching", None) -> ("fetching", None)          start the fetch thread (a live generator's background receive)
    ("heal", member)   -> ("healed", None)            what a heal does to a live generator: init_receiver under a new
                                                      member id, then start_fetching (GeneratorActor.init_weight_sync)
    ("apply", None)    -> ("applied", [per worker])   apply_update: load the newest version the fetch thread staged
    ("quit", None)     -> ("bye", None)
first answer: ("epoch", [per worker]) once every worker joined the push group as gen0[.tp<r>].

The CPU tests start their engine processes from ``fork_context()``: forks of the session's fork server
(tests/fork_server.py), which imported vLLM, torch and transformers once; each builds its own ``vllm.LLM``.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from typing import Any

from async_rlhf.generator.worker_ext import WeightSyncWorker
from async_rlhf.sync.layout import layout_from_wire

HOST = "127.0.0.1"
BASE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


class StandingWorker(WeightSyncWorker):
    """The generator's worker extension plus what only tests ask of it: receive and load the next version
    standing still, and switch the bucket layout."""

    def receive_update(self, timeout_s: float | None = None, refresh_lm_head: bool = True) -> dict[str, Any]:
        """Receive and load the next pushed version (``sync/pause_s``: all of it, the engine stands still)."""
        t0 = time.perf_counter()
        self.start_fetching(timeout_s)
        got = self.apply_update(refresh_lm_head, timeout_s)
        return {**got, "sync/pause_s": time.perf_counter() - t0}

    def set_weight_layout(self, layout: list[dict[str, Any]]) -> None:
        """Change the bucket layout (the sender changes it at the same version boundary)."""
        self._get_receiver().use_layout(layout_from_wire(layout))


EXTENSION = f"{__name__}.StandingWorker"
"""``worker_extension_cls`` of the test engines (this module is importable where they run: tests/ is on the
path of the engine process, as of pytest's)."""


def engine_process(model_dir: str, port: int, layout: list, engine: dict[str, Any], cmds: Any, out: Any,
                   sync_backend: str = "gloo", timeout_s: float = 60.0, start_s: float = 240.0,
                   receiver_args: tuple = (), env: dict[str, str] | None = None) -> None:
    """The engine process's body (a process target): ``engine`` are ``vllm.LLM``'s keyword arguments."""
    os.environ.update({**BASE_ENV, **(env or {})})
    try:
        from vllm import LLM, SamplingParams

        from async_rlhf.generator.engine_args import apply_compile_stance

        apply_compile_stance(engine, on_gpu=False)  # as a CPU generator does
        llm = LLM(model=model_dir, seed=0, worker_extension_cls=EXTENSION,
                  **engine)
        llm.collective_rpc("init_receiver", args=(HOST, port, "gen0", layout, sync_backend, timeout_s,
                                                  *receiver_args))
        out.put(("epoch", llm.collective_rpc("join_push_group", args=(start_s,))))
        while True:
            cmd, arg = cmds.get(timeout=start_s)
            if cmd == "quit":
                break
            if cmd == "layout":
                llm.collective_rpc("set_weight_layout", args=(arg,))
                out.put(("layout", None))
            elif cmd == "receive":
                kwargs = {"timeout_s": timeout_s} if arg is None else {"timeout_s": timeout_s, "refresh_lm_head": arg}
                out.put(("received", llm.collective_rpc("receive_update", kwargs=kwargs)))
            elif cmd == "fetching":
                llm.collective_rpc("start_fetching", kwargs={"timeout_s": timeout_s})
                out.put(("fetching", None))
            elif cmd == "heal":
                llm.collective_rpc("init_receiver", args=(HOST, port, arg, layout, sync_backend, timeout_s,
                                                          *receiver_args))
                llm.collective_rpc("start_fetching", kwargs={"timeout_s": timeout_s})
                out.put(("healed", None))
            elif cmd == "apply":
                try:
                    out.put(("applied", llm.collective_rpc("apply_update", kwargs={"timeout_s": timeout_s})))
                except Exception as exc:  # the test says what failed; the engine stays up for the next command
                    out.put(("applied", f"{type(exc).__name__}: {exc}"))
            elif cmd == "score":
                params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
                outs = llm.generate([{"prompt_token_ids": s} for s in arg], params, use_tqdm=False)
                out.put(("scores", [[o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))]
                                    for o, s in zip(outs, arg)]))
        out.put(("bye", None))
    except Exception:
        out.put(("crash", traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def expect(out: Any, kind: str, timeout_s: float = 60.0) -> Any:
    """The engine's next answer, which must be ``kind`` (its failure raised with the engine's traceback)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got, payload = out.get(timeout=1.0)
        except queue.Empty:
            continue
        if got == "crash":
            raise AssertionError(f"the engine process failed:\n{payload}")
        assert got == kind, (got, payload)
        return payload
    raise AssertionError(f"the engine process never answered {kind!r}")


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
