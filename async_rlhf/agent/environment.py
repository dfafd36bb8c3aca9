"""``task.name=agent``: the user's agent code plays each episode through the generator's endpoint; the episode's
ledger becomes the trained sample.

    GroupRunner (generator loop)      AgentEnv.rollout_group(prompt, ids, n, policy)
                                        n episodes at once:  open "<gid>-<k>" on the endpoint
                                                             run(task, client) on the agents' thread  -> reward
                                                             close: the ledger, once its calls are recorded
                                        each episode -> its trained branch (the one holding its last turn)
                                        group prompt  = the ids every branch shares before it samples
                                        check: every sampled id == the engine's output for that turn
      <- (prompt ids, trajectories) -> rewards (source task: the agent's, already on the trajectories) -> put

What an episode trains: its branch that holds the last recorded turn (the conversation the agent ended with), ids
as sampled, mask 1 exactly on sampled ids, each turn's behaviour log-probs and versions. A fork's other branches
are counted (``agent_forks``; their sampled ids in ``agent_untrained_tokens``), not trained: a group is
train.group_size samples, one per episode, so each episode's reward weighs the same.

The agent's return is the episode's reward: a number (on the branch's last sampled token), or
``{"reward": r, "turn_rewards": [...]}`` (one per turn of the trained branch, each on its turn's last token, plus
``r``). An agent that raises, or returns without calling the model, fails its group (counted in env_errors, the
prompt is issued again); a timed-out episode (agent.timeout_s) follows agent.on_timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator
from typing import Any

from async_rlhf.env.base import DropGroup, Environment, Policy, Prompt, Trajectory

log = logging.getLogger(__name__)

COUNTERS = ("agent_episodes", "agent_turns", "agent_tool_calls", "agent_tool_parse_errors", "agent_forks",
            "agent_timeouts", "agent_token_mismatch", "agent_retries", "agent_untrained_tokens", "agent_errors")
PLAIN_TEMPLATE = ("{%- for m in messages %}{{ m['content'] }}{%- if m['role'] == 'assistant' %}{{ eos_token }}"
                  "{%- endif %}{%- endfor %}")
"""agent.chat_template=plain, and auto for a model without a template (the tiny policy): the contents joined, an
assistant turn closed by eos. A one-message episode renders the task's own prompt text, so the warm start's
prompts are what the agent's first call sends."""


def template_kwargs(setting: str, tokenizer: Any) -> dict[str, Any]:
    """``apply_chat_template`` keywords for agent.chat_template (auto | plain | a .jinja path)."""
    from pathlib import Path

    if setting == "auto":
        return {} if getattr(tokenizer, "chat_template", None) else {"chat_template": PLAIN_TEMPLATE}
    if setting == "plain":
        return {"chat_template": PLAIN_TEMPLATE}
    path = Path(setting)
    if not path.is_file():
        raise ValueError(f"agent.chat_template={setting!r}: no such file; give auto, plain or a .jinja file")
    return {"chat_template": path.read_text()}


def episode_task(prompt: Prompt) -> dict[str, Any]:
    """What the agent's ``run(task, client)`` gets: the prompt's data, its text and its chat messages."""
    messages = prompt.messages or [{"role": "user", "content": prompt.text}]
    return {**prompt.data, "prompt": prompt.text, "messages": [dict(m) for m in messages]}


def split_return(value: Any, turns: int) -> tuple[float, list[float] | None]:
    """The agent's return -> (reward, per-turn rewards or None); ValueError naming what is wrong."""
    if isinstance(value, dict):
        reward = value.get("reward", 0.0)
        per_turn = value.get("turn_rewards")
        if per_turn is not None and len(per_turn) != turns:
            raise ValueError(f"the agent returned {len(per_turn)} turn_rewards for {turns} turns of its trained "
                             "conversation: give one per assistant turn")
    else:
        reward, per_turn = value, None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"the agent returned {value!r}: return the episode's reward as a finite number, or "
                         "{'reward': r, 'turn_rewards': [...]}")
    return float(reward), [float(r) for r in per_turn] if per_turn is not None else None


