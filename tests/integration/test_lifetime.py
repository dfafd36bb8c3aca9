"""A job's whole life (issue 44): one PPO job with a KL anchor, a Redis buffer, a Redis prompt stream and a reward
model, through what real jobs live through, on one password-protected redis-server.

    A  fresh, 2 generators (a Ray of its own): checkpoints every 2 steps; generator 0 is SIGKILLed (before, the
       reward model's actors died with the generator that created them, and every reward after failed); then the
       whole job is SIGKILLed past its last checkpoint
    B  --resume RUN_DIR --generators 1 (another fleet: what generator 1 drew and nobody trained goes back to the
       stream); while it runs, a second --resume of the directory is refused naming B's pid
    C  --resume RUN_DIR/checkpoints/step-N, an older checkpoint than the newest (a rollback)
    D  a new run, in another directory, on the same Redis prefix and stream (it must start clean)

Each launch but A joins the session's shared Ray (they finish by themselves). Asserted: the reference weights are
the original model's at every stage (``reference.json``, ``summary.json``'s ``reference_sha256``); the KL to the
reference is continuous across each resume (a reference reloaded from the checkpoint's policy gave ~0); along the
final lineage no prompt of the stream is trained twice and every prompt drawn is trained or still open (none
eaten); the new run trains none of the earlier run's groups and its learner versions start at 1; no file of either
run directory holds the Redis password.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import (
    LAUNCH,
    data_ledger,
    freeze_when,
    kill_session,
    learner_records,
    newest_checkpoint_step,
    past_last_checkpoint,
    session_pids,
    start_job,
    wait_until,
)

from async_rlhf.buffer.testing import RedisServer
from async_rlhf.driver.checkpoints import list_checkpoints, read_manifest
from async_rlhf.driver.control import send_control
from async_rlhf.driver.run_lock import holder
from async_rlhf.generator.stream import client_name, keys_of_group
from async_rlhf.prompts.redis_stream import drawn_key, push_prompts

pytestmark = pytest.mark.integration

PASSWORD = "lifetime-s3cret"
STREAM = "life:prompts"
EVERY = 2


def prompts(first: int, count: int) -> list[dict[str, Any]]:
    """Distinct prompts (``uid`` tells them apart wherever they travel: Redis records, requeued entries)."""
    return [{"prompt": f"{i % 90 + 10}+{i % 7 + 1}=", "answer": f"{i % 90 + 11 + i % 7:03d}", "uid": f"u{i}"}
            for i in range(first, first + count)]


def common(model: Path, reward_model: Path, url: str) -> list[str]:
    return ["--model", str(model), "--learners", "1", "train.algorithm=ppo", "train.ppo.generator_reward_weight=1",
            "train.objective.kl_coef=0.05", "train.batch_size=4", "train.group_size=4", "train.max_staleness=1",
            "generator.eval_every=0", "generator.groups_in_flight=4", "task.heldout_size=20", "run.log_every_s=5",
            f"run.checkpoint_every={EVERY}", "run.keep_checkpoints=4", "buffer.store=redis",
            f"buffer.redis_url={url}", "prompts.source=redis", f"prompts.redis_url={url}",
            f"prompts.stream={STREAM}", "rewards.sources=model", f"rewards.model_path={reward_model}"]


def secrets_env(ray_address: str | None) -> dict[str, str]:
    """A resume reads the run's config.json, which holds no password: it comes from the environment."""
    env = {**os.environ, "ASYNC_RLHF_BUFFER_REDIS_PASSWORD": PASSWORD,
           "ASYNC_RLHF_PROMPTS_REDIS_PASSWORD": PASSWORD}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return env


