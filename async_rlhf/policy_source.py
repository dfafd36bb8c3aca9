"""The policy a run starts from, and its held-out figure: what the plan stage of a start-up works out about the
model before anything starts (``async_rlhf/driver/cluster.py`` draws the stages).

Outside ``driver/`` because ``prebuild`` (an install-time tool the learner imports for its ops) resolves the
same model: with these in ``driver/cluster.py`` the packages made a circle, driver -> learner -> prebuild ->
driver (issue 46). Imports config, env, tiny and the evaluation model only.
"""

from __future__ import annotations

import time
from pathlib import Path

from async_rlhf.config import Config


def resolve_model(cfg: Config, cache_root: Path) -> str:
    """The policy to start from: ``model.path``, or the tiny model with its SFT warm start (cached)."""
    if cfg.model.path:
        return str(Path(cfg.model.path).resolve())
    from async_rlhf.tiny.cache import cached_policy

    task = cfg.task
    if task.name == "agent" and cfg.agent.task == "calculator":  # the tiny tool policy (tiny/tool_sft.py)
        from async_rlhf.tiny.tool_sft import cached_tool_policy

        cached = cached_tool_policy(cache_root, task, seed=cfg.train.seed)
        if cached is not None:
            return str(cached)
        from async_rlhf.tiny.tool_sft import prepare_tool_policy

        return str(prepare_tool_policy(cache_root, task, seed=cfg.train.seed))
    if task.name not in ("addition", "longtail"):  # guess_number, reward_model, custom: the addition warm start
        task = task.model_copy(update={"name": "addition"})
    cached = cached_policy(cache_root, task, seed=cfg.train.seed)  # without importing torch and transformers
    if cached is not None:
        return str(cached)
    from async_rlhf.tiny.sft import prepare_tiny_policy

    return str(prepare_tiny_policy(cache_root, task, seed=cfg.train.seed))


def heldout_accuracy(model_dir: str, cfg: Config) -> float:
    """Greedy held-out accuracy of a Hugging Face model directory, with transformers (independent of vLLM)."""
    from async_rlhf.env.registry import make_task
    from async_rlhf.eval_model import load_eval_model
    from async_rlhf.tiny.sft import greedy_accuracy
    from async_rlhf.tokenizer import load_tokenizer

    model = load_eval_model(model_dir, cfg.model.dtype)  # the GPU in the model's dtype if there is one
    task = make_task(cfg.task)
    if cfg.task.name == "agent" and cfg.agent.task == "calculator":  # the tool protocol, played greedily
        from async_rlhf.tiny.tool_policy import TOOL_MAX_NEW_TOKENS, play_greedy

        max_new = max(cfg.generator.max_new_tokens, TOOL_MAX_NEW_TOKENS)
        return play_greedy(model, load_tokenizer(model_dir), task.heldout(), max_new)["accuracy"]
    return greedy_accuracy(model, load_tokenizer(model_dir), task.heldout(), cfg.generator.max_new_tokens)


def timed_heldout_accuracy(model_dir: str, cfg: Config) -> tuple[float, float]:
    """:func:`heldout_accuracy` and the seconds it took (what ``Cluster.heldout`` runs as a Ray task: its worker's
    output, the "nanobind: leaked ..." lines of its exit included, goes to run.dir/logs/heldout.log)."""
    from async_rlhf.run_logs import to_role_log

    to_role_log(cfg, "heldout")
    t0 = time.time()
    return heldout_accuracy(model_dir, cfg), time.time() - t0
