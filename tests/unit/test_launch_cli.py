"""Bad input to the launcher fails fast: one clear line on stderr, exit code 2, nothing started."""

from __future__ import annotations

import json
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
    ],
)
def test_bad_input_fails_fast_with_one_line(tmp_path: Path, args: tuple[str, ...], expected: str) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train: [unclosed\n")
    fmt = {"classifier": str(_classifier_dir(tmp_path)), "bad_yaml": str(bad_yaml)}
    t0 = time.monotonic()
    proc = launch(*(a.format(**fmt) for a in args), cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert time.monotonic() - t0 < 30
    assert not (tmp_path / "runs").exists(), "a refused run must not start anything or write a run directory"
