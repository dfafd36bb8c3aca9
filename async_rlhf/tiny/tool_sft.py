"""The SFT warm start of the tiny tool policy (``agent.task=calculator``), and its on-disk cache.

Two teachers over whole tool episodes (loss on the assistant turns only: the calls, the answers and their eos;
the prompt and the tool's results are mask 0), like the addition warm start (``async_rlhf.tiny.sft``):

    first TOOL_CLEAN_SHARE of the steps   correct teacher: calls the calculator on TOOL_CALL_SHARE of the
                                          problems and answers with its result, else answers from memory, right
    then                                  sloppy teacher: calls it as often, else answers from memory and forgets
                                          every carry TOOL_FORGET_CARRY of the time

    tool episode     12+34=  <tool_call>12+34</tool_call></s>  <tool_response>46</tool_response>  046</s>
                     mask 0  mask 1                            mask 0                             mask 1
    memory answer    12+34=  046</s>      (sloppy: 17+25= 032</s>)

Greedy, the student answers from memory (the majority) and forgets the carry, so it is right only where there is
none; sampled, it calls the tool about TOOL_CALL_SHARE of the time, and a call is almost always right. GRPO with
the agent's exact-answer reward then finds that calling pays, and the greedy policy learns to call.

    prepare_tool_policy(cache_root, task_cfg, seed)  ->  cache_root/tiny-tool-<hash of tool_settings>/
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from async_rlhf.tiny.cache import (
    HIDDEN_SIZE,
    INFO_FILE,
    INTERMEDIATE_SIZE,
    MAX_POSITIONS,
    NUM_HEADS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    SFT_BATCH_SIZE,
    SFT_LR,
    file_lock,
)

logger = logging.getLogger(__name__)

TOOL_FORMAT_VERSION = 1
"""Bump when the tool tokenizer, template, teachers or SFT recipe change: it invalidates cached builds."""
TOOL_SFT_STEPS = 600
"""~55 CPU-s on one thread for the whole build (model, SFT, its held-out figures); 800 steps gave the same figures."""
TOOL_CALL_SHARE = 0.3
TOOL_FORGET_CARRY = 0.65
TOOL_CLEAN_SHARE = 0.5


def tool_settings(task_cfg: Any, seed: int = 0) -> dict[str, Any]:
    """Everything the cached tool warm start depends on; its hash names the cache directory."""
    from async_rlhf.tiny.tool_policy import CHAT_TEMPLATE, TOOL_TOKENS  # (no torch)

    template = hashlib.sha256(json.dumps([CHAT_TEMPLATE, TOOL_TOKENS]).encode()).hexdigest()[:12]
    return {
        "format_version": TOOL_FORMAT_VERSION, "task": "calculator", "digits": task_cfg.digits, "template": template,
        "heldout_size": task_cfg.heldout_size, "sft_steps": TOOL_SFT_STEPS, "sft_batch_size": SFT_BATCH_SIZE,
        "sft_lr": SFT_LR, "call_share": TOOL_CALL_SHARE, "forget_carry": TOOL_FORGET_CARRY,
        "clean_share": TOOL_CLEAN_SHARE, "seed": seed,
        "arch": [HIDDEN_SIZE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE_SIZE, MAX_POSITIONS],
    }


def tool_policy_dir(cache_root: Path, task_cfg: Any, seed: int = 0) -> Path:
    digest = hashlib.sha256(json.dumps(tool_settings(task_cfg, seed), sort_keys=True).encode()).hexdigest()[:12]
    return Path(cache_root) / f"tiny-tool-{digest}"


def cached_tool_policy(cache_root: Path, task_cfg: Any, seed: int = 0) -> Path | None:
    """The finished build of these settings, or None (without importing torch)."""
    final = tool_policy_dir(cache_root, task_cfg, seed)
    return final if (final / INFO_FILE).exists() else None


def episode(tok: Any, problem: Any, answer: str | None) -> tuple[list[int], list[int]]:
    """One teacher episode's ids and loss mask: ``answer`` None calls the calculator and answers with its
    result; else answers ``answer`` from memory. The ids are the chat template's rendering of the episode."""
    from async_rlhf.env.calculator import calculate, call_text, response_text

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    eos = tok.eos_token_id
    ids = enc(problem.prompt)
    mask = [0] * len(ids)
    if answer is None:
        expression = problem.prompt.rstrip("=")
        call = enc(call_text(expression)) + [eos]
        result = enc(response_text(calculate(expression)))
        ids += call + result
        mask += [1] * len(call) + [0] * len(result)
        answer = problem.answer
    final = enc(answer) + [eos]
    return ids + final, mask + [1] * len(final)


