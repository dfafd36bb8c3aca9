"""A reward model served by Ray actors: a Hugging Face sequence classifier (num_labels=1), batched.

    generator g --score.remote(texts)--> RewardModelServer k (async Ray actor)
                                           requests arriving within ``wait_s`` are merged, up to
                                           ``max_batch`` texts per forward, run on a thread

The actors are named per model directory (``get_if_exists``): every generator of a run shares them, and the
first generator to ask creates them. Scores are ``logits[:, 0]`` of the last non-padding token (the
classifier's own pooling), computed on ``prompt + completion``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from async_rlhf.env.base import Prompt
from async_rlhf.rewards.base import RewardSource, check_rewards


def load_classifier_tokenizer(model_dir: str) -> Any:
    """The directory's own tokenizer (``async_rlhf.tokenizer.load_tokenizer``)."""
    from async_rlhf.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


class RewardModelScorer:
    """The model and its tokenizer in this process; ``score(texts)`` in batches of at most ``max_batch``."""

    def __init__(self, model_dir: str, max_batch: int = 64, threads: int = 1) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_dir} has {self.model.config.num_labels} labels; a reward model needs 1")
        self.tokenizer = load_classifier_tokenizer(model_dir)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_batch = max_batch

    def score(self, texts: Sequence[str]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(texts), self.max_batch):
            chunk = list(texts[start:start + self.max_batch])
            enc = self.tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            with self.torch.no_grad():
                logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
            out += logits[:, 0].float().tolist()
        return out


class RewardModelServer:
    """Async Ray actor around :class:`RewardModelScorer` that merges concurrent requests into one forward."""

    def __init__(self, model_dir: str, max_batch: int = 64, wait_s: float = 0.005) -> None:
        self.scorer = RewardModelScorer(model_dir, max_batch)
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._queue: list[tuple[list[str], asyncio.Future[list[float]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        self.texts = 0

    async def score(self, texts: list[str]) -> list[float]:
        fut: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._queue.append((texts, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        await asyncio.sleep(self.wait_s)
        while self._queue:
            take, size = [], 0
            while self._queue and (not take or size + len(self._queue[0][0]) <= self.max_batch):
                item = self._queue.pop(0)
                take.append(item)
                size += len(item[0])
            flat = [t for texts, _ in take for t in texts]
            try:
                scores = await asyncio.to_thread(self.scorer.score, flat)
            except Exception as exc:  # every waiter hears about it; the actor stays up
                for _, fut in take:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.batches += 1
            self.texts += len(flat)
            pos = 0
            for texts, fut in take:
                if not fut.done():
                    fut.set_result(scores[pos:pos + len(texts)])
                pos += len(texts)

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "texts": self.texts}


def server_name(model_dir: str, index: int) -> str:
    digest = hashlib.sha1(str(Path(model_dir).resolve()).encode()).hexdigest()[:10]
    return f"async_rlhf_reward_model_{digest}_{index}"


def reward_model_actors(model_dir: str, count: int, max_batch: int) -> list[Any]:
    """The run's reward-model actors, created by the first caller (named, shared by every generator)."""
    import ray

    cls = ray.remote(RewardModelServer)
    return [cls.options(name=server_name(model_dir, i), get_if_exists=True, num_cpus=0, max_concurrency=1000,
                        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(model_dir, max_batch)
            for i in range(count)]


class RewardModelSource(RewardSource):
    """Scores ``prompt + completion`` on the reward-model actors, round robin over them."""

    name = "model"

    def __init__(self, actors: Sequence[Any]) -> None:
        if not actors:
            raise ValueError("RewardModelSource needs at least one reward-model actor")
        self.actors = list(actors)
        self._next = itertools.cycle(range(len(self.actors)))

    async def score(self, prompt: Prompt, completions: Sequence[str]) -> list[float]:
        actor = self.actors[next(self._next)]
        values = await actor.score.remote([prompt.text + c for c in completions])
        return check_rewards(values, len(completions), "reward model")
