"""Wires a generator's agent side from the configuration (the generator actor calls :func:`serve_agents`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def episodes_per_generator(cfg: Any) -> int:
    """agent.episodes_per_generator, or every episode of the groups a generator keeps in flight."""
    return int(cfg.agent.episodes_per_generator or cfg.generator.groups_in_flight * cfg.train.group_size)


def serve_agents(task_env: Any, cfg: Any, tokenizer: Any, stop_ids: list[int], policy: Any, model_path: str) -> Any:
    """The generator's environment for task.name=agent: an ``AgentEnv`` over ``task_env`` (the agent's task), its
    endpoint and agent thread started (``serving.AgentServer``)."""
    from async_rlhf.agent.environment import AgentEnv, template_kwargs
    from async_rlhf.agent.episodes import EpisodeRegistry
    from async_rlhf.agent.policy_engine import PolicyEngine
    from async_rlhf.agent.serving import AgentServer, load_agent
    from async_rlhf.endpoints import listen_host

    a = cfg.agent
    if a.task == "calculator":  # the tool-use variant of addition: same problems, its own held-out scoring
        from async_rlhf.env.calculator import CalculatorEnv

        task_env = CalculatorEnv(task_env.task)
    registry = EpisodeRegistry(tokenizer, timeout_s=a.timeout_s, stop_token_ids=stop_ids,
                               chat_template_kwargs=template_kwargs(a.chat_template, tokenizer),
                               tool_parser=a.tool_parser, auto_open=False)
    engine = PolicyEngine(policy, cfg.generator.temperature)
    server = AgentServer(registry, engine, Path(model_path).name or "policy", load_agent(a.entry), listen_host(),
                         episodes_per_generator(cfg), request_timeout_s=a.timeout_s + 30.0)
    env = AgentEnv(task_env, a.on_timeout, a.timeout_reward)
    env.serve(server)
    return env
