"""Kill the whole job while its Redis buffer holds groups, then ``--resume`` it on the same Redis.

    run (buffer.store=redis on a real redis-server) commits a checkpoint; SIGKILL the job right then (its
        learner may have trained a step further), while the buffer holds groups of the checkpoint's weights
    read Redis: the groups it held, had delivered or awaited a reward for at the kill
    --resume: the buffer restores the checkpoint's admission state (restore_admission), keeps the held groups
        made by weights up to the checkpoint and drops, with a reason, those made by rolled-back weights
    every group held at the kill was trained after the resume or dropped with a reason; no prompt twice
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jobs import (
    check_metrics_continue,
    check_prompts_once,
    data_ledger,
    freeze_when,
    job_args,
    kill_session,
    newest_checkpoint_step,
    resume_newest,
    session_pids,
    start_job,
    wait_until,
)

from async_rlhf.buffer.redis_store import RedisStore
from async_rlhf.buffer.run_scope import run_prefix
from async_rlhf.buffer.testing import RedisServer
from async_rlhf.driver.checkpoints import list_checkpoints, read_manifest

pytestmark = [pytest.mark.integration, pytest.mark.isolated]

# a checkpoint every step: the kill waits for a moment when the buffer's version is the newest checkpoint's, and
# with the buffer stopped the learner blocks on its next request right after saving the checkpoint of the
# version it last gave the buffer, so that moment comes at the first try (with a checkpoint every 4 steps it came
# when the learner happened to stop on a multiple of 4: about one try in four, each 16 s)
EVERY = 1
KILL_AFTER = 4  # the first run trains at least this many steps (as when EVERY was 4) before the kill
MORE_STEPS = 6
PREFIX = "async_rlhf:buffer"


def buffer_at_last_checkpoint(run_dir: Path, url: str) -> bool:
    """The buffer's version (in Redis) is the newest checkpoint's: the learner has published no newer weights,
    so the groups held now were made by weights the resume keeps (read with the whole job frozen)."""
    import redis

    client = redis.Redis.from_url(url)
    prefix = run_prefix(run_dir, PREFIX)  # the run's own keys (issue 44, defect 4)
    try:
        version = client.hget(f"{prefix}:meta", "version")
        held = client.hlen(f"{prefix}:ids")
    finally:
        client.close()
    ckpts = list_checkpoints(run_dir)
    return (version is not None and bool(ckpts) and held > 0
            and int(version) == read_manifest(ckpts[-1])["version"])


def redis_state(url: str, run_dir: Path) -> dict[str, Any]:
    """What the run's buffer keeps in Redis, read with the store the service itself recovers with."""
    store = RedisStore(url, run_prefix(run_dir, PREFIX))
    try:
        return {"held": {g.group_id for g in store.held()}, "delivered": set(store.delivered()),
                "awaiting": set(store.awaiting()), "trained": set(store.trained()), "dropped": store.dropped(),
                "meta": dict(store.meta())}
    finally:
        store.close()


@pytest.fixture(scope="module")
def redis_resumed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("resume_redis")
    run_dir = work / "run"
    log = work / "first.log"
    server = RedisServer(work / "redis", fsync="everysec").start()
    try:
        first = start_job(work, log.name, job_args(
            tiny_model_dir, run_dir, EVERY, "buffer.store=redis", f"buffer.redis_url={server.url}",
            f"buffer.redis_prefix={PREFIX}", max_staleness=2))
        try:
            wait_until(lambda: newest_checkpoint_step(run_dir) >= KILL_AFTER, f"a checkpoint at step {KILL_AFTER}",
                       first, log)
            # kill right after a checkpoint, while the buffer holds groups made by the checkpoint's weights
            # (the whole job is frozen while that is checked: the learner runs ahead of the driver's metrics;
            # the buffer is stopped first so that the learner waits while the driver commits what it saved)
            freeze_when(first, lambda: buffer_at_last_checkpoint(run_dir, server.url),
                        "a moment right after a checkpoint", log, every_s=0.1, whole_job=True, starve_s=8.0)
        finally:
            kill_session(first.pid)
        first.wait(timeout=30)
        assert not session_pids(first.pid), "processes of the killed job survived"
        at_kill = redis_state(server.url, run_dir)
        resumed = resume_newest(work, run_dir, MORE_STEPS)
        after = redis_state(server.url, run_dir)
    finally:
        server.stop()
    return {**resumed, "at_kill": at_kill, "after": after}


def test_resume_on_redis_continues_the_run(redis_resumed: dict[str, Any]) -> None:
    second = redis_resumed["second"]
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {redis_resumed['ckpt']}" in second.stdout
    assert redis_resumed["at_kill"]["meta"]["version"] >= redis_resumed["manifest"]["version"]
    args = redis_resumed["run_dir"], redis_resumed["manifest"], redis_resumed["steps"]
    check_metrics_continue(*args, redis_resumed["before"])


def test_groups_held_in_redis_at_the_kill_are_trained_or_dropped_with_a_reason(redis_resumed: dict[str, Any]) -> None:
    at_kill, after = redis_resumed["at_kill"], redis_resumed["after"]
    kept = at_kill["held"] | at_kill["delivered"] | at_kill["awaiting"]
    assert kept, "the buffer held no group at the kill: nothing to recover"
    s = redis_resumed["manifest"]["step"]
    trained_after = {g for x in data_ledger(redis_resumed["run_dir"]) if x["step"] > s for g in x["group_ids"]}
    unaccounted = {g for g in kept if g not in trained_after and g not in after["dropped"]}
    assert not unaccounted, f"groups held in Redis at the kill were neither trained nor dropped: {unaccounted}"
    assert not kept & trained_after & set(after["dropped"]), "a group was both trained and dropped"
    assert kept & trained_after, "no group held in Redis at the kill was trained after the resume"
    reasons = {after["dropped"][g] for g in kept if g in after["dropped"]}
    assert reasons <= {"rolled_back", "reward_lost", "stale", "unconsumed_at_shutdown"}, reasons
    # every rolled_back drop is a group of the killed run (made by weights newer than the checkpoint)
    rolled = sum(1 for g in kept if after["dropped"].get(g) == "rolled_back")
    assert after["meta"].get("c:dropped_rolled_back", 0) == rolled


def test_no_prompt_lost_or_trained_twice_across_the_resume_on_redis(redis_resumed: dict[str, Any]) -> None:
    keys = check_prompts_once(redis_resumed["run_dir"], redis_resumed["manifest"], redis_resumed["steps"])
    assert len(keys) == redis_resumed["steps"] * 4
