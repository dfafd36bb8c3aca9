"""The user's held-out figure: ``prompts.eval_path`` generated greedily and scored by ``rewards.sources``.

    eval prompts (JSONL | Parquet, fields as prompts.path) --greedy--> completions --rewards.sources--> rewards
        eval/reward_mean = mean reward;  eval/accuracy = share of reward 1, only when every reward is 0 or 1

Measured three ways, all with the same sources as training: by the driver with transformers before and after
the run (``eval_reward_start``/``_end`` in summary.json: independent of vLLM and of the weight push), and on
generator 0 with vLLM every ``generator.eval_every`` versions (``eval/*`` records of metrics.jsonl).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from async_rlhf.config import Config
from async_rlhf.env.base import Prompt
from async_rlhf.rewards.base import Completion, RewardSource

BUILTIN_HELDOUT = ("addition", "longtail", "reward_model", "agent")
"""Tasks whose own held-out problems the launcher scores (accuracy_start/_end); any other task reports the
held-out figure of prompts.eval_path only, never another task's."""



def load_eval_prompts(cfg: Config) -> list[Prompt]:
    """The held-out prompts of ``prompts.eval_path`` (every record, in file order); [] without one."""
    if not cfg.prompts.eval_path:
        return []
    from async_rlhf.prompts.base import to_prompt
    from async_rlhf.prompts.files import load_records

    records = load_records(cfg.prompts.eval_path)
    if not records:
        raise ValueError(f"prompts.eval_path={cfg.prompts.eval_path} holds no records")
    return [to_prompt(r, cfg.prompts.text_field) for r in records]


def summarize(rewards: Sequence[float]) -> dict[str, float]:
    """``reward_mean``, and ``accuracy`` when every reward is 0 or 1 (a verifier's pass/fail)."""
    if not rewards:
        raise ValueError("no held-out rewards to summarize")
    out = {"reward_mean": sum(rewards) / len(rewards)}
    if all(r in (0.0, 1.0) for r in rewards):
        out["accuracy"] = out["reward_mean"]
    return out


