"""EnginePolicy: engine deltas become turns whose tokens carry the version that made them."""

import asyncio

import numpy as np
import pytest

from async_rlhf.env.base import Trajectory
from async_rlhf.generator.rollout import EnginePolicy, to_group
from async_rlhf.types import Group


class Engine:
    """Records add_request calls (the policy's only way to reach an engine)."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], int]] = {}

    def add(self, rid: str, context: list[int], max_tokens: int) -> None:
        self.requests[rid] = (context, max_tokens)


def make_policy(engine: Engine, max_new_tokens: int = 4, max_model_len: int = 16) -> EnginePolicy:
    return EnginePolicy(engine.add, lambda t: [ord(c) for c in t], lambda ids: "".join(map(chr, ids)),
                        max_new_tokens, max_model_len)


def test_turn_collects_deltas_with_versions_across_a_weight_swap():
    async def scenario() -> None:
        engine = Engine()
        policy = make_policy(engine)
        task = asyncio.ensure_future(policy.generate([1, 2, 3]))
        await asyncio.sleep(0)
        (rid,) = engine.requests
        assert engine.requests[rid] == ([1, 2, 3], 4) and policy.owns(rid) and len(policy) == 1
        policy.on_output(rid, [11, 12], [-0.1, -0.2], 3, None)
        policy.on_output(rid, [13], [-0.3], 4, None)  # a weight update landed between two steps
        assert not task.done()
        policy.on_output(rid, [14], [-0.4], 4, "stop")
        turn = await task
        assert turn.token_ids == [11, 12, 13, 14] and turn.versions == [3, 3, 4, 4]
        assert turn.logprobs == [-0.1, -0.2, -0.3, -0.4] and turn.finish_reason == "stop"
        assert len(policy) == 0 and not policy.owns(rid)
        with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
            t2 = asyncio.ensure_future(policy.generate([1]))
            await asyncio.sleep(0)
            policy.on_output(list(policy.requests)[0], [1, 2], [-1.0], 0, None)
        t2.cancel()

    asyncio.run(scenario())


def test_turn_length_is_capped_by_the_context_window():
    async def scenario() -> None:
        engine = Engine()
        policy = make_policy(engine, max_new_tokens=4, max_model_len=10)
        task = asyncio.ensure_future(policy.generate(list(range(8))))
        await asyncio.sleep(0)
        assert list(engine.requests.values())[0][1] == 2
        full = await policy.generate(list(range(10)))  # no room: no request at all
        assert full.token_ids == [] and full.finish_reason == "length" and len(engine.requests) == 1
        assert policy.cancel_all() == list(engine.requests)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_to_group_builds_the_buffer_record():
    traj = Trajectory()
    from async_rlhf.env.base import Turn

    traj.add_turn(Turn([5, 6], [-0.5, -0.6], [2, 3], "length"), "ab")
    g = to_group("g1", [101, 102], [traj, traj], [1.0, 0.0], generator=5, meta={"answer": "3"}, start_version=2,
                 t_start=0.0)
    assert isinstance(g, Group) and g.generator == 5 and g.meta == {"answer": "3", "start_version": 2}
    np.testing.assert_array_equal(g.prompt_ids, [101, 102])
    assert [s.reward for s in g.samples] == [1.0, 0.0]
    s0 = g.samples[0]
    assert (s0.completion_ids.dtype, s0.logprobs.dtype, s0.versions.dtype) == (np.int32, np.float32, np.int32)
    np.testing.assert_array_equal(s0.versions, [2, 3])
    assert s0.token_rewards is None and s0.loss_mask.tolist() == [1, 1]  # single turn: nothing extra on the wire
    assert Group.from_wire(g.to_wire()).samples[1].reward == 0.0
    with pytest.raises(ValueError, match="1 rewards for 2 trajectories"):
        to_group("g1", [1], [traj, traj], [1.0], 0, {}, 0, 0.0)
