"""Prompts that leave no room in the context window (pure).

A prompt of ``len(ids) >= max_model_len`` tokens gets no completion at all (``EnginePolicy.generate`` returns an
empty turn, finish "length"): a single-turn group of it is ``group_size`` empty completions, which the reward
sources score as "" and the learner would train on (a per-sample reward model gives them different rewards) or
at least count as normal groups. With model.max_model_len at its default (64), a chat template and a system
prompt reach that on the first step. So::

    _draw (loop_phases.py)   encoded prompt too long?  passed over like the prompt filter's skips: the next group's
                             id names its position (stream.group_id ~n), the driver's ledger counts it used up
                             with that group; counted in ``prompts_too_long``
                             no prompt has fitted yet after STOP_AFTER?  PromptsTooLong: the run stops, fix named
    GroupRunner (groups.py)  a group started anyway (a re-issued prompt, nothing else ready) whose every rollout
                             had no room: dropped, reason ``prompt_too_long``, never put
    driver (runner.py)       ``rollout/prompts_too_long``, ``rollout/truncated`` (share of samples that
                             finished "length": legitimate, but a user should see it) and one warning line

Why stop rather than spin: a generator whose first STOP_AFTER prompts are all too long will most likely never
find one that fits (prompts of one task share their template and system prompt); the run would admit, pass over
and wait forever with no step and only a generic stall diagnosis minutes later. One that fitted once goes on,
passing the too-long ones over, with the warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STOP_AFTER = 64
"""Prompts a generator draws, none fitting, before the run stops with :class:`PromptsTooLong`."""


class PromptsTooLong(RuntimeError):
    """No prompt drawn so far fits the context window: the run stops (a restart would draw the same ones)."""


def context_len(cfg: Any) -> int:
    """The engine's context window in tokens (``engine_args.py``: generator.max_model_len, else the model's)."""
    return int(cfg.generator.max_model_len or cfg.model.max_model_len)


def fix_hint(context: int, longest: int) -> str:
    return (f"raise model.max_model_len (or generator.max_model_len; now {context}) to at least {longest + 1} plus "
            "the completion length, up to the model's max_position_embeddings, or shorten the prompts (system "
            "prompt, chat template)")


@dataclass
class PromptFit:
    """Whether encoded prompts fit ``context`` tokens; remembers the longest that did not, and stops a run where
    none has fitted after ``stop_after``."""

    context: int
    stop_after: int = STOP_AFTER
    seen_too_long: int = 0
    longest: int = 0
    fitted: bool = False

    def fits(self, ids: Sequence[int]) -> bool:
        if len(ids) < self.context:
            self.fitted = True
            return True
        self.seen_too_long += 1
        self.longest = max(self.longest, len(ids))
        if not self.fitted and self.seen_too_long >= self.stop_after:
            raise PromptsTooLong(
                f"the first {self.seen_too_long} prompts all leave no room in the context window "
                f"(a window of {self.context} tokens: generator.max_model_len, else model.max_model_len; prompts of "
                f"up to {self.longest} tokens after the chat template): nothing could be generated; "
                f"{fix_hint(self.context, self.longest)}")
        return False


def too_long_warning(gen_stats: Sequence[dict[str, Any]], context: int) -> str | None:
    """The driver's one-time warning once any generator passed over or dropped a too-long prompt."""
    n = sum(int(s.get("prompts_too_long", 0)) for s in gen_stats)
    if not n:
        return None
    longest = max(int(s.get("prompts_too_long_max_tokens", 0)) for s in gen_stats)
    return (f"warning: {n} prompt(s) of up to {longest} tokens leave no room in the context window "
            f"(max_model_len={context}): they are passed over, never trained (rollout/prompts_too_long); "
            f"{fix_hint(context, longest)}")


def rollout_figures(gen_stats: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``rollout/prompts_too_long`` (so far, all generators) and ``rollout/truncated``: the share of samples put
    that finished "length" (the prompt left fewer than max_new_tokens, or the completion reached it)."""
    if not gen_stats:
        return {}
    samples = sum(float(s.get("samples", 0.0)) for s in gen_stats)
    truncated = sum(float(s.get("samples_truncated", 0.0)) for s in gen_stats)
    return {"rollout/prompts_too_long": float(sum(float(s.get("prompts_too_long", 0)) for s in gen_stats)),
            "rollout/truncated": truncated / samples if samples else 0.0}
