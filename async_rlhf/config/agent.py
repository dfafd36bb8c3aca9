"""The ``agent`` section: the user's own agent code drives rollouts through the generators' OpenAI-compatible
endpoint (``task.name=agent``; async_rlhf/agent/, docs/agents.md)."""

from __future__ import annotations

from typing import Any, Literal

from async_rlhf.config.fields import AboveZero, Count, Section


class AgentConfig(Section):
    entry: str = "async_rlhf.agent.examples.addition:run"
    """The agent, ``async def run(task, client) -> float | dict``: module:function or /path/file.py:function. ``task``
    is the prompt's data (``prompt``, ``messages`` and the task's fields, e.g. ``answer``), ``client`` a stock
    ``openai.AsyncOpenAI`` whose base URL is this episode's; the return is the episode's reward (a number), or
    ``{"reward": r, "turn_rewards": [...]}`` with a reward per assistant turn."""
    task: Literal["addition", "calculator"] = "addition"
    """The task whose prompts the episodes start from, whose data the agent gets, and whose held-out problems measure
    accuracy (greedy, the first turn: the prompt the plain template renders is the task's own) | calculator: the
    tool-use variant of addition, whose policy (the tiny tool policy, with its chat template) may call a calculator
    tool (async_rlhf/env/calculator.py); unless set, it takes agent.entry=async_rlhf.agent.examples.calculator:run,
    agent.tool_parser=tiny_calculator and generator.max_new_tokens=10 (a call turn is 8 tokens). Its held-out accuracy
    plays the tool protocol."""
    episodes_per_generator: Count = 0
    """Agent episodes running at once on one generator; 0: generator.groups_in_flight x train.group_size."""
    timeout_s: AboveZero = 120.0
    """An episode's deadline from its start: later calls are refused (408, ``x-should-retry: false``) and the
    episode ends as ``timeout``; a call already sampling is finished and recorded."""
    on_timeout: Literal["train", "drop_group"] = "train"
    """A group with a timed-out episode: train (its turns are trained with the reward the agent returned, or
    agent.timeout_reward if it raised) | drop_group (the whole group is dropped, reason agent_timeout)."""
    timeout_reward: float = 0.0
    """The reward of a timed-out episode whose agent returned none (on_timeout=train)."""
    chat_template: str = "auto"
    """The chat template episodes are rendered with: auto (the model's own; a model without one, like the tiny
    policy, gets the plain template: message contents joined, an assistant turn closed by eos) | plain | a path to
    a .jinja file."""
    tool_parser: str = "hermes"
    """vLLM's tool-call parser for the model's format (``vllm serve --tool-call-parser`` names)."""


CALCULATOR_DEFAULTS = {("agent", "entry"): "async_rlhf.agent.examples.calculator:run",
                       ("agent", "tool_parser"): "tiny_calculator", ("generator", "max_new_tokens"): 10}
"""What ``task.name=agent agent.task=calculator`` needs on the tiny tool policy, where the user set nothing else."""


def apply_agent_defaults(cfg: Any) -> None:
    """The calculator task's settings for the keys the user left alone (so its command is just the task's name)."""
    if cfg.task.name != "agent" or cfg.agent.task != "calculator":
        return
    for (section, key), value in CALCULATOR_DEFAULTS.items():
        sec = getattr(cfg, section)
        if key not in sec.model_fields_set:
            setattr(sec, key, value)
