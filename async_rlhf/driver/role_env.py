"""The plan stage's share of the roles' processes (pure: no Ray, no process started): what every role's
environment holds, whether the generators and learner ranks are forked from their node's fork server, and the Ray
a driver joins. Read by the launcher, the provision stage (``driver/provision.py``) and the start stage
(``driver/start_roles.py``); see the stages in ``driver/cluster.py``."""

from __future__ import annotations

import os
from typing import Any

from async_rlhf.config import Config
from async_rlhf.generator.engine_args import engine_env

ROLE_ENV = {"TOKENIZERS_PARALLELISM": "false"}
"""What every role's environment holds (a run across nodes adds its network mode and keys, the start-up watch its
board)."""


def joined_address(address: str | None) -> str | None:
    """The Ray a driver joins: ``address``, else ``RAY_ADDRESS`` (under ``ray job submit``: the job's cluster);
    None: it starts its own (unless this process has one already)."""
    return address or os.environ.get("RAY_ADDRESS") or None


def forks_roles(cfg: Config) -> bool:
    """Whether the generators and learner ranks are forked from their node's fork server (``run.fork_workers``
    on a CPU run)."""
    res = cfg.resources
    return cfg.run.fork_workers and res.generator_gpus == 0 and res.learner_gpus == 0


def role_runtime_env(cfg: Config, env_vars: dict[str, str]) -> dict[str, Any]:
    """A generator's or learner rank's Ray runtime environment: ``env_vars``, and on a CPU run with
    ``run.fork_workers`` the worker forked from its node's preloaded process (startup/forkserver.py; the buffer
    and the node probe import little and start as Ray starts them)."""
    out: dict[str, Any] = {"env_vars": dict(env_vars)}
    if forks_roles(cfg):
        from async_rlhf.startup import forkserver

        out["py_executable"] = forkserver.command()
    return out


def generator_env(cfg: Config, role_env: dict[str, str]) -> dict[str, Any]:
    return role_runtime_env(cfg, {**role_env, **engine_env(cfg)})


def learner_env(cfg: Config, role_env: dict[str, str]) -> dict[str, Any]:
    return role_runtime_env(cfg, {**role_env, "OMP_NUM_THREADS": str(cfg.learner.threads)})
