"""A reward model served by Ray actors: a Hugging Face sequence classifier (num_labels=1), batched.

    generator g --score.remote(texts)--> RewardModelServer k (async Ray actor)
                                           requests arriving within ``wait_s`` are merged, up to
                                           ``max_batch`` texts per forward, run on a thread

Who owns them: the driver. Ray ends a non-detached actor when the process that created it ends, so actors a
generator created died with that generator (a generator killed, restarted or scaled down took every other
generator's rewards with it; issue 44). ``Cluster`` starts them at start-up (:func:`start_reward_models`) and
kills them at close; each generator (and the driver's held-out evaluation) finds them by name
(:func:`reward_model_actors`), named after the run directory, the model directory and an index, in the run's Ray
namespace:

    driver --start_reward_models--> RewardModelServer 0..k-1  (owned by the driver: live as long as the run)
    generator g --reward_model_actors (by name)--^           a generator's restart or end leaves them up

Scores are ``logits[:, 0]`` of the last non-padding token (the classifier's own pooling), computed on
``prompt + completion``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

from async_rlhf.config import Config, parse_reward_sources
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


def server_name(model_dir: str, index: int, scope: str = "") -> str:
    """The name of reward-model actor ``index`` of ``model_dir`` for the run ``scope`` (its run directory): the
    driver and every generator compute it from the same config (paths as given, never resolved where they run)."""
    digest = hashlib.sha1(f"{scope}\n{model_dir}".encode()).hexdigest()[:12]
    return f"async_rlhf_reward_model_{digest}_{index}"


def actor_names(cfg: Config) -> list[str]:
    """The run's reward-model actor names (``rewards.model_actors`` of them)."""
    r = cfg.rewards
    return [server_name(r.model_path, i, cfg.run.dir) for i in range(r.model_actors)]


def uses_reward_model(cfg: Config) -> bool:
    """Whether ``rewards.sources`` names the ``model`` source."""
    return "model" in [name for name, _ in parse_reward_sources(cfg.rewards.sources)]


class RewardModelActors:
    """The run's reward-model actors as the driver holds them: it created them, so they live as long as it does
    (or until :meth:`close`), whatever happens to the generators that score on them."""

    def __init__(self, names: list[str], handles: list[Any]) -> None:
        self.names, self.handles = names, handles

    def close(self, wait_s: float = 10.0) -> None:
        """Kill them, and wait (up to ``wait_s``) until their names are free: a next run in this driver with the
        same run directory and model (tests run several) must start its own, not find these dying."""
        import ray

        for handle in self.handles:
            ray.kill(handle)
        deadline = time.monotonic() + wait_s
        for name in self.names:
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name)
                except ValueError:
                    break
                time.sleep(0.05)


def start_reward_models(cfg: Config) -> RewardModelActors | None:
    """In the driver, at start-up: the run's reward-model actors (None without a ``model`` reward source), owned
    by the driver. Their model loads while the rest starts; a score asked meanwhile waits for it."""
    if not uses_reward_model(cfg):
        return None
    import ray

    r = cfg.rewards
    cls = ray.remote(RewardModelServer)
    names = actor_names(cfg)
    handles = [cls.options(name=name, get_if_exists=True, num_cpus=0, max_concurrency=1000,
                           runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}).remote(r.model_path,
                                                                                        r.model_batch_size)
               for name in names]
    return RewardModelActors(names, handles)


class RewardModelsMissing(RuntimeError):
    """A role asked for reward-model actors the driver has not started (or has already killed)."""


def reward_model_actors(cfg: Config) -> list[Any]:
    """The run's reward-model actors, found by name. A role (a generator) never creates them: what it created
    would end with it. Only the driver itself may, where it asks before any ``Cluster`` started them (it owns
    them then, as ``Cluster`` does)."""
    import ray

    found = []
    for name in actor_names(cfg):
        try:
            found.append(ray.get_actor(name))
        except ValueError:
            if ray.get_runtime_context().worker.mode != ray.SCRIPT_MODE:
                raise RewardModelsMissing(
                    f"reward-model actor {name} ({cfg.rewards.model_path}) is not running: the driver starts them "
                    "(async_rlhf.rewards.model.start_reward_models, from Cluster) and a role only looks them up, "
                    "so that they outlive any one generator") from None
            started = start_reward_models(cfg)
            assert started is not None
            return started.handles
    return found


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
