"""Scale-down with rewards pending (issue 31, defect 7): a draining generator ended as soon as every group it
started was put, cancelling the late rewards still on their way; the real buffer service then dropped those groups
at its reward deadline (``reward_timeout``). Now a draining generator lets its pending rewards finish
(``GroupRunner.settle``, bounded by the reward timeout and the buffer's patience) and gives back what is still
pending (``GroupRunner.abandon_pending``: dropped at once, reason ``reward_abandoned``, admission back; the driver's
prompt ledger keeps those prompts outstanding, issued again when that lane's generator returns).

The runner is the generator's own, with the real ZeroMQ buffer service and client; only the policy (no engine)
and the reward source (a coroutine that takes a set time) are stand-ins: the subject is the drain."""

from __future__ import annotations

import asyncio
import time

import pytest

from async_rlhf.buffer.client import BufferClient
from async_rlhf.buffer.service import BufferLogic, BufferService
from async_rlhf.buffer.store import MemoryStore
from async_rlhf.env.base import Prompt, SingleTurnEnv, Turn
from async_rlhf.generator.groups import GroupRunner
from async_rlhf.rewards.base import RewardSource

pytestmark = pytest.mark.integration

REWARD_TIMEOUT_S = 5.0


class EchoPolicy:
    version = 0

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    async def generate(self, context_ids: list[int]) -> Turn:
        await asyncio.sleep(0)
        return Turn([ord("5")], [-1.0], [0], "stop")


class Late(RewardSource):
    name = "late"

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def score(self, prompt, completions):
        await asyncio.sleep(self.delay_s)
        return [0.5] * len(completions)


@pytest.fixture
def svc():
    logic = BufferLogic(MemoryStore(), groups_per_version=4, max_staleness=1, reward_deadline_s=60.0)
    service = BufferService(logic, host="127.0.0.1", port=0).start()
    try:
        yield service
    finally:
        service.stop()


def _drain(svc: BufferService, delay_s: float, settle_s: float) -> tuple[GroupRunner, list[str], list[str], list]:
    """A generator with 2 groups put with rewards pending is scaled down: what its run() now does at the end of a
    drain (settle, then abandon what is left, then cancel). Returns the runner, the ids still pending after
    settling, the ids abandoned, and the recorded events."""
    client = BufferClient(svc.address, timeout_s=5.0, consumer="generator-1")
    events: list = []
    runner = GroupRunner(SingleTurnEnv(), Late(delay_s), EchoPolicy(), client, group_size=2,
                         reward_timeout_s=REWARD_TIMEOUT_S, patience_s=2.0, generator=1,
                         current_version=lambda: 0, record=lambda *e: events.append(e),
                         reward_client=lambda: BufferClient(svc.address, timeout_s=5.0, consumer="generator-1"))
    try:
        assert client.admit(2)[0] == 2
        for gid in ("g1-x-1", "g1-x-2"):
            runner.start(gid, Prompt("q"), [1])
        deadline = time.monotonic() + 5
        while runner.groups and time.monotonic() < deadline:  # generated and put, rewards on their way
            runner.pump()
            time.sleep(0.005)
        assert not runner.groups and runner.pending_rewards() == ["g1-x-1", "g1-x-2"]
        left = runner.settle(settle_s)
        abandoned = runner.abandon_pending()
        runner.cancel_all()
    finally:
        runner.close()
        client.close()
    return runner, left, abandoned, events


def test_a_draining_generator_waits_for_its_pending_rewards(svc: BufferService) -> None:
    _, left, abandoned, events = _drain(svc, delay_s=0.5, settle_s=REWARD_TIMEOUT_S + 2.0)
    assert left == [] and abandoned == []
    ledger = svc.call(lambda: svc.logic.stats(ledger=True))["ledger"]
    assert sorted(ledger["held"]) == ["g1-x-1", "g1-x-2"], ledger  # rewarded: deliverable, to be trained
    assert ledger["awaiting_reward"] == [] and ledger["dropped"] == {}
    assert sorted(e[1] for e in events if e[0] == "rewarded") == ["g1-x-1", "g1-x-2"]


def test_rewards_still_pending_at_the_bound_go_back_at_once(svc: BufferService) -> None:
    _, left, abandoned, events = _drain(svc, delay_s=30.0, settle_s=0.3)
    assert left == abandoned == ["g1-x-1", "g1-x-2"]
    stats = svc.call(lambda: svc.logic.stats(ledger=True))
    # dropped now with their reason (not 60 s later as reward_timeout), and admission has them back
    assert stats["ledger"]["dropped"] == {"g1-x-1": "reward_abandoned", "g1-x-2": "reward_abandoned"}
    assert stats["ledger"]["awaiting_reward"] == [] and stats["buffer/accepted"] == 0
    assert stats["buffer/running"] == 0
    assert [e[0] for e in events].count("reward_abandoned") == 2


def test_the_old_drain_left_them_to_time_out(svc: BufferService) -> None:
    """For the record, the drain before the fix: cancel at once (settle 0, nothing abandoned). The groups wait in
    the buffer for rewards that never come and are dropped at the deadline as ``reward_timeout``."""
    client = BufferClient(svc.address, timeout_s=5.0, consumer="generator-1")
    runner = GroupRunner(SingleTurnEnv(), Late(0.5), EchoPolicy(), client, group_size=2,
                         reward_timeout_s=REWARD_TIMEOUT_S, patience_s=2.0, generator=1,
                         current_version=lambda: 0, record=lambda *e: None)
    try:
        assert client.admit(1)[0] == 1
        runner.start("g1-x-1", Prompt("q"), [1])
        deadline = time.monotonic() + 5
        while runner.groups and time.monotonic() < deadline:
            runner.pump()
            time.sleep(0.005)
        runner.cancel_all()
    finally:
        runner.close()
        client.close()
    assert svc.call(lambda: svc.logic.stats(ledger=True))["ledger"]["awaiting_reward"] == ["g1-x-1"]
    assert svc.call(lambda: svc.logic.expire_rewards(time.time() + 61.0)) == 1
    assert svc.call(lambda: svc.logic.stats(ledger=True))["ledger"]["dropped"] == {"g1-x-1": "reward_timeout"}
