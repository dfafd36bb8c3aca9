"""EnginePolicy: engine deltas become turns whose tokens carry the version that made them."""

import asyncio

import numpy as np
import pytest

from async_rlhf.env.base import Trajectory
from async_rlhf.generator.rollout import EnginePolicy, to_group
from async_rlhf.types import Group


class Engine:
    """Records add_request calls (the policy's only way to reach an engine)."""

    def __init__(self, refuse: bool = False) -> None:
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.samples: dict[str, int] = {}
        self.refuse = refuse

    def add(self, rid: str, context: list[int], max_tokens: int, n: int) -> None:
        if self.refuse:
            raise ValueError("prompt too long")
        self.requests[rid] = (context, max_tokens)
        self.samples[rid] = n


def make_policy(engine: Engine, max_new_tokens: int = 4, max_model_len: int = 16) -> EnginePolicy:
    return EnginePolicy(engine.add, lambda t: [ord(c) for c in t], lambda ids: "".join(map(chr, ids)),
                        max_new_tokens, max_model_len)


def test_turn_collects_deltas_with_versions_across_a_weight_swap():
    async def scenario() -> None:
        engine = Engine()
        policy = make_policy(engine)
        task = asyncio.ensure_future(policy.generate([1, 2, 3]))
        await asyncio.sleep(0)
        assert engine.requests == {}, "queued until the flush"
        policy.flush()
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
            policy.flush()
            policy.on_output(list(policy.requests)[0], [1, 2], [-1.0], 0, None)
        t2.cancel()

    asyncio.run(scenario())


def test_turn_length_is_capped_by_the_context_window():
    async def scenario() -> None:
        engine = Engine()
        policy = make_policy(engine, max_new_tokens=4, max_model_len=10)
        task = asyncio.ensure_future(policy.generate(list(range(8))))
        await asyncio.sleep(0)
        policy.flush()
        assert list(engine.requests.values())[0][1] == 2
        full = await policy.generate(list(range(10)))  # no room: no request at all
        assert full.token_ids == [] and full.finish_reason == "length" and len(engine.requests) == 1
        assert policy.cancel_all() == list(engine.requests)
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())


def test_turns_with_one_context_go_as_one_request_of_n_samples_routed_back_by_index():
    async def scenario() -> None:
        engine = Engine()
        policy = make_policy(engine)
        same = [asyncio.ensure_future(policy.generate([1, 2])) for _ in range(3)]
        other = asyncio.ensure_future(policy.generate([1, 2, 3]))
        for _ in range(3):  # the flush runs on its own, one loop pass after the turns were asked for
            await asyncio.sleep(0)
        assert sorted(engine.samples.values()) == [1, 3] and len(policy) == 4
        (batch,) = [rid for rid, n in engine.samples.items() if n == 3]
        (single,) = [rid for rid, n in engine.samples.items() if n == 1]
        assert engine.requests[batch] == ([1, 2], 4) and policy.owns(batch) and policy.owns(single)
        policy.on_output(batch, [7], [-0.7], 1, None, index=2)
        policy.on_output(batch, [5], [-0.5], 1, "stop", index=0)
        policy.on_output(single, [9], [-0.9], 1, "stop")
        policy.on_output(batch, [8], [-0.8], 2, "length", index=2)
        await asyncio.sleep(0)
        assert same[0].done() and same[2].done() and not same[1].done() and policy.owns(batch)
        policy.on_output(batch, [6], [-0.6], 2, "stop", index=1)
        turns = [await t for t in same]
        assert [t.token_ids for t in turns] == [[5], [6], [7, 8]] and turns[2].versions == [1, 2]
        assert turns[2].finish_reason == "length" and (await other).token_ids == [9]
        assert len(policy) == 0 and not policy.owns(batch), "the request is forgotten once every sample is done"

    asyncio.run(scenario())


def test_a_refused_request_fails_its_turns_and_cancel_all_names_engine_requests():
    async def scenario() -> None:
        refused = make_policy(Engine(refuse=True))
        turns = [asyncio.ensure_future(refused.generate([1])) for _ in range(2)]
        await asyncio.sleep(0)
        refused.flush()
        for t in turns:
            with pytest.raises(ValueError, match="prompt too long"):
                await t
        assert len(refused) == 0

        engine = Engine()
        policy = make_policy(engine)
        batch = [asyncio.ensure_future(policy.generate([1])) for _ in range(2)]
        await asyncio.sleep(0)
        policy.flush()
        queued = asyncio.ensure_future(policy.generate([4]))
        await asyncio.sleep(0)  # asked for, not flushed: never reached the engine
        assert policy.cancel_all() == list(engine.requests) and len(engine.requests) == 1
        for t in [*batch, queued]:
            with pytest.raises(asyncio.CancelledError):
                await t
        policy.flush()
        assert len(engine.requests) == 1, "a cancelled turn is never sent"

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
