"""GroupRunner: rollouts, immediate and late rewards, failures counted and never raised (the buffer client
and the policy are recorded stand-ins; the subject is the runner)."""

import asyncio
import time

import pytest

from async_rlhf.buffer.client import BufferUnavailable
from async_rlhf.env.base import Prompt, SingleTurnEnv, Turn
from async_rlhf.env.guess_number import GuessNumberEnv
from async_rlhf.generator.groups import GroupRunner
from async_rlhf.rewards.base import FunctionReward, RewardSource


class Client:
    def __init__(self) -> None:
        self.puts: list[tuple[str, bool, list[float]]] = []
        self.rewards: dict[str, list[float]] = {}
        self.released = 0

        self.requests = 0
        self.down = False

    def put(self, group, rewards_pending: bool = False) -> bool:
        return self.put_many([group], rewards_pending=rewards_pending)[0]

    def put_many(self, groups, rewards_pending: bool = False) -> list[bool]:
        if self.down:
            raise BufferUnavailable("buffer gone")
        self.requests += 1
        self.puts += [(g.group_id, rewards_pending, [s.reward for s in g.samples]) for g in groups]
        return [True] * len(groups)

    def reward(self, gid: str, rewards: list[float]) -> dict:
        self.rewards[gid] = rewards
        return {"ok": True, "reason": None}

    def release(self, n: int) -> None:
        self.released += n


class EchoPolicy:
    version = 0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    async def generate(self, context_ids: list[int]) -> Turn:
        await asyncio.sleep(0)
        ids = self.encode("5")
        return Turn(ids, [-1.0], [0], "stop")


class Slow(RewardSource):
    name = "slow"

    def __init__(self, delay_s: float, fail: bool = False) -> None:
        self.delay_s, self.fail = delay_s, fail

    async def score(self, prompt, completions):
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("scorer exploded")
        return [0.5] * len(completions)


def make_runner(env, rewards, timeout_s: float = 1.0):
    events: list[tuple[str, str, object, str]] = []
    client = Client()
    runner = GroupRunner(env, rewards, EchoPolicy(), client, group_size=3, reward_timeout_s=timeout_s,
                         patience_s=1.0, generator=0, current_version=lambda: 2,
                         record=lambda *e: events.append(e))
    return runner, client, events


def drive(runner: GroupRunner, until, limit_s: float = 5.0) -> None:
    deadline = time.monotonic() + limit_s
    while not until() and time.monotonic() < deadline:
        runner.pump()
        time.sleep(0.005)
    assert until(), "the runner did not get there in time"


def test_immediate_rewards_put_the_group_once_generated():
    runner, client, events = make_runner(SingleTurnEnv(), FunctionReward(lambda p, c, d: float(c == "5")))
    runner.start("g1", Prompt("x"), [1])
    assert list(runner.groups) == ["g1"]
    drive(runner, lambda: client.puts)
    assert client.puts == [("g1", False, [1.0, 1.0, 1.0])] and not runner.groups
    assert events == [("put", "g1", [1.0, 1.0, 1.0], "")]
    runner.close()


def test_groups_rewarded_in_one_pump_are_put_in_one_request():
    runner, client, events = make_runner(SingleTurnEnv(), FunctionReward(lambda p, c, d: 1.0))
    for gid in ("g1", "g2", "g3"):
        runner.start(gid, Prompt("x"), [1])
    drive(runner, lambda: client.puts)
    assert client.requests == 1 and [p[0] for p in client.puts] == ["g1", "g2", "g3"] and not runner.groups
    assert [e[:2] for e in events] == [("put", "g1"), ("put", "g2"), ("put", "g3")]
    runner.close()


def test_a_put_that_fails_leaves_its_groups_open_and_is_never_raised():
    runner, client, events = make_runner(SingleTurnEnv(), FunctionReward(lambda p, c, d: 1.0))
    client.down = True
    runner.start("g1", Prompt("x"), [1])
    drive(runner, lambda: runner.groups["g1"].done())  # rewarded; its put retried for patience_s (1 s), given up
    assert list(runner.groups) == ["g1"] and events == [] and client.puts == []
    assert runner.cancel_all() == 1, "released as not put when the loop ends"
    runner.close()


def test_late_rewards_follow_the_put_and_add_per_turn_returns():
    runner, client, events = make_runner(GuessNumberEnv(max_turns=1), Slow(0.05))
    runner.start("g1", Prompt("guess 0-9:", {"secret": 5}), [1])
    drive(runner, lambda: client.puts)
    assert client.puts == [("g1", True, [1.0, 1.0, 1.0])]  # the env's per-turn reward is in the return already
    assert not runner.groups and len(runner.reward_tasks) == 1  # the group is in the buffer, its reward pending
    # the fake client records the reward in the executor thread before the task resumes: wait for the task
    drive(runner, lambda: not runner.reward_tasks)
    assert client.rewards == {"g1": [1.5, 1.5, 1.5]}
    assert [e[0] for e in events] == ["put_pending", "rewarded"]
    runner.close()


@pytest.mark.parametrize("source,counter", [(Slow(10.0), "reward_timeouts"), (Slow(0.0, fail=True), "reward_errors")])
def test_late_reward_failures_are_counted_and_never_raised(source, counter):
    runner, client, events = make_runner(SingleTurnEnv(), source, timeout_s=0.2)
    runner.start("g1", Prompt("x"), [1])
    drive(runner, lambda: any(e[0] == counter for e in events))
    assert client.rewards == {} and not runner.reward_tasks and client.puts[0][1] is True
    runner.close()


def test_failing_environment_or_reward_function_drops_the_group_with_a_reason():
    class Broken(SingleTurnEnv):
        async def rollout(self, prompt, prompt_ids, policy):
            raise KeyError("secret")

    runner, client, events = make_runner(Broken(), FunctionReward(lambda p, c, d: 1.0))
    runner.start("g1", Prompt("x"), [1])
    drive(runner, lambda: client.released)
    assert ("dropped", "g1", None, "env_error: KeyError('secret')") in events and not client.puts
    runner2, client2, events2 = make_runner(SingleTurnEnv(), FunctionReward(lambda p, c, d: 1 / 0))
    runner2.start("g2", Prompt("x"), [1])
    drive(runner2, lambda: client2.released)
    assert any(e[0] == "dropped" and e[3].startswith("reward_error: ZeroDivisionError") for e in events2)
    assert any(e[0] == "reward_errors" for e in events2)
    runner.close(), runner2.close()


def test_cancel_all_reports_groups_not_put():
    runner, client, events = make_runner(SingleTurnEnv(), Slow(10.0))
    runner.start("g1", Prompt("x"), [1])
    runner.start("g2", Prompt("x"), [1])
    assert runner.cancel_all() == 2
    drive(runner, lambda: not runner.groups or all(t.done() for t in runner.groups.values()))
    runner.close()
