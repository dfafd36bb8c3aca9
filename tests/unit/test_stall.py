"""The stall diagnosis names the likely cause from what the roles report."""

from async_rlhf.driver.stall import diagnose_stall, role_lines

BUF = {"buffer/depth": 0, "buffer/awaiting_reward": 0, "buffer/version": 3, "buffer/accepted": 48,
       "buffer/running": 8, "buffer/capacity": 64, "buffer/dropped_total": 0}


def gen(**kw):
    return {"gen_id": 0, "version": 3, "in_flight": 8, "groups": 0, "reward_errors": 0, "reward_timeouts": 0, **kw}


def test_every_reward_failing_is_named() -> None:
    why = diagnose_stall([gen(reward_timeouts=40)], BUF, ["wait_data at step 0"], 301)
    assert why.startswith("no learner step for 301 s") and "reward sources failed 40" in why


def test_data_held_but_no_step_points_at_the_learners() -> None:
    why = diagnose_stall([gen(groups=50)], {**BUF, "buffer/depth": 12}, ["push_wait at step 7"], 300)
    assert "learners have data (12" in why and "push_wait" in why


def test_late_rewards_that_never_come_and_closed_admission() -> None:
    assert "wait for late rewards" in diagnose_stall([gen(groups=5)], {**BUF, "buffer/awaiting_reward": 8}, [], 300)
    assert "admission is closed" in diagnose_stall([gen(groups=5, in_flight=0)], BUF, [], 300)
    assert "no generator answers" in diagnose_stall([], BUF, [], 300)
    assert "none reached the buffer" in diagnose_stall([gen(groups=5)], BUF, [], 300)


def test_role_lines_say_what_each_role_does() -> None:
    lines = role_lines([gen(reward_errors=2)], {**BUF, "buffer/dropped_stale": 4}, ["wait_data at step 2"])
    assert lines[0] == "learner 0: wait_data at step 2"
    assert "reward errors 2" in lines[1] and "{'stale': 4}" in lines[2]
