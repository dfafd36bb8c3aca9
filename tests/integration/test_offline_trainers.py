"""The classic offline pipeline on the tiny task, through the command-line entry points (real DeepSpeed, real vLLM):
task data -> SFT -> reward model -> DPO -> KTO -> batch inference scored by the task and by the reward model.

The pipeline runs once per module; each test checks one stage's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from async_rlhf.offline.common import METRICS_FILE, load_tokenizer
from async_rlhf.offline.data import encode_pairs, load_rows
from async_rlhf.offline.make_data import make_data

pytestmark = pytest.mark.integration
COMMON = ["--max-length", "16", "--threads", "1", "--log-every", "10"]


def _command(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"async_rlhf.offline.{module}", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cli(module: str, *args: str, timeout: float = 900) -> None:
    proc = subprocess.run(_command(module, *args), capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, f"{module} failed:\n{proc.stderr[-3000:]}"


def _cli_parallel(commands: dict[str, list[str]], timeout: float = 900) -> None:
    """Run independent CLIs side by side (one thread each); every one must succeed. A key names the module, or
    ``module:label`` for a module run more than once."""
    procs = {name: subprocess.Popen(_command(name.split(":")[0], *args), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, env=_env()) for name, args in commands.items()}
    errors = {}
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                errors[name] = err[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not errors, errors


def _metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("offline")
    data = make_data(root / "data", train=800, heldout=100)
    paths = {**data, "base": tiny_model_dir, "sft": root / "sft", "rm": root / "rm", "dpo": root / "dpo",
             "kto": root / "kto"}
    _cli("sft", "--data", str(data["sft"]), "--model", str(tiny_model_dir), "--out", str(paths["sft"]),
         "--steps", "60", "--lr", "3e-3", "--batch-size", "64", *COMMON)
    sft = str(paths["sft"])
    _cli_parallel({  # all three start from the SFT model
        "reward_model": ["--pairs", str(data["pairs"]), "--model", sft, "--out", str(paths["rm"]),
                         "--steps", "40", "--lr", "1e-3", "--batch-size", "32", *COMMON],
        "dpo": ["--data", str(data["pairs"]), "--model", sft, "--out", str(paths["dpo"]),
                "--steps", "20", "--lr", "5e-4", "--batch-size", "16", "--beta", "0.1", *COMMON],
        "kto": ["--data", str(data["kto"]), "--model", sft, "--out", str(paths["kto"]),
                "--steps", "20", "--lr", "5e-4", "--batch-size", "16", "--beta", "0.1", *COMMON],
    })
    return paths


def _heldout_pairs(paths: dict[str, Path], model_dir: Path, eos: bool) -> tuple[Any, list[Any]]:
    tok = load_tokenizer(model_dir)
    return tok, encode_pairs(tok, load_rows(paths["pairs_heldout"], "pairs"), 16, eos=eos)


def test_sft_loss_falls_and_output_is_a_causal_lm(pipeline: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    losses = [m["loss"] for m in _metrics(pipeline["sft"])]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:5]) / 5, losses
    model = AutoModelForCausalLM.from_pretrained(str(pipeline["sft"]))
    assert type(model).__name__.endswith("ForCausalLM")
    assert not list(pipeline["sft"].parent.glob(".sft-*"))  # the temporary directory was renamed away


def test_reward_model_ranks_heldout_pairs_above_chance(pipeline: dict[str, Path]) -> None:
    from transformers import AutoModelForSequenceClassification

    from async_rlhf.offline.scoring import reward_scores

    rm = AutoModelForSequenceClassification.from_pretrained(str(pipeline["rm"])).eval()
    assert rm.config.num_labels == 1
    tok, pairs = _heldout_pairs(pipeline, pipeline["rm"], eos=False)
    with torch.no_grad():
        chosen = reward_scores(rm, [c for c, _, _ in pairs], tok.pad_token_id)
        rejected = reward_scores(rm, [r for _, r, _ in pairs], tok.pad_token_id)
    accuracy = (chosen > rejected).float().mean().item()
    # 100 pairs: chance is 0.5 with a standard deviation of 0.05; 0.6 is two of them above it
    assert accuracy > 0.6, accuracy


def _heldout_margin(pipeline: dict[str, Path], policy_dir: Path) -> float:
    """Mean over held-out pairs of (log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected)."""
    from transformers import AutoModelForCausalLM

    from async_rlhf.offline.scoring import completion_logps

    tok, pairs = _heldout_pairs(pipeline, policy_dir, eos=True)
    seqs = [c for c, _, _ in pairs] + [r for _, r, _ in pairs]
    n = len(pairs)
    with torch.no_grad():
        policy = completion_logps(AutoModelForCausalLM.from_pretrained(str(policy_dir)).eval(), seqs,
                                  tok.pad_token_id)
        ref = completion_logps(AutoModelForCausalLM.from_pretrained(str(pipeline["sft"])).eval(), seqs,
                               tok.pad_token_id)
    ratio = policy - ref
    return (ratio[:n] - ratio[n:]).mean().item()


def test_dpo_raises_chosen_vs_rejected_margin(pipeline: dict[str, Path]) -> None:
    history = _metrics(pipeline["dpo"])
    assert history[0]["reward/margin"] == pytest.approx(0.0, abs=1e-4)  # step 1: policy == reference
    assert _heldout_margin(pipeline, pipeline["dpo"]) > 0.2  # seen: ~3.4


def test_kto_separates_desirable_from_undesirable(pipeline: dict[str, Path]) -> None:
    history = _metrics(pipeline["kto"])
    first = history[0]  # step 1: policy == reference, so every implicit reward is 0
    assert first["reward/desirable"] == pytest.approx(0.0, abs=1e-4)
    assert first["reward/undesirable"] == pytest.approx(0.0, abs=1e-4)
    # per-step batch metrics are noisy (16 examples); the held-out pairs measure the effect (seen: ~1.9)
    assert _heldout_margin(pipeline, pipeline["kto"]) > 0.2


def test_batch_inference_writes_completions_and_rewards(pipeline: dict[str, Path]) -> None:
    from async_rlhf.env.arithmetic import AdditionTask, score_completion

    out_task = pipeline["sft"].parent / "completions_task.jsonl"
    out_rm = pipeline["sft"].parent / "completions_rm.jsonl"
    common = ["--model", str(pipeline["sft"]), "--prompts", str(pipeline["prompts"]), "--max-new-tokens", "5"]
    _cli_parallel({  # independent: each its own engine, side by side
        "infer:task": [*common, "--out", str(out_task), "--n", "2", "--temperature", "1", "--reward", "addition"],
        "infer:rm": [*common, "--out", str(out_rm), "--n", "1", "--temperature", "0",
                     "--reward-model", str(pipeline["rm"])],
    })
    rows = [json.loads(line) for line in out_task.read_text().splitlines()]
    prompts = load_rows(pipeline["prompts"], "prompts")
    assert len(rows) == 2 * len(prompts)
    task = AdditionTask(heldout_size=0)
    for row in rows:
        a, b = row["prompt"][:-1].split("+")
        assert row["reward"] == score_completion(task.make(int(a), int(b)), row["completion"])
        assert row["answer"] == task.make(int(a), int(b)).answer  # the prompt row's columns are carried
    assert {row["sample"] for row in rows} == {0, 1}
    assert sum(row["completion"][:3].isdigit() for row in rows) > 0.8 * len(rows)

    scored = [json.loads(line) for line in out_rm.read_text().splitlines()]
    assert len(scored) == len(prompts)
    assert all(isinstance(r["reward"], float) for r in scored) and len({r["reward"] for r in scored}) > 1
