"""A user's own task end to end, through the real launcher: custom prompts, a held-out file scored by the
user's reward function (which asks for the token ids and finish reason), and a run stopped with SIGINT.

One job: the tiny model on ``task.name=custom`` with ``prompts.eval_path``; SIGINT to its process group (as
Ctrl-C in a terminal) once a few steps and two held-out evaluations are in. The launcher must end by itself
(exit 0) with a final checkpoint at the last step trained, a summary.json with the real step count and the
user's held-out figures (and no built-in accuracy), the eval records in metrics.jsonl, and a log that names
the checkpoints it deleted. The job joins the session's shared Ray (``RAY_ADDRESS``): the SIGINT reaches its
driver, which stops the run's actors itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from jobs import LAUNCH, foreign_lines, kill_session, learner_records, start_job, wait_until

from async_rlhf.driver.checkpoints import list_checkpoints, read_manifest

pytestmark = pytest.mark.integration

REWARD = '''
def score(prompt, completion, data, *, completion_ids, finish_reason):
    """Graded (not 0/1): a tenth per generated token, a half for ending with the stop token."""
    return 0.1 * len(completion_ids) + (0.5 if finish_reason == "stop" else 0.0)
'''


def _eval_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("kind") == "eval":
            out.append(rec)
    return out


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, ray_address: str) -> dict:
    work = tmp_path_factory.mktemp("user_task")
    pairs = [(a, b) for a in range(0, 100, 7) for b in range(0, 100, 11)]
    (work / "train.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}) + "\n" for a, b in pairs[:60]))
    (work / "eval.jsonl").write_text("".join(
        json.dumps({"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"}) + "\n" for a, b in pairs[60:72]))
    (work / "reward.py").write_text(REWARD)
    run_dir = work / "run"
    overrides = ["task.name=custom", "prompts.source=file", f"prompts.path={work / 'train.jsonl'}",
                 f"prompts.eval_path={work / 'eval.jsonl'}", "rewards.sources=function",
                 f"rewards.function={work / 'reward.py'}:score", "generator.eval_every=2",
                 "generator.max_new_tokens=4", "train.batch_size=4", "train.group_size=4",
                 "train.max_staleness=1", "generator.groups_in_flight=4", "run.checkpoint_every=2",
                 "run.keep_checkpoints=1", "run.log_every_s=1"]
    args = ["--generators", "1", "--learners", "1", "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
            "train.steps=100000", *overrides]
    log = work / "job.log"
    t_launch = time.time()
    job = start_job(work, log.name, args, ray_address)
    try:
        wait_until(lambda: len(learner_records(run_dir)) >= 5 and len(_eval_records(run_dir)) >= 2
                   and len(list_checkpoints(run_dir)) >= 1, "5 steps, 2 evaluations and a checkpoint", job, log,
                   timeout_s=400)
        os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C does: the launcher's whole process group
        code = job.wait(timeout=300)
    finally:
        kill_session(job.pid)
    again = subprocess.run([*LAUNCH, *args], cwd=work, capture_output=True, text=True, timeout=120)
    first_step_s = learner_records(run_dir)[0]["time"] - t_launch
    return {"work": work, "run_dir": run_dir, "code": code, "first_step_s": first_step_s, "log": log.read_text(),
            "overrides": overrides,
            "again": again, "model": tiny_model_dir}


def test_sigint_ends_the_run_with_a_checkpoint_and_the_steps_done(stopped_run: dict) -> None:
    log, run_dir = stopped_run["log"], stopped_run["run_dir"]
    assert stopped_run["code"] == 0, log[-3000:]
    assert "SIGINT: stopping after the learners' current step" in log
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [r["step"] for r in learner_records(run_dir)]
    assert steps == list(range(1, len(steps) + 1))
    assert summary["steps"] == steps[-1] < summary["steps_configured"] == 100000
    assert "SIGINT" in summary["stop_reason"]
    ckpts = list_checkpoints(run_dir)
    assert len(ckpts) == 1, "run.keep_checkpoints=1"
    assert read_manifest(ckpts[-1])["step"] == steps[-1], "the final checkpoint is at the last step trained"
    assert "(run.keep_checkpoints=1 keeps the newest)" in log and "deleted step-" in log
    assert (run_dir / "policy" / "config.json").is_file()
    print(f"first step {stopped_run['first_step_s']:.0f} s after the launch; SIGINT at step >= 5, stopped after "
          f"step {summary['steps']} ({summary['stop_reason']})")


def test_the_console_shows_only_the_launchers_lines(stopped_run: dict) -> None:
    """What the roles and their libraries print (vLLM, DeepSpeed, Ray, warnings) is in run.dir/logs, one file per
    role, named by the console's first line; the console holds only the launcher's own lines."""
    log, logs = stopped_run["log"], stopped_run["run_dir"] / "logs"
    assert log.splitlines()[0].startswith(f"logs: {logs} "), log[:500]
    assert foreign_lines(log) == [], log[-3000:]
    for name in ("buffer", "generator-0", "learner-0"):  # each opened by its role's process
        assert (logs / f"{name}.log").read_text().startswith("== "), sorted(p.name for p in logs.iterdir())
    assert (logs / "driver.log").is_file()
    assert "built successfully" not in (logs / "learner-0.log").read_text(), "the op was loaded, not built"


def test_the_held_out_figure_is_the_users_eval_set(stopped_run: dict) -> None:
    from async_rlhf.config import load_config
    from async_rlhf.evaluation import eval_figures

    log, run_dir = stopped_run["log"], stopped_run["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "accuracy_start" not in summary and "accuracy_end" not in summary, "no built-in task's figure"
    assert "held-out greedy accuracy" not in log and "held-out acc" not in log
    # graded rewards: a mean, no accuracy
    assert {"eval_reward_start", "eval_reward_end"} <= set(summary)
    assert "eval_accuracy_start" not in summary
    # exactly the figure of the user's file under the user's function, recomputed here from the directories
    cfg = load_config(None, stopped_run["overrides"])
    assert summary["eval_reward_start"] == pytest.approx(eval_figures(str(stopped_run["model"]), cfg)["reward_mean"])
    assert summary["eval_reward_end"] == pytest.approx(eval_figures(summary["policy_dir"], cfg)["reward_mean"])
    assert 0.1 <= summary["eval_reward_end"] <= 0.9  # 1-4 tokens, maybe a stop: the function saw ids and reason
    evals = _eval_records(run_dir)
    assert [e["version"] for e in evals[:2]] == [0, 2]
    assert all("eval/reward_mean" in e and "eval/accuracy" not in e for e in evals)
    assert "eval reward " in log, "the progress line shows the user's figure"
    print(f"eval reward {summary['eval_reward_start']:.3f} -> {summary['eval_reward_end']:.3f} in "
          f"{summary['steps']} steps; generator evals {[round(e['eval/reward_mean'], 3) for e in evals]}")


def test_the_used_run_directory_is_refused_with_one_line(stopped_run: dict) -> None:
    again = stopped_run["again"]
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "holds a previous run" in lines[0], again.stderr
