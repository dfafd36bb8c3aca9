"""The line prebuild prints for vLLM's model info, derived in a child process beside the op build: the archs it
derived, no vLLM, or a warning naming the child's last error line (a first run then derives it)."""

from __future__ import annotations

import json

import pytest

from async_rlhf.prebuild import NO_VLLM, model_info_line

pytestmark = pytest.mark.unit


def test_the_derived_architectures_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/caches/vllm")
    line = model_info_line(0, "INFO noise\n" + json.dumps(["Qwen2ForCausalLM", "LlamaForCausalLM"]), "")
    assert line == "prebuild: vLLM model info of Qwen2ForCausalLM, LlamaForCausalLM in /caches/vllm"


def test_no_vllm_is_said_plainly() -> None:
    assert model_info_line(NO_VLLM, "", "") == "prebuild: vLLM is not installed; no model info derived"


def test_a_failing_child_is_a_warning_with_its_last_error_line() -> None:
    line = model_info_line(1, "", "Traceback ...\nKeyError: 'Qwen2ForCausalLM'\n")
    assert line.startswith("prebuild: warning: vLLM's model info not derived (KeyError: 'Qwen2ForCausalLM')")
    assert "the first run derives it" in line


def test_an_unknown_argument_is_refused_with_the_usage(capsys) -> None:
    from async_rlhf.prebuild import main

    assert main(["--tiny"]) == 2
    assert "usage: python -m async_rlhf.prebuild [--tiny-policy DIR]" in capsys.readouterr().err