def reference_digest(model_dir: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from async_rlhf.learner.weights_digest import weights_sha256

    return weights_sha256(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def _stage_a(work: Path, run_dir: Path, args: list[str]) -> dict[str, Any]:
    log = work / "a.log"
    job = start_job(work, log.name, ["--generators", "2", "--run-dir", str(run_dir), "train.steps=100000", *args])
    try:
        wait_until(lambda: newest_checkpoint_step(run_dir) >= EVERY, "a first checkpoint", job, log)
        pids = send_control(run_dir, {"op": "pids"})
        assert pids["ok"] and set(pids["generators"]) == {"0", "1"}, pids
        killed_at = max(r["step"] for r in learner_records(run_dir))
        os.kill(pids["generators"]["0"], 9)
        # rewards go on: the run trains on, through two more checkpoints (with the reward model's actors gone with
        # generator 0, every reward failed and the run stopped)
        wait_until(lambda: newest_checkpoint_step(run_dir) >= killed_at + 2 * EVERY, "checkpoints after the kill",
                   job, log)
        restarted: dict[str, Any] = {}

        def generator_0_back() -> bool:  # a restarting actor is left out of the pids reply until it answers
            restarted.update(send_control(run_dir, {"op": "pids"})["generators"])
            return restarted.get("0") not in (None, pids["generators"]["0"])

        wait_until(generator_0_back, "generator 0 restarted", job, log, timeout_s=120)
        after = dict(restarted)
        freeze_when(job, lambda: past_last_checkpoint(run_dir), "a step past the last checkpoint", log)
    finally:
        kill_session(job.pid)
    job.wait(timeout=30)
    assert not session_pids(job.pid), "processes of the killed job survived"
    ckpt = list_checkpoints(run_dir)[-1]
    return {"log": log.read_text(), "killed_at": killed_at, "records": learner_records(run_dir), "ckpt": ckpt,
            "manifest": read_manifest(ckpt), "pids_before": pids["generators"], "pids_after": after}


def _stage_b(work: Path, run_dir: Path, steps: int, ray_address: str) -> dict[str, Any]:
    """--resume with one generator; a second --resume of the directory while it runs."""
    out = work / "b.log"
    job = subprocess.Popen([*LAUNCH, "--resume", str(run_dir), "--generators", "1", f"train.steps={steps}"],
                           cwd=work, stdout=out.open("w"), stderr=subprocess.STDOUT, env=secrets_env(ray_address))
    try:
        wait_until(lambda: holder(run_dir).get("pid") == job.pid, "the resumed driver's lock", job, out, 120)
        t0 = time.monotonic()
        second = subprocess.run([*LAUNCH, "--resume", str(run_dir), f"train.steps={steps + 10}"], cwd=work,
                                capture_output=True, text=True, timeout=120, env=secrets_env(ray_address))
        second_s = time.monotonic() - t0
        job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    return {"returncode": job.returncode, "log": out.read_text(), "second": second, "second_s": second_s,
            "pid": job.pid}


def _finish(work: Path, name: str, args: list[str], ray_address: str) -> subprocess.CompletedProcess:
    done = subprocess.run([*LAUNCH, *args], cwd=work, capture_output=True, text=True, timeout=600,
                          env=secrets_env(ray_address))
    (work / f"{name}.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


def _uids(url: str, run_id: str, keys: list[str]) -> list[str]:
    """The ``uid`` of the stream entry each prompt key (``gen:position``) was drawn as (its Redis record)."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        out = []
        for key in keys:
            gen, seq = key.split(":")
            raw = r.hget(drawn_key(STREAM, client_name(int(gen)), run_id), seq)
            assert raw is not None, f"prompt {key} has no Redis record"
            out.append(json.loads(json.loads(raw)["f"]["data"])["uid"])
        return out
    finally:
        r.close()


def _recorded(url: str, run_id: str) -> dict[str, str]:
    """Every position of the run's consumers with a Redis record not given back to the stream: key -> uid."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        out = {}
        for name in r.scan_iter(match=drawn_key(STREAM, "*", run_id)):
            gen = name.decode().rsplit("generator-", 1)[1]
            for field, raw in r.hgetall(name).items():
                if field == b"top":
                    continue
                rec = json.loads(raw)
                if not rec.get("requeued"):
                    out[f"{gen}:{field.decode()}"] = json.loads(rec["f"]["data"])["uid"]
        return out
    finally:
        r.close()


@pytest.fixture(scope="module")
def life(tiny_model_dir: Path, reward_model_dir: Path, ray_address: str,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lifetime")
    run_dir, new_dir = work / "run", work / "new_run"
    server = RedisServer(work / "redis", password=PASSWORD, fsync="everysec").start()
    try:
        push_prompts(server.url, STREAM, prompts(0, 400))
        args = common(tiny_model_dir, reward_model_dir, server.url)
        a = _stage_a(work, run_dir, args)
        run_id = json.loads((run_dir / "config.json").read_text())["run"]["id"]
        b_steps = a["manifest"]["step"] + 3 * EVERY
        b = _stage_b(work, run_dir, b_steps, ray_address)
        assert b["returncode"] == 0, b["log"][-3000:]
        b_summary = json.loads((run_dir / "summary.json").read_text())
        b_records = learner_records(run_dir)
        older = list_checkpoints(run_dir)[-3]  # two checkpoints back: the rollback's target
        c_steps = read_manifest(older)["step"] + 2 * EVERY
        c = _finish(work, "c", ["--resume", str(older), f"train.steps={c_steps}"], ray_address)
        final = list_checkpoints(run_dir)[-1]
        lineage = {"records": learner_records(run_dir), "ledger": data_ledger(run_dir),
                   "manifest": read_manifest(final), "checkpoints": [p.name for p in list_checkpoints(run_dir)],
                   "summary": json.loads((run_dir / "summary.json").read_text()),
                   "recorded": _recorded(server.url, run_id)}
        lineage["trained_uids"] = _uids(server.url, run_id, [k for x in lineage["ledger"] for k in x["prompt_keys"]])
        push_prompts(server.url, STREAM, prompts(400, 40))
        d = _finish(work, "d", ["--generators", "1", "--run-dir", str(new_dir), "train.steps=3", *args], ray_address)
        return {"server_url": server.url, "run_dir": run_dir, "new_dir": new_dir, "run_id": run_id, "a": a, "b": b,
                "b_summary": b_summary, "b_records": b_records, "older": older, "c": c, "c_steps": c_steps,
                "lineage": lineage, "d": d, "d_summary": json.loads((new_dir / "summary.json").read_text()),
                "d_records": learner_records(new_dir), "d_ledger": data_ledger(new_dir),
                "original": reference_digest(tiny_model_dir)}
    finally:
        server.stop()



def _kl_at(records: list[dict[str, Any]], step: int) -> float:
    return next(r["ppo/kl_ref"] for r in records if r["step"] == step)


def test_rewards_go_on_after_the_generator_that_created_the_reward_model_dies(life: dict[str, Any]) -> None:
    a = life["a"]
    assert a["pids_after"].get("0") not in (None, a["pids_before"]["0"]), "generator 0 was not restarted"
    after = [r for r in a["records"] if r["step"] > a["killed_at"] + EVERY]  # trained on scored groups
    assert after and all(r["rollout/samples"] > 0 for r in after)


def test_the_reference_is_the_original_model_at_every_stage(life: dict[str, Any]) -> None:
    original = life["original"]
    recorded = json.loads((life["run_dir"] / "reference.json").read_text())
    assert recorded["sha256"] == original
    assert life["b_summary"]["reference_sha256"] == original
    assert life["lineage"]["summary"]["reference_sha256"] == original
    assert life["d_summary"]["reference_sha256"] == original
    assert life["b_summary"]["resumed_from"] == str(life["a"]["ckpt"])
    assert life["lineage"]["summary"]["resumed_from"] == str(life["older"])
    assert life["d_summary"]["resumed_from"] is None


def test_kl_to_the_reference_is_continuous_across_each_resume(life: dict[str, Any]) -> None:
    """At the first step after a resume the policy is the checkpoint's: a reference reloaded from it gave a KL of
    ~0 there; anchored to the original model, the KL stays of the size it had."""
    a_step = life["a"]["manifest"]["step"]
    before, after = _kl_at(life["a"]["records"], a_step), _kl_at(life["b_records"], a_step + 1)
    assert before > 1e-6 and after > 0.25 * before, (before, after)
    c_from = read_manifest(life["older"])["step"]
    before, after = _kl_at(life["b_records"], c_from), _kl_at(life["lineage"]["records"], c_from + 1)
    assert before > 1e-6 and after > 0.25 * before, (before, after)


def test_a_second_driver_on_the_live_run_is_refused(life: dict[str, Any]) -> None:
    second = life["b"]["second"]
    assert second.returncode != 0 and life["b"]["second_s"] < 60
    errors = [line for line in (second.stdout + second.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"(pid {life['b']['pid']} " in errors[0], second.stdout + second.stderr


def test_the_smaller_fleet_gives_back_what_the_dropped_generator_drew(life: dict[str, Any]) -> None:
    log = life["b"]["log"]
    assert "resumed from" in log
    open_of_1 = life["a"]["manifest"]["data"].get("1", {}).get("pending", [])
    if open_of_1:
        assert "went back to the Redis stream" in log, log[-3000:]


def test_the_rollback_sets_the_newer_branch_aside(life: dict[str, Any]) -> None:
    lineage, older = life["lineage"], life["older"]
    assert "older than the run's newest" in life["c"].stdout and "nothing deleted" in life["c"].stdout
    aside = [p for p in (life["run_dir"] / "checkpoints").iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and aside[0].name.endswith(f"from-{older.name}") and any(aside[0].iterdir())
    assert lineage["checkpoints"][-1] == f"step-{life['c_steps']:06d}"
    assert [r["step"] for r in lineage["records"]] == list(range(1, life["c_steps"] + 1))


def test_the_ledger_is_exact_along_the_lineage(life: dict[str, Any]) -> None:
    """No prompt of the stream trained twice; every prompt drawn (recorded in Redis, not given back) is trained in
    the lineage or still open at its final checkpoint: none eaten."""
    lineage = life["lineage"]
    trained = lineage["trained_uids"]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert [x["step"] for x in lineage["ledger"]] == list(range(1, life["c_steps"] + 1))
    manifest = lineage["manifest"]
    open_keys = {f"{g}:{s}" for g, st in manifest["data"].items() for s in st["pending"]}
    open_keys |= {k for k in lineage["recorded"]
                  if int(k.split(":")[1]) > manifest["data"].get(k.split(":")[0], {}).get("position", 0)}
    used = {k for x in lineage["ledger"] for g in x["group_ids"] + x.get("skipped_ids", [])
            for k in keys_of_group(g)}
    eaten = {k: uid for k, uid in lineage["recorded"].items() if k not in used and k not in open_keys}
    assert not eaten, f"prompts drawn and never trained nor open: {sorted(eaten)[:10]}"


def test_a_new_run_on_the_same_redis_starts_clean(life: dict[str, Any]) -> None:
    records = life["d_records"]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert all(r["staleness/mean"] >= 0 for r in records)
    earlier = {g for x in life["lineage"]["ledger"] for g in x["group_ids"]}
    assert not earlier & {g for x in life["d_ledger"] for g in x["group_ids"]}
    new_id = json.loads((life["new_dir"] / "config.json").read_text())["run"]["id"]
    assert new_id and new_id != life["run_id"]


def test_no_file_of_the_runs_holds_the_password(life: dict[str, Any]) -> None:
    for root in (life["run_dir"], life["new_dir"]):
        config = (root / "config.json").read_text()
        assert "***" in config and PASSWORD not in config
        for path in root.rglob("*"):
            if path.is_file() and path.stat().st_size < 4 << 20 and path.suffix not in (".safetensors", ".pt"):
                assert PASSWORD.encode() not in path.read_bytes(), f"{path} holds the Redis password"
