"""SIGKILL the buffer actor of a running job on the Redis store: Ray restarts it on the same port, it recovers
its state from Redis, the clients reconnect, and the run finishes its steps with an exact ledger.

    job (1 generator, 1 learner, buffer.store=redis on a redis-server of this test)
      trains a few steps -> {"op": "pids"} names the buffer's process -> SIGKILL it
      the learner's parked get fails at once (the connection dropped); its retry names what it holds, so a
      group delivered just before the kill is taken back (reply_lost) instead of being lost
    every step is in the data ledger, no group or prompt trained twice, and every group Redis knows of is
    trained (in the ledger) or dropped with a reason: none is left delivered to no one

The job joins the session's shared Ray (``RAY_ADDRESS``): the buffer it kills is its own actor, and Ray's restart of
it is the same on a Ray the job joined as on one it started.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from jobs import data_ledger, job_args, kill_session, learner_records, start_job, wait_until

from async_rlhf.buffer.redis_store import RedisStore
from async_rlhf.buffer.run_scope import run_prefix
from async_rlhf.buffer.testing import RedisServer
from async_rlhf.driver.control import send_control
from async_rlhf.generator.stream import key_of_group

pytestmark = pytest.mark.integration

STEPS = 60
KILL_AT = 5
PREFIX = "restart"


def test_a_killed_buffer_on_redis_restarts_and_the_run_finishes_exactly(tmp_path: Path, tiny_model_dir: Path,
                                                                       ray_address: str) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    server = RedisServer(tmp_path / "redis").start()
    try:
        job = start_job(tmp_path, log.name, job_args(
            tiny_model_dir, run_dir, 0, "buffer.store=redis", f"buffer.redis_url={server.url}",
            f"buffer.redis_prefix={PREFIX}", f"train.steps={STEPS}", "run.buffer_max_restarts=2",
            "run.stall_timeout_s=120"), ray_address)
        try:
            wait_until(lambda: len(learner_records(run_dir)) >= KILL_AT, f"{KILL_AT} steps", job, log, 400)
            pid = send_control(run_dir, {"op": "pids"})["buffer"]
            os.kill(pid, signal.SIGKILL)
            t_kill, steps_at_kill = time.time(), len(learner_records(run_dir))
            code = job.wait(timeout=400)
        finally:
            kill_session(job.pid)
        store = RedisStore(server.url, run_prefix(run_dir, PREFIX))  # the run's own keys (issue 44, defect 4)
        try:
            trained, dropped = set(store.trained()), store.dropped()
            left = {g.group_id for g in store.held()} | set(store.delivered()) | set(store.awaiting())
            meta = dict(store.meta())
        finally:
            store.close()
    finally:
        server.stop()
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert "buffer: restarted (1 of run.buffer_max_restarts=2)" in out, out[-4000:]
    assert steps_at_kill < STEPS, "the run finished before the kill: nothing was tested"
    records = learner_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    after = [r["time"] for r in records if r["time"] > t_kill]
    assert after, "no step after the kill"
    lines = data_ledger(run_dir)
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    ids = [g for x in lines for g in x["group_ids"]]
    assert len(ids) == len(set(ids)) == STEPS * 4, "a group was trained twice (or a batch was short)"
    keys = [k for x in lines for k in x["prompt_keys"]]
    assert keys == [key_of_group(g) for g in ids] and len(keys) == len(set(keys)), "a prompt was trained twice"
    assert trained == set(ids), (f"Redis and the data ledger disagree on what was trained: only in Redis "
                                 f"{sorted(trained - set(ids))}, only in the ledger {sorted(set(ids) - trained)}")
    assert not left, f"groups left held, delivered or awaiting a reward after the run: {sorted(left)}"
    reasons = set(dropped.values())
    assert reasons <= {"stale", "zero_advantage", "unconsumed_at_shutdown"}, reasons
    print(f"buffer killed after step {steps_at_kill}; next learner step {after[0] - t_kill:.1f} s after the kill; "
          f"groups taken back from lost replies: {meta.get('c:returned_reply_lost', 0)}; "
          f"dropped {dict((r, list(dropped.values()).count(r)) for r in reasons)}")
