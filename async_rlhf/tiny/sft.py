"""SFT warm start of the tiny policy, batched greedy evaluation, and the on-disk cache the demo starts from.

Two teachers, one after the other. For the first half of the steps (``TaskConfig.sft_clean_share``) a correct
teacher: the student learns to add, carry included. Then a sloppy teacher who forgets every carry 65% of the
time (and is right otherwise) joins. The student keeps the carry and learns to forget it: its greedy answers
follow the majority, the carry-free one, so it is right only on problems without a carry (~27% of the held-out
split), while temperature-1 samples are right ~50% of the time. GRPO with the exact-answer reward gets a
signal from the first step and ~70 points of headroom, and only has to promote a procedure the policy knows.

Why the correct teacher comes first (issue 47): with the sloppy teacher from the start (600 steps), the carry
from the units into the tens was learned on some seeds only. Probed with the correct hundreds digit given,
P(tens digit with a spurious carry | no carry) was 0.07-0.20 and P(correct tens | units carry, no tens carry)
0.17-0.25 against the teacher's 0 and 0.35, and the demo ended between 0.69 and 0.99 over seeds (many runs at
0.7-0.8, stuck on that carry). With the correct teacher first (1200 steps, ~45 s on one thread): 0.001 and
0.34-0.38 on the seeds probed, sampled accuracy 0.50 against 0.38-0.40, greedy unchanged (0.275-0.28).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from async_rlhf.config import TaskConfig
from async_rlhf.env.arithmetic import AdditionTask, Problem, score_completion
from async_rlhf.env.longtail import LongTailTask
from async_rlhf.tiny import cache
from async_rlhf.tiny.cache import INFO_FILE, SFT_BATCH_SIZE, SFT_LR
from async_rlhf.tiny.model import build_tiny_model
from async_rlhf.tiny.tokenizer import load_tokenizer, save_tokenizer

logger = logging.getLogger(__name__)

SFT_FORGET_CARRY = 0.65
"""Default share of SFT targets from the sloppy, carry-forgetting teacher (``TaskConfig.sft_forget_carry``)."""
SFT_CLEAN_SHARE = 0.5
"""Default share of the SFT steps, first, taught by the correct teacher alone (``TaskConfig.sft_clean_share``)."""
SFT_STATS_FILE = "sft_stats.json"


def sloppy_rate(step: int, steps: int, forget_carry: float, clean_share: float) -> float:
    """The sloppy teacher's share of SFT step ``step`` (1-based): none during the first ``clean_share`` of the
    steps, ``forget_carry`` after them."""
    return 0.0 if step <= clean_share * steps else forget_carry


def _sft_batch(
    problems: Sequence[Problem], targets: Sequence[str], tok: PreTrainedTokenizerBase
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + target + eos; ``loss_mask`` marks the completion tokens (eos included)."""
    seqs: list[list[int]] = []
    n_prompt: list[int] = []
    for p, target in zip(problems, targets):
        prompt = tok.encode(p.prompt, add_special_tokens=False)
        seqs.append(prompt + tok.encode(target, add_special_tokens=False) + [tok.eos_token_id])
        n_prompt.append(len(prompt))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, n) in enumerate(zip(seqs, n_prompt)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        loss_mask[i, n : len(s)] = 1.0
    return ids, attn, loss_mask


def sft_start(base_dir: Path, lr: float, steps: int) -> tuple[PreTrainedModel, Any, Any]:
    """A directory's model (float32, training mode), its AdamW and the warm-up/decay schedule of a ``steps``-step
    SFT: what both warm starts (this module's and ``tool_sft.py``'s) train with."""
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps))
    return model, opt, sched


