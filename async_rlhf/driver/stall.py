"""Why a run makes no progress: a diagnosis from what every role reports (pure).

The driver's progress loop calls :func:`diagnose_stall` when no learner step has completed for
``run.stall_timeout_s``; the run then stops with its first line as the error and the rest printed above it.
"""

from __future__ import annotations

from typing import Any


def role_lines(gen_stats: list[dict[str, Any]], buf: dict[str, Any], learner_states: list[str]) -> list[str]:
    """One line per role: what it is doing."""
    lines = [f"learner {r}: {state}" for r, state in enumerate(learner_states)]
    for s in gen_stats:
        lines.append(f"generator {s.get('gen_id')}: version {s.get('version')}, {s.get('in_flight', 0)} group(s) in "
                     f"flight, {int(s.get('groups', 0))} put, reward errors {int(s.get('reward_errors', 0))}, "
                     f"reward timeouts {int(s.get('reward_timeouts', 0))}, env errors {int(s.get('env_errors', 0))}")
    drops = {k.removeprefix("buffer/dropped_"): v for k, v in buf.items()
             if k.startswith("buffer/dropped_") and k != "buffer/dropped_total" and v}
    lines.append(f"buffer: {buf.get('buffer/depth', '?')} held, {buf.get('buffer/awaiting_reward', 0)} awaiting a "
                 f"reward, version {buf.get('buffer/version', '?')}, admitted {buf.get('buffer/accepted', '?')} + "
                 f"{buf.get('buffer/running', '?')} running of {buf.get('buffer/capacity', '?')}, dropped {drops or 0}")
    return lines


def diagnose_stall(gen_stats: list[dict[str, Any]], buf: dict[str, Any], learner_states: list[str],
                   stalled_s: float) -> str:
    """The likely cause, in one line."""
    head = f"no learner step for {stalled_s:.0f} s"
    if not gen_stats:
        return f"{head}: no generator answers (all dead or restarting)"
    failed = sum(int(s.get("reward_errors", 0)) + int(s.get("reward_timeouts", 0)) for s in gen_stats)
    put = sum(int(s.get("groups", 0)) for s in gen_stats)
    if failed and failed >= put:
        return f"{head}: the reward sources failed {failed} time(s) and {put} group(s) were rewarded; check rewards.*"
    if int(buf.get("buffer/depth", 0)) > 0 or any(st.startswith("push") for st in learner_states):
        return (f"{head}: the learners have data ({buf.get('buffer/depth', 0)} group(s) held) but do not finish a "
                f"step (learner states: {', '.join(learner_states) or 'unknown'}); a rendezvous or weight push hangs")
    if int(buf.get("buffer/awaiting_reward", 0)) > 0:
        return f"{head}: {buf['buffer/awaiting_reward']} group(s) wait for late rewards that do not come"
    if all(int(s.get("in_flight", 0)) == 0 for s in gen_stats):
        return (f"{head}: generators have nothing in flight and the buffer is empty: admission is closed "
                f"(buffer version {buf.get('buffer/version', '?')}) or the prompt source is exhausted")
    return f"{head}: generators have groups in flight but none reached the buffer (environments or engines stuck)"
