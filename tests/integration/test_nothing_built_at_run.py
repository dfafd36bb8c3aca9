"""Nothing is compiled at run time: after the set-up's build step (the line of scripts/setup_env.sh that runs
``async_rlhf.prebuild``), a 1-learner job started with every build cache pointed at those fresh directories
writes nothing there: DeepSpeed's shm_comm op is loaded, not built, vLLM derives no model info, and torch.compile
builds no kernel (vLLM's sampler compiled one with inductor into /tmp at the first request for log-probs until the
generator forced it eager: ``engine_args.eager_compile_stance``; this test did not look there before).

A first run used to JIT-build the op inside learner rank 0's start-up (4 min beside starting vLLM engines on
2 cores) and missed the rendezvous deadline; CI never saw it because the op stayed in the home directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import LAUNCH, ROOT

pytestmark = pytest.mark.integration

CACHES = ("TORCH_EXTENSIONS_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR",
          "XDG_CACHE_HOME")
"""Every directory a first run could build into (XDG_CACHE_HOME: anything else under ~/.cache;
TORCHINDUCTOR_CACHE_DIR: what torch.compile builds, under /tmp by default)."""


def setup_build_step() -> list[str]:
    """The build step of ``make setup``, as scripts/setup_env.sh runs it (with this interpreter)."""
    script = (ROOT / "scripts" / "setup_env.sh").read_text()
    lines = [line for line in script.splitlines() if re.search(r"-m async_rlhf\.prebuild\b", line)
             and not line.lstrip().startswith("#")]
    assert lines, "scripts/setup_env.sh has no build step (python -m async_rlhf.prebuild)"
    words = shlex.split(lines[0])
    return [sys.executable, *words[words.index("-m"):]]


def files_under(dirs: list[Path]) -> dict[str, int]:
    """Every file and directory under ``dirs``, files with their modification time (ns). A directory's own time
    is left out: torch takes a lock file in an extension's directory even to load it."""
    return {str(p): 0 if p.is_dir() else p.stat().st_mtime_ns for d in dirs for p in d.rglob("*")}


def test_a_run_after_setup_builds_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    caches = {name: tmp_path / "caches" / name.lower() for name in CACHES}
    for d in caches.values():
        d.mkdir(parents=True)
    env = {**os.environ, **{k: str(v) for k, v in caches.items()}}
    step = subprocess.run(setup_build_step(), env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert step.returncode == 0, step.stdout + step.stderr
    op_lib = caches["TORCH_EXTENSIONS_DIR"] / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
    assert op_lib.is_file(), f"the build step did not build the op:\n{step.stdout}"
    before = files_under(list(caches.values()))

    run_dir = tmp_path / "run"
    job = subprocess.run(
        [*LAUNCH, "--generators", "1", "--learners", "1", "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
         "train.steps=2", "train.batch_size=4", "train.group_size=4", "generator.eval_every=0",
         "generator.groups_in_flight=4", "task.heldout_size=10"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    log = job.stdout + job.stderr
    (tmp_path / "job.log").write_text(log)
    assert job.returncode == 0, log[-3000:]

    after = files_under(list(caches.values()))
    new = sorted(set(after) - set(before))
    changed = sorted(p for p in before if p in after and after[p] != before[p])
    assert not new and not changed, f"the run built or rewrote: new {new}, changed {changed}"
    summary = json.loads((run_dir / "summary.json").read_text())
    phases = summary["startup_s_by_phase"]["learners"]
    assert "op build" not in phases and "op load" in phases, phases
    assert "building op" not in log and "start-up" in log, log[-3000:]
    print(f"start-up {summary['startup_s']:.1f} s by phase {summary['startup_s_by_phase']}")