def _lr_factor(step: int, steps: int) -> float:
    """Warmup (20 steps), constant, then linear decay to 0 over the last 30%.

    Warmup: Adam's first steps are sign-SGD (full lr on every weight). Decay: the final weights settle on
    the teacher mixture instead of being a noisy snapshot, so the start accuracy is reproducible.
    """
    warmup = max(1, min(20, steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    decay_start = int(0.7 * steps)
    if step < decay_start:
        return 1.0
    return max(0.0, (steps - step) / max(1, steps - decay_start))


def _take(stream: Iterator[Problem], n: int) -> list[Problem]:
    return [next(stream) for _ in range(n)]


def sft_warm_start(
    base_dir: Path,
    out_dir: Path,
    task: AdditionTask,
    steps: int,
    batch_size: int = SFT_BATCH_SIZE,
    lr: float = SFT_LR,
    seed: int = 0,
    forget_carry: float = SFT_FORGET_CARRY,
    clean_share: float = SFT_CLEAN_SHARE,
) -> Path:
    """Supervised fine-tuning on ``task``'s train stream (loss on completion + eos only); saves a HF dir.

    The teacher is sloppy: with probability ``forget_carry`` an example's target is the carry-free answer
    (:meth:`AdditionTask.carry_free_answer`) instead of the sum. The student learns both procedures and,
    with ``forget_carry`` > 0.5, greedy decoding follows the sloppy one: it is right on the ~30% of problems
    without a carry, while sampling still finds the correct sum about ``1 - forget_carry`` of the time.
    GRPO with the exact-answer reward then has an immediate, dense signal and a large headroom. A partially
    trained correct-only SFT was the alternative; it starts at similar greedy accuracy but samples
    correct answers far more rarely, and GRPO improved it much less (and it was very seed dependent).
    """
    base_dir, out_dir = Path(base_dir), Path(out_dir)
    tok = load_tokenizer(base_dir)
    model, opt, sched = sft_start(base_dir, lr, steps)
    stream = task.train_problems(seed)
    teacher = random.Random(f"sloppy-teacher-{seed}")
    sloppy = getattr(task, "sloppy_answer", None) or task.carry_free_answer  # the long-tail task names its own
    log_every = max(1, min(50, steps // 10))
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(1, steps + 1):
            problems = _take(stream, batch_size)
            forget = sloppy_rate(step, steps, forget_carry, clean_share)
            targets = [
                sloppy(p) if teacher.random() < forget else task.completion_target(p)
                for p in problems
            ]
            ids, attn, loss_mask = _sft_batch(problems, targets, tok)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            mask = loss_mask[:, 1:]
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % log_every == 0 or step == steps:
                logger.info(
                    "sft step %d/%d loss %.4f (%.1f s)", step, steps, loss.item(), time.perf_counter() - t0
                )
    model.eval()
    seconds = time.perf_counter() - t0
    stats = {"sft_seconds": seconds, **evaluate_policy(model, tok, task)}
    logger.info(
        "sft done: %d steps in %.1f s; held-out greedy accuracy %.3f, sampled (T=1) accuracy %.3f",
        steps, seconds, stats["heldout_greedy_accuracy"], stats["heldout_sampled_accuracy"],
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    save_tokenizer(tok, out_dir)
    (out_dir / SFT_STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return out_dir


def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    samples: int = 4,
    seed: int = 0,
) -> dict[str, float]:
    """Held-out greedy accuracy, plus accuracy of temperature-1 samples (what GRPO starts from)."""
    held = task.heldout()
    if not held:
        return {"heldout_greedy_accuracy": 0.0, "heldout_sampled_accuracy": 0.0}
    gen = torch.Generator().manual_seed(seed)
    prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in held for _ in range(samples)]
    max_new = max(6, task.max_answer_chars + 1)
    outs = generate_batch(
        model, prompts, max_new, tokenizer.pad_token_id, tokenizer.eos_token_id, temperature=1.0, generator=gen
    )
    sampled = sum(
        score_completion(held[i // samples], tokenizer.decode(o, skip_special_tokens=True))
        for i, o in enumerate(outs)
    )
    return {
        "heldout_greedy_accuracy": greedy_accuracy(model, tokenizer, held, max_new),
        "heldout_sampled_accuracy": sampled / len(outs),
    }


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_id: int | Sequence[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Left-padded batched decoding (greedy when ``temperature`` is 0); each output stops after its eos
    (``eos_id``: one id, or every stop token of the model's generation config).

    Positions count from 0 at each row's first real token, exactly as for an unpadded prompt (and in vLLM).
    No KV cache: prompts and completions are a dozen tokens, so recomputing is cheap and simple.
    """
    n = len(prompt_ids)
    if n == 0:
        return []
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError("empty prompt")
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attn[i, width - len(p) :] = 1
    device = next(model.parameters(), torch.empty(0)).device  # the driver may evaluate on a GPU (learner/device.py)
    ids, attn = ids.to(device), attn.to(device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.long, device=device)
    out: list[list[int]] = [[] for _ in range(n)]
    for _ in range(max_new_tokens):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        picked = nxt.tolist()
        for i in torch.nonzero(~done).flatten().tolist():
            out[i].append(int(picked[i]))
        done |= torch.isin(nxt, stops)
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
        attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long, device=device)], dim=1)
    return out


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    max_new_tokens: int = 6,
    batch_size: int = 256,
) -> float:
    """Fraction of ``problems`` whose greedy completion earns reward 1 (the task's reward rule)."""
    if not problems:
        return 0.0
    was_training = model.training
    model.eval()
    correct = 0.0
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            prompts = [tokenizer.encode(p.prompt, add_special_tokens=False) for p in chunk]
            outs = generate_batch(
                model, prompts, max_new_tokens, tokenizer.pad_token_id, tokenizer.eos_token_id
            )
            for p, o in zip(chunk, outs):
                correct += score_completion(p, tokenizer.decode(o, skip_special_tokens=True))
    finally:
        model.train(was_training)
    return correct / len(problems)


def prepare_tiny_policy(cache_root: Path, task_cfg: TaskConfig, seed: int = 0) -> Path:
    """Build the tiny model and its SFT warm start once; later calls with the same settings return at once.

    ``seed`` drives initialisation and the SFT data order; the held-out split is always the default one
    (``AdditionTask(digits, heldout_size)``, task seed 0), which the SFT never trains on.
    Result: ``cache_root/tiny-<hash>/``, a Hugging Face directory (model, tokenizer, generation config) plus
    ``tiny_info.json`` (settings, held-out greedy accuracy, build time). It is built in a temporary directory
    and renamed into place, so the directory exists only when complete.
    """
    if task_cfg.name not in ("addition", "longtail"):
        raise ValueError(f"the tiny policy is built for the addition and longtail tasks, not {task_cfg.name!r}")
    final = cache.policy_dir(cache_root, task_cfg, seed)  # cache_root/tiny-<digest>
    if (final / INFO_FILE).exists():
        return final
    settings = cache.tiny_settings(task_cfg, seed)
    cache_root = Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    with cache.file_lock(cache_root / f".{final.name}.lock"):
        if (final / INFO_FILE).exists():
            return final
        logger.info(
            "building the tiny policy into %s (one-off: %d SFT steps, the first %.0f%% by the correct teacher, "
            "then sloppy-teacher rate %.2f)",
            final, task_cfg.sft_steps, 100 * settings["sft_clean_share"], settings["sft_forget_carry"],
        )
        t0 = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=cache_root))
        try:
            # The canonical held-out split (task seed 0) whatever ``seed`` is: the run evaluates on it.
            task = (LongTailTask(heldout_size=task_cfg.heldout_size) if task_cfg.name == "longtail"
                    else AdditionTask(digits=task_cfg.digits, heldout_size=task_cfg.heldout_size))
            base = build_tiny_model(staging / "base", seed=seed)
            policy = staging / "policy"
            sft_warm_start(
                base, policy, task, steps=task_cfg.sft_steps, seed=seed,
                forget_carry=settings["sft_forget_carry"], clean_share=settings["sft_clean_share"],
            )
            stats = json.loads((policy / SFT_STATS_FILE).read_text())
            acc = stats["heldout_greedy_accuracy"]
            info = {"settings": settings, **stats, "build_seconds": time.perf_counter() - t0}
            (policy / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            if final.exists():  # a stale, incomplete directory from a crash of an older layout
                shutil.rmtree(final)
            os.rename(policy, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info(
            "tiny policy ready in %.1f s: %s (held-out greedy accuracy %.3f)",
            info["build_seconds"], final, acc,
        )
    return final


def read_tiny_info(policy_dir: Path) -> dict[str, Any]:
    """The ``tiny_info.json`` written by :func:`prepare_tiny_policy`."""
    return json.loads((Path(policy_dir) / INFO_FILE).read_text())
