"""GroupRunner sends late rewards off its event loop: a buffer slow to answer one reward must not hold back
the other groups' rewards (nor the loop, which runs between engine steps). The buffer client is a stand-in;
the subject is the runner."""

import asyncio
import threading
import time

from test_env_groups import EchoPolicy as Policy

from async_rlhf.env.base import Prompt, SingleTurnEnv
from async_rlhf.generator.groups import GroupRunner
from async_rlhf.rewards.base import RewardSource


class LateScorer(RewardSource):
    name = "late"

    async def score(self, prompt, completions):
        await asyncio.sleep(0)
        return [1.0] * len(completions)


class StallingBuffer:
    """Answers the reward of ``slow_gid`` only once ``release`` is set (or after ``limit_s``); others at once."""

    def __init__(self, slow_gid: str, limit_s: float = 5.0) -> None:
        self.slow_gid, self.limit_s = slow_gid, limit_s
        self.release = threading.Event()
        self.order: list[str] = []
        self.threads: set[str] = set()
        self.made = 0
        self.closed = 0

    def put(self, group, rewards_pending: bool = False) -> bool:
        return True

    def reward(self, gid: str, rewards: list[float]) -> dict:
        self.threads.add(threading.current_thread().name)
        if gid == self.slow_gid:
            self.release.wait(self.limit_s)
        self.order.append(gid)
        if gid != self.slow_gid:
            self.release.set()  # the slow answer comes once another reward got through
        return {"ok": True, "reason": None}

    def close(self) -> None:
        self.closed += 1


def test_a_slow_reward_answer_does_not_hold_back_other_groups():
    buffer = StallingBuffer("g1")

    def factory() -> StallingBuffer:
        buffer.made += 1
        return buffer

    events: list[tuple] = []
    runner = GroupRunner(SingleTurnEnv(), LateScorer(), Policy(), buffer, group_size=2, reward_timeout_s=5.0,
                         patience_s=1.0, generator=0, current_version=lambda: 0,
                         record=lambda *e: events.append(e), reward_client=factory)
    runner.start("g1", Prompt("x"), [1])
    runner.pump()  # g1 reaches its reward first
    runner.start("g2", Prompt("x"), [1])
    deadline = time.monotonic() + 10
    while len([e for e in events if e[0] == "rewarded"]) < 2 and time.monotonic() < deadline:
        runner.pump()
        time.sleep(0.005)
    # the old runner sent g1's reward on the loop thread, blocked there until limit_s, and only then g2's
    assert buffer.order == ["g2", "g1"], "the slow answer to g1 held back g2's reward"
    assert sorted(e[1] for e in events if e[0] == "rewarded") == ["g1", "g2"]
    assert buffer.made == 2, "one client per reward thread"
    assert threading.current_thread().name not in buffer.threads, "rewards are sent off the loop thread"
    runner.close()
    deadline = time.monotonic() + 5
    while buffer.closed < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert buffer.closed == 2, "the reward clients are closed with the runner"


def test_a_reward_the_buffer_never_takes_is_counted_not_raised():
    from async_rlhf.buffer.client import BufferUnavailable

    class Down(StallingBuffer):
        def reward(self, gid: str, rewards: list[float]) -> dict:
            raise BufferUnavailable("no answer")

    down = Down("none")
    events: list[tuple] = []
    runner = GroupRunner(SingleTurnEnv(), LateScorer(), Policy(), down, group_size=2, reward_timeout_s=5.0,
                         patience_s=0.2, generator=0, current_version=lambda: 0,
                         record=lambda *e: events.append(e), reward_client=lambda: down)
    runner.start("g1", Prompt("x"), [1])
    deadline = time.monotonic() + 10
    while not any(e[0] == "reward_errors" for e in events) and time.monotonic() < deadline:
        runner.pump()
        time.sleep(0.01)
    assert [e[0] for e in events] == ["put_pending", "reward_errors"] and not runner.reward_tasks
    runner.close()
