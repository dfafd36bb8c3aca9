"""RolloutTracker: streamed deltas become samples whose tokens carry the version that made them."""

import numpy as np
import pytest

from async_rlhf.generator.rollout import GroupInProgress, RolloutTracker
from async_rlhf.types import Group


def new_group(gid="g1", n=2, start_version=3) -> GroupInProgress:
    return GroupInProgress(gid, [101, 102, 103], n, {"problem": "1+2"}, start_version)


def test_start_returns_request_ids():
    tracker = RolloutTracker()
    assert tracker.start(new_group("gen0/7", n=3)) == ["gen0/7/0", "gen0/7/1", "gen0/7/2"]
    assert len(tracker) == 1


def test_deltas_versions_and_completion():
    tracker = RolloutTracker()
    rids = tracker.start(new_group("g1", n=2, start_version=3))
    tracker.start(new_group("other", n=1))
    assert len(tracker) == 2
    # step 1 at version 3
    assert tracker.on_output(rids[0], [11, 12], [-0.1, -0.2], 3, None) is None
    assert tracker.on_output(rids[1], [21], [-1.0], 3, None) is None
    # a weight update lands: version 4 from here on
    assert tracker.on_output(rids[0], [13], [-0.3], 4, None) is None
    assert tracker.on_output(rids[1], [22, 23], [-2.0, -3.0], 4, None) is None
    # sample 0 finishes; the group is not complete yet
    assert tracker.on_output(rids[0], [14], [-0.4], 4, "stop") is None
    assert len(tracker) == 2
    # version 5, then sample 1 finishes on the length limit
    done = tracker.on_output(rids[1], [24], [-4.0], 5, "length")
    assert done is not None and done.group_id == "g1"
    assert len(tracker) == 1 and "g1" not in tracker.groups
    assert done.tokens == [[11, 12, 13, 14], [21, 22, 23, 24]]
    assert done.logprobs == [[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0, -3.0, -4.0]]
    assert done.versions == [[3, 3, 4, 4], [3, 4, 4, 5]]
    assert done.finish == ["stop", "length"]

    g = done.to_group([1.0, 0.0], generator=5)
    assert isinstance(g, Group)
    assert g.group_id == "g1" and g.generator == 5
    np.testing.assert_array_equal(g.prompt_ids, [101, 102, 103])
    assert g.prompt_ids.dtype == np.int32
    s0, s1 = g.samples
    np.testing.assert_array_equal(s0.completion_ids, [11, 12, 13, 14])
    np.testing.assert_allclose(s1.logprobs, [-1.0, -2.0, -3.0, -4.0])
    np.testing.assert_array_equal(s0.versions, [3, 3, 4, 4])
    np.testing.assert_array_equal(s1.versions, [3, 4, 4, 5])
    assert (s0.completion_ids.dtype, s0.logprobs.dtype, s0.versions.dtype) == (np.int32, np.float32, np.int32)
    assert (s0.reward, s1.reward) == (1.0, 0.0)
    assert (s0.finish_reason, s1.finish_reason) == ("stop", "length")
    assert g.meta == {"problem": "1+2", "start_version": 3}
    assert g.min_version == 3
    assert g.num_tokens == 8
    assert g.t_end >= g.t_start
    # the wire form survives validation
    assert Group.from_wire(g.to_wire()).min_version == 3


def test_min_version_is_the_oldest_token_not_the_start_version():
    tracker = RolloutTracker()
    rids = tracker.start(new_group("g", n=2, start_version=2))
    tracker.on_output(rids[0], [1], [-0.5], 4, None)   # the first step ran after two updates
    tracker.on_output(rids[1], [2, 3], [-0.5, -0.5], 5, "stop")
    done = tracker.on_output(rids[0], [4], [-0.5], 6, "stop")
    g = done.to_group([0.0, 1.0], generator=0)
    assert g.min_version == 4
    np.testing.assert_array_equal(g.samples[0].versions, [4, 6])


def test_finish_with_no_new_tokens_and_empty_completion():
    tracker = RolloutTracker()
    rids = tracker.start(new_group("g", n=2, start_version=7))
    tracker.on_output(rids[0], [5, 6], [-0.1, -0.1], 7, None)
    assert tracker.on_output(rids[0], [], [], 8, "stop") is None
    done = tracker.on_output(rids[1], [], [], 8, "abort")
    g = done.to_group([0.5, 0.0], generator=1)
    np.testing.assert_array_equal(g.samples[0].versions, [7, 7])
    assert len(g.samples[1].completion_ids) == 0
    assert g.samples[1].finish_reason == "abort"
    assert g.min_version == 7


def test_mismatched_delta_is_refused():
    tracker = RolloutTracker()
    rids = tracker.start(new_group("g", n=1))
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        tracker.on_output(rids[0], [1, 2], [-0.1], 0, None)
    assert tracker.groups["g"].tokens == [[]]


def test_group_ids_containing_slashes():
    tracker = RolloutTracker()
    rids = tracker.start(new_group("gen1/step/9", n=1))
    done = tracker.on_output(rids[0], [3], [-0.2], 1, "stop")
    assert done.group_id == "gen1/step/9"
    assert len(tracker) == 0
