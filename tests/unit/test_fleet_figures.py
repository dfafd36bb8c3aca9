"""The run-record side of the fleet figures (async_rlhf/driver/fleet_figures.py): which pushes the records carry
and when "every version reached every generator" holds."""

from __future__ import annotations

from async_rlhf.driver.fleet_figures import push_figures, version_gaps


def records(steps: int, members: int = 2, dropped_at: int | None = None) -> list[dict]:
    """As a learner writes them: version v's push metrics ride on step v + 1's record; the last push on none."""
    out = [{"step": s, "version": s} for s in range(1, steps + 1)]
    for v in range(1, steps):
        out[v].update({"sync/version": float(v), "sync/members": float(members), "sync/push_s": 0.01 * v,
                       "sync/broadcast_s": 0.001 * v, "sync/ack_wait_s": 0.009 * v, "sync/bytes": 4096.0,
                       "sync/dropped": 1.0 if v == dropped_at else 0.0})
    return out


def test_every_version_reached_every_generator() -> None:
    assert version_gaps(records(5), [5, 5], members=2) == []


def test_a_generator_behind_a_push_missing_or_a_member_short_is_named() -> None:
    assert version_gaps(records(5), [5, 4], 2) == ["generator(s) {1: 4} end on another version than the final 5"]
    missing = records(5)
    del missing[2]["sync/version"]
    assert version_gaps(missing, [5, 5], 2) == ["no record of the push of version(s) [2]"]
    assert version_gaps(records(5, members=1), [5, 5], 2)[0].startswith("version 1 was acknowledged by 1 of 2")
    assert "1 dropped" in version_gaps(records(5, dropped_at=3), [5, 5], 2)[0]
    assert version_gaps([], [], 2) == ["no step was recorded"]
    assert version_gaps(records(3), [], 2) == ["no generator reported its version"]


def test_push_figures_are_medians_of_the_recorded_pushes() -> None:
    got = push_figures(records(6))
    assert got["pushes"] == 5 and got["push_bytes"] == 4096.0
    assert abs(got["push_s"] - 0.03) < 1e-12 and abs(got["push_broadcast_s"] - 0.003) < 1e-12
    assert abs(got["push_ack_wait_s"] - 0.027) < 1e-12
    assert push_figures([{"step": 1, "version": 1}]) == {"push_s": 0.0, "push_broadcast_s": 0.0,
                                                         "push_ack_wait_s": 0.0, "pushes": 0, "push_bytes": 0.0}