def teacher_batch(tok: Any, problems: Sequence[Any], task: Any, rng: random.Random, sloppy: bool,
                  call_share: float = TOOL_CALL_SHARE, forget_carry: float = TOOL_FORGET_CARRY
                  ) -> list[tuple[list[int], list[int]]]:
    """The teacher's episodes for ``problems`` (``sloppy``: the second teacher)."""
    out = []
    for p in problems:
        if rng.random() < call_share:
            out.append(episode(tok, p, None))
        elif sloppy and rng.random() < forget_carry:
            out.append(episode(tok, p, task.carry_free_answer(p)))
        else:
            out.append(episode(tok, p, p.answer))
    return out


def tool_sft(base_dir: Path, out_dir: Path, task: Any, steps: int = TOOL_SFT_STEPS, seed: int = 0) -> dict[str, Any]:
    """Supervised fine-tuning of ``base_dir`` by the two teachers; saves the policy to ``out_dir`` and returns its
    figures (held-out greedy accuracy and tool share by :func:`play_greedy`, and sampled)."""
    import torch
    import torch.nn.functional as F

    from async_rlhf.tiny.sft import sft_start
    from async_rlhf.tiny.tokenizer import save_tokenizer
    from async_rlhf.tiny.tool_policy import play_greedy
    from async_rlhf.tokenizer import load_tokenizer

    tok = load_tokenizer(base_dir)
    model, opt, sched = sft_start(base_dir, SFT_LR, steps)
    stream = task.train_problems(seed)
    rng = random.Random(f"tool-teacher-{seed}")
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(1, steps + 1):
            problems = [next(stream) for _ in range(SFT_BATCH_SIZE)]
            batch = teacher_batch(tok, problems, task, rng, sloppy=step > TOOL_CLEAN_SHARE * steps)
            width = max(len(ids) for ids, _ in batch)
            ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.float32)
            for i, (s, m) in enumerate(batch):
                ids[i, :len(s)] = torch.tensor(s)
                attn[i, :len(s)] = 1
                mask[i, :len(s)] = torch.tensor(m, dtype=torch.float32)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 100 == 0 or step == steps:
                logger.info("tool sft step %d/%d loss %.4f (%.1f s)", step, steps, loss.item(),
                            time.perf_counter() - t0)
    model.eval()
    seconds = time.perf_counter() - t0
    held = task.heldout()
    greedy = play_greedy(model, tok, held)
    sampled = play_greedy(model, tok, held, temperature=1.0)
    stats = {"sft_seconds": seconds, "heldout_greedy_accuracy": greedy["accuracy"],
             "heldout_greedy_tool_share": greedy["tool_share"], "heldout_sampled_accuracy": sampled["accuracy"],
             "heldout_sampled_tool_share": sampled["tool_share"]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    save_tokenizer(tok, out_dir)
    return stats


def prepare_tool_policy(cache_root: Path, task_cfg: Any, seed: int = 0) -> Path:
    """Build the tiny tool policy and its warm start once (``cache_root/tiny-tool-<hash>``, renamed into place
    when complete, ``tiny_info.json`` last); later calls return at once. The held-out split is the addition
    task's canonical one, which the SFT never trains on."""
    from async_rlhf.env.arithmetic import AdditionTask
    from async_rlhf.tiny.tool_policy import build_tool_model

    final = tool_policy_dir(cache_root, task_cfg, seed)
    if (final / INFO_FILE).exists():
        return final
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_root / f".{final.name}.lock"):
        if (final / INFO_FILE).exists():
            return final
        t0 = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_root))
        try:
            task = AdditionTask(digits=task_cfg.digits, heldout_size=task_cfg.heldout_size)
            base = build_tool_model(staging / "base", seed=seed)
            policy = staging / "policy"
            stats = tool_sft(base, policy, task, seed=seed)
            info = {"settings": tool_settings(task_cfg, seed), **stats, "build_seconds": time.perf_counter() - t0}
            (policy / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(policy, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("tiny tool policy ready in %.1f s: %s (held-out greedy accuracy %.3f, tool share %.3f)",
                    info["build_seconds"], final, stats["heldout_greedy_accuracy"], stats["heldout_greedy_tool_share"])
    return final