class AgentEnv(Environment):
    name = "agent"

    def __init__(self, task_env: Environment, on_timeout: str = "train", timeout_reward: float = 0.0) -> None:
        self.task_env = task_env
        self.on_timeout = on_timeout
        self.timeout_reward = timeout_reward
        self.server: Any = None
        """The generator's AgentServer (``serve``); None until the generator starts serving."""
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    def serve(self, server: Any) -> None:
        self.server = server

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    # the task's prompts and held-out problems; the reward is the agent's (already on the trajectory)
    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return self.task_env.train_prompts(seed)

    def heldout(self) -> list[Prompt]:
        return self.task_env.heldout()

    def verify(self, prompt: Prompt, completion: str) -> float:
        return 0.0

    def score_heldout(self, prompt: Prompt, completion: str) -> float:
        return self.task_env.score_heldout(prompt, completion)

    async def rollout(self, prompt: Prompt, prompt_ids: list[int], policy: Policy) -> Trajectory:
        raise RuntimeError("AgentEnv plays whole groups: GroupRunner calls rollout_group")

    async def rollout_group(self, gid: str, prompt: Prompt, prompt_ids: list[int], n: int,
                            policy: Policy) -> tuple[list[int], list[Trajectory]]:
        """The agent's episodes render their own prompts: ``prompt_ids`` and ``policy`` are not used (the endpoint
        reaches the engine through the server's PolicyEngine)."""
        if self.server is None:
            raise RuntimeError("task.name=agent but this generator serves no agent endpoint")
        self.server.engine.bind(asyncio.get_running_loop())
        episodes = await asyncio.gather(*(self._episode(prompt, f"{gid}-{k}") for k in range(n)))
        timed_out = [ep for ep, _, _ in episodes if ep.timed_out]
        if timed_out and (self.on_timeout == "drop_group" or any(not ep.ledger.turns_in_order() for ep in timed_out)):
            # (an episode that timed out before its first turn has nothing to train: its group goes either way)
            raise DropGroup("agent_timeout", f"an episode of group {gid} passed agent.timeout_s")
        failed = [(ep.episode_id, err) for ep, _, err in episodes if err is not None and not ep.timed_out]
        if failed:
            raise RuntimeError(f"the agent failed in episode {failed[0][0]}: {failed[0][1]!r}")
        from async_rlhf.agent.turns import common_prompt_len

        chosen = [self._trained_branch(ep) for ep, _, _ in episodes]
        p = common_prompt_len(chosen)
        if p == 0:
            raise RuntimeError(f"the episodes of group {gid} share no prompt token: start every episode of a task "
                               "with the same first message")
        trajs = []
        for (ep, value, err), branch in zip(episodes, chosen, strict=True):
            if err is not None:  # timed out, on_timeout=train
                value = self.timeout_reward
            reward, per_turn = split_return(value, len(branch.turns))
            trajs.append(self._trajectory(branch, p, reward, per_turn))
        return list(chosen[0].ids[:p]), trajs

    async def _episode(self, prompt: Prompt, eid: str) -> tuple[Any, Any, BaseException | None]:
        """Play one episode: (the closed Episode, the agent's return, the exception it raised or None)."""
        server = self.server
        await asyncio.wrap_future(server.open(eid))
        value, error = None, None
        try:
            value = await asyncio.wrap_future(server.run_agent(episode_task(prompt), eid))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: judged below, never taken down with
            error = exc
        ep, timed_out = await asyncio.wrap_future(server.close(eid))
        ep.timed_out = timed_out
        outputs = server.engine.take_outputs(eid)
        self._count(ep, outputs)
        if error is not None and not timed_out:
            self.counters["agent_errors"] += 1
            log.warning("agent episode %s raised %r", eid, error)
        return ep, value, error

    def _count(self, ep: Any, outputs: list[list[int]]) -> None:
        c, led = self.counters, ep.ledger.counters
        c["agent_episodes"] += 1
        c["agent_timeouts"] += ep.timed_out
        for name in ("turns", "tool_calls", "tool_parse_errors", "forks", "retries"):
            c[f"agent_{name}"] += led[name]
        turns, branches = ep.ledger.turns_in_order(), ep.ledger.branches()
        mismatch = abs(len(turns) - len(outputs))
        for turn, out in zip(turns, outputs):
            got = branches[turn.branch].ids[turn.start:turn.end]
            mismatch += sum(a != b for a, b in zip(got, out)) + abs(len(got) - len(out))
        c["agent_token_mismatch"] += mismatch + led["token_mismatch"]

    def _trained_branch(self, ep: Any) -> Any:
        turns = ep.ledger.turns_in_order()
        if not turns:
            raise RuntimeError(f"the agent of episode {ep.episode_id} returned without calling the model: every "
                               "episode must make at least one chat completion")
        branches = ep.ledger.branches()
        chosen = branches[turns[-1].branch]
        self.counters["agent_untrained_tokens"] += sum(sum(b.mask) for b in branches if b is not chosen)
        return chosen

    @staticmethod
    def _trajectory(branch: Any, p: int, reward: float, per_turn: list[float] | None) -> Trajectory:
        ids = branch.ids[p:]
        traj = Trajectory(token_ids=list(ids), logprobs=list(branch.logprobs[p:]), versions=list(branch.versions[p:]),
                          loss_mask=list(branch.mask[p:]), token_rewards=[0.0] * len(ids),
                          finish_reason=branch.turns[-1].engine_finish_reason,
                          text="".join(t.text for t in branch.turns), turns=len(branch.turns))
        for turn, r in zip(branch.turns, per_turn or [], strict=False):
            traj.token_rewards[turn.end - 1 - p] += r
        traj.reward_last_turn(reward)
        return traj


def agent_summary(generator_stats: list[dict[str, Any]]) -> dict[str, int]:
    """summary.json's agent figures: each counter summed over the generators (empty without agent episodes)."""
    if not any("agent_episodes" in s for s in generator_stats):
        return {}
    return {name: int(sum(float(s.get(name, 0)) for s in generator_stats)) for name in COUNTERS}