async def score_completions(rewards: RewardSource, prompts: Sequence[Prompt],
                            completions: Sequence[Completion], timeout_s: float) -> dict[str, float]:
    """One completion per prompt, scored by the sources concurrently (late ones are awaited, up to
    ``timeout_s`` each); the figures of :func:`summarize`."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(completions)} completions for {len(prompts)} held-out prompts")

    async def one(p: Prompt, c: Completion) -> float:
        if rewards.immediate:
            return rewards.score_now(p, [c])[0]
        return (await asyncio.wait_for(rewards.score(p, [c]), timeout_s))[0]

    values = await asyncio.gather(*(one(p, c) for p, c in zip(prompts, completions)))
    return summarize([float(v) for v in values])


def greedy_completions(model: Any, tokenizer: Any, prompts: Sequence[Prompt], max_new_tokens: int,
                       batch_size: int = 64, stop_ids: Sequence[int] | None = None,
                       chat: Any = None) -> list[Completion]:
    """Greedy completions with transformers (independent of vLLM), each with its ids and finish reason.
    ``stop_ids``: the tokens that end a completion (default: the tokenizer's eos); ``chat``: the
    :class:`async_rlhf.prompts.chat.ChatRenderer` that already rendered ``prompts`` (it encodes them; default:
    the prompt text as is)."""
    from async_rlhf.tiny.sft import generate_batch

    stops = list(stop_ids) if stop_ids else [tokenizer.eos_token_id]
    out: list[Completion] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = [chat.encode(p) if chat is not None else tokenizer.encode(p.text, add_special_tokens=False)
               for p in chunk]
        for prompt_ids, toks in zip(ids, generate_batch(model, ids, max_new_tokens, tokenizer.pad_token_id, stops)):
            reason = "stop" if toks and toks[-1] in stops else "length"
            out.append(Completion(tokenizer.decode(toks, skip_special_tokens=True), toks, reason, prompt_ids))
    return out


def eval_figures(model_dir: str, cfg: Config) -> dict[str, float] | None:
    """The held-out figures of a Hugging Face model directory on ``prompts.eval_path`` (None without one).
    Runs in the driver; a ``model`` reward source needs Ray up (its actors score)."""
    prompts = load_eval_prompts(cfg)
    if not prompts:
        return None
    import torch

    from async_rlhf.env.registry import make_env
    from async_rlhf.eval_model import load_eval_model
    from async_rlhf.prompts.chat import ChatRenderer
    from async_rlhf.rewards.build import make_rewards
    from async_rlhf.tokenizer import load_tokenizer, stop_token_ids

    model = load_eval_model(model_dir, cfg.model.dtype)  # the GPU in the model's dtype if there is one
    tok = load_tokenizer(model_dir)
    chat = ChatRenderer(tok, cfg.prompts.chat_template, model_dir)
    prompts = [chat.render(p) for p in prompts]  # the reward sources see what the model was given
    with torch.no_grad():
        completions = greedy_completions(model, tok, prompts, cfg.generator.max_new_tokens,
                                         stop_ids=stop_token_ids(model_dir, tok), chat=chat)
    rewards = make_rewards(cfg, make_env(cfg.task))
    try:
        return asyncio.run(score_completions(rewards, prompts, completions, cfg.rewards.timeout_s))
    finally:
        rewards.close()


def heldout_label(cfg: Config) -> str:
    """What the progress line shows before the first held-out evaluation."""
    if cfg.prompts.eval_path:
        return "eval   -  "
    if cfg.task.name in BUILTIN_HELDOUT:
        return "held-out acc   -  "
    return "no held-out set"


def eval_label(ev: dict[str, Any]) -> str:
    """A generator's held-out evaluation, as the progress line shows it."""
    v = int(ev["version"])
    if "reward_mean" not in ev:
        return f"held-out acc {ev['accuracy']:.3f}@v{v}"
    if "accuracy" in ev:
        return f"eval acc {ev['accuracy']:.3f}@v{v}"
    return f"eval reward {ev['reward_mean']:.3f}@v{v}"


def eval_record(ev: dict[str, Any]) -> dict[str, Any]:
    """The metrics.jsonl record of a generator's held-out evaluation."""
    if "reward_mean" not in ev:
        return {"kind": "eval", "version": ev["version"], "eval/heldout_accuracy": ev["accuracy"]}
    return {"kind": "eval", "version": ev["version"], "eval/reward_mean": ev["reward_mean"],
            **({"eval/accuracy": ev["accuracy"]} if "accuracy" in ev else {})}


def eval_text(fig: dict[str, float]) -> str:
    """Figures of one held-out evaluation, as the launcher prints them."""
    acc = f", accuracy {fig['accuracy']:.3f}" if "accuracy" in fig else ""
    return f"held-out eval reward {fig['reward_mean']:.3f}{acc}"


def eval_summary(start: dict[str, float] | None, end: dict[str, float] | None) -> dict[str, float]:
    """summary.json's keys of the user's held-out set: eval_reward_start/_end, and eval_accuracy_start/_end
    when every reward of both evaluations is 0 or 1; none without a held-out set."""
    if start is None or end is None:
        return {}
    out = {"eval_reward_start": start["reward_mean"], "eval_reward_end": end["reward_mean"]}
    if "accuracy" in start and "accuracy" in end:
        out.update(eval_accuracy_start=start["accuracy"], eval_accuracy_end=end["accuracy"])
    return out


async def score_eval_set(version: int, rewards: Any, prompts: list[Any], completions: list[Completion],
                          timeout_s: float, done: Any) -> None:
    """Score one held-out evaluation with the reward sources, then ``done(version, figures | None, error)``.
    A module function, not a method: an ``async def`` on the actor class would make Ray run it as an asyncio
    actor, whose loop thread then clashes with the generator's own event loop."""
    try:
        figures = await score_completions(rewards, prompts, completions, timeout_s)
    except Exception as exc:  # noqa: BLE001 - reported by done()
        done(version, None, f"{type(exc).__name__}: {exc}")
        return
    done(version, figures)
