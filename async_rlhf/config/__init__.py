"""Typed run configuration: one pydantic model per component (each key's rule on its field), YAML
files plus ``key=value`` overrides.

    sections.py  model, task, rewards, prompts and training (objective, PPO, DPO)
    roles.py     generator, learner, buffer, sync, run, resources, and the whole Config
    fields.py    the pydantic base and the rule types a field carries (ranges; choices are Literal)
    rules.py     checks that span keys, and validate()
    checks.py    reward, algorithm, environment and path checks
    model_limits.py  a user's --model: its context window and completion length
    loading.py   YAML files and key=value overrides -> a validated Config
    secrets.py   the keys holding secrets: masked in config.json, given again from the environment on resume

This module imports no torch, ray or vllm: the launcher validates a configuration (and refuses bad
input with one clear line) before anything heavy starts.

    cfg = load_config("run.yaml", ["train.steps=200", "generator.temperature=0.8"])
"""

from __future__ import annotations

from async_rlhf.config.agent import AgentConfig  # noqa: F401
from async_rlhf.config.checks import (  # noqa: F401
    REPORT_TARGETS,
    REWARD_SOURCES,
    check_algorithm,
    check_env,
    check_lora,
    check_model_dir,
    check_reward_model_dir,
    parse_report_to,
    parse_reward_models,
    parse_reward_sources,
)
from async_rlhf.config.errors import (  # noqa: F401
    ConfigError,
)
from async_rlhf.config.fields import (  # noqa: F401
    AboveZero,
    AtLeastOne,
    Count,
    NonNegative,
    Port,
    Section,
    check_fields,
    choices,
)
from async_rlhf.config.loading import (  # noqa: F401
    load_config,
    make_paths_absolute,
)
from async_rlhf.config.model_limits import (  # noqa: F401
    model_limits_line,
    resolve_model_limits,
)
from async_rlhf.config.roles import (  # noqa: F401
    BufferConfig,
    Config,
    GeneratorConfig,
    LearnerConfig,
    ResourcesConfig,
    RunConfig,
    SyncConfig,
)
from async_rlhf.config.rules import (  # noqa: F401
    drops_zero_advantage,
    parse_custom_resources,
    push_min_gbps,
    validate,
)
from async_rlhf.config.sections import (  # noqa: F401
    DPOConfig,
    LoraConfig,
    ModelConfig,
    ObjectiveConfig,
    PPOConfig,
    PromptsConfig,
    RewardsConfig,
    TaskConfig,
    TrainConfig,
)
