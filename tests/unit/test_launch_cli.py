"""Bad input to the launcher fails fast: one clear line on stderr, exit code 2, nothing started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "launch" / "cluster.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def _classifier_dir(tmp_path: Path) -> Path:
    d = tmp_path / "classifier"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    return d


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--model", "/nonexistent/model"), "no such directory"),
        (("--model", "{classifier}"), "not a causal language model"),
        (("--generators", "0"), "generators must be at least 1"),
        (("--learners", "-2"), "learners must be at least 1"),
        (("train.no_such_key=3",), "unknown config key 'train.no_such_key'"),
        (("--config", "/nonexistent/run.yaml"), "cannot read config file"),
        (("--config", "{bad_yaml}"), "not valid YAML"),
        (("train.steps=many",), "wants an integer"),
        (("--address", "127.0.0.1:1"), "--address 127.0.0.1:1 is unreachable"),
        (("--resume", "{not_ckpt}"), "is not a checkpoint"),
        (("--resume", "/nonexistent/run"), "no such directory"),
        (("resources.generator_gpus=1",), "more resources than the cluster has (GPU: the plan needs 2"),
        (("run.num_cpus=2", "--generators", "3"), "CPU: the plan needs 4, this machine has 2"),
        (("--generators", "500", "--learners", "2"), "500 generator(s) and 2 learner rank(s) need about 154.3 GB"),
        (("scale", "--run-dir", "{not_ckpt}", "--generators", "2"), "no run with a control endpoint"),
        (("scale", "--run-dir", "{not_ckpt}", "--generators", "0"), "--generators must be at least 1"),
        (("prompts.chat_template=true",), "prompts.chat_template=true but the tokenizer of the tiny model has no chat"),
        (("prompts.eval_path={chat_eval}",), "chat.jsonl record 0: a prompt is a list of chat messages but the "
                                             "tokenizer of the tiny model has no chat template: add one"),
    ],
)
def test_bad_input_fails_fast_with_one_line(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train: [unclosed\n")
    not_ckpt = tmp_path / "not_a_checkpoint"
    not_ckpt.mkdir()
    chat_eval = tmp_path / "chat.jsonl"
    chat_eval.write_text(json.dumps({"prompt": [{"role": "user", "content": "12+30="}]}) + "\n")
    fmt = {"classifier": str(_classifier_dir(tmp_path)), "bad_yaml": str(bad_yaml), "not_ckpt": str(not_ckpt),
           "chat_eval": str(chat_eval)}
    t0 = time.monotonic()
    proc = launch(*(a.format(**fmt) for a in args), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "runs").exists(), "a refused run must not start anything or write a run directory"


def test_dry_run_prints_the_plan_for_16_and_16_without_starting_anything(tmp_path: Path) -> None:
    proc = launch("--dry-run", "--generators", "16", "--learners", "16", "resources.generator_cpus=2",
                  "resources.learner_cpus=3", "resources.buffer_cpus=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout.split("plan (JSON): ", 1)[1])
    counts = {r["role"]: r["count"] for r in plan["roles"]}
    assert counts == {"generators": 16, "learners": 16, "buffer": 1}
    assert plan["totals"] == {"CPU": 16 * 2 + 16 * 3 + 1, "GPU": 0}
    assert sum(r["totals"]["CPU"] for r in plan["roles"]) == plan["totals"]["CPU"]
    total_row = next(line for line in proc.stdout.splitlines() if line.startswith("total")).split()
    assert total_row[1:] == ["33", "81", "0"]
    assert plan["memory"]["total_gb"] == pytest.approx(16 * (0.27 + 0.0347) + 16 * 0.15 + 1.6, abs=0.01)
    assert "fits this machine's memory" in proc.stdout
    # Ray here gets the logical CPUs the plan needs (81 + room for 4 generators of 2): not a refusal on 2 cores
    fit = next(line for line in proc.stdout.splitlines() if line.startswith("fits this machine's Ray"))
    assert fit.startswith("fits this machine's Ray (89 CPU, ") and fit.endswith(": yes"), fit
    assert f"32 roles on {os.cpu_count()} cores" in proc.stdout
    assert not (tmp_path / "runs").exists(), "a dry run must not write a run directory"


def test_resume_refuses_steps_already_done(tmp_path: Path) -> None:
    ckpt = tmp_path / "run" / "checkpoints" / "step-000005"
    for part in ("deepspeed", "policy"):
        (ckpt / part).mkdir(parents=True)
    (ckpt / "checkpoint.json").write_text(json.dumps({"format": 1, "step": 5, "version": 5, "data": {}}))
    proc = launch("--resume", str(tmp_path / "run"), "train.steps=5", cwd=tmp_path)
    assert proc.returncode == 2
    assert "checkpoint is at step 5 and train.steps is 5; raise train.steps" in proc.stderr


def test_stop_without_a_running_job_fails_with_one_line(tmp_path: Path) -> None:
    proc = launch("stop", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'control.json'} not found: no run with a "
                                                f"control endpoint is active in {tmp_path}"]


def test_a_run_directory_in_use_is_refused_unless_resumed_or_overwritten(tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = launch("--run-dir", str(old), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "holds a previous run" in lines[0], proc.stderr
    assert "--resume" in lines[0] and "run.overwrite=true" in lines[0]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    proc = launch("--run-dir", str(other), "run.overwrite=true", cwd=tmp_path)
    assert proc.returncode == 2 and "holds no previous run" in proc.stderr, proc.stderr
    # overwrite passes validation (the dry run deletes nothing: the run itself clears the directory)
    proc = launch("--dry-run", "--run-dir", str(old), "run.overwrite=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (old / "metrics.jsonl").is_file() and (other / "notes.txt").is_file()
