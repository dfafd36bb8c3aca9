"""Generator actor: one vLLM engine, a prompt stream, and the loop that keeps requests in flight.

    loop (one thread; Ray calls such as request_update/stats run on other threads and only set flags)
    +-> weight update pending?  in_flight: load now, between two engine steps
    |                           drain: stop admitting, load once nothing is in flight
    |   fewer than groups_in_flight groups?  ask the buffer to admit more (staleness rule)
    |   held-out eval due (generator 0)?     add greedy requests to the same engine
    |   engine.step()  ->  new tokens, stamped with the version being served
    |   a group finished?  reward it, put it to the buffer
    +-- nothing in flight?  wait a little (counted as waiting for admission)

The vLLM engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a version swap is a
plain call between two steps and tokens before and after it carry different versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from typing import Any

from async_rlhf.buffer.build import make_client
from async_rlhf.buffer.client import BufferClient, with_retry
from async_rlhf.config import Config
from async_rlhf.env.registry import make_task
from async_rlhf.generator.rollout import GroupInProgress, RolloutTracker
from async_rlhf.timeline import Timeline

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval:"


class GeneratorActor:
    def __init__(self, gen_id: int, cfg: Config, model_path: str, buffer_address: str) -> None:
        from vllm import LLM  # heavy import at the edge

        from async_rlhf.tiny.tokenizer import load_tokenizer

        self.gen_id = gen_id
        self.cfg = cfg
        self.buffer_address = buffer_address
        self.llm = LLM(
            model=model_path,
            dtype=cfg.model.dtype,
            enforce_eager=True,
            max_model_len=cfg.model.max_model_len,
            worker_extension_cls="async_rlhf.generator.worker_ext.WeightSyncWorker",
            seed=cfg.train.seed * 1000 + gen_id,
            gpu_memory_utilization=0.3,
        )
        self.engine = self.llm.llm_engine
        self.tokenizer = load_tokenizer(model_path)
        self.task = make_task(cfg.task)
        self.version = 0
        self._lock = threading.Lock()
        self._pending_version: int | None = None
        self._stop = threading.Event()
        self._running = threading.Event()
        self._run_tag = uuid.uuid4().hex[:6]
        self.counters: dict[str, float] = {
            "tokens": 0, "groups": 0, "samples": 0, "reward_sum": 0.0, "reward_errors": 0, "updates": 0,
            "update_failures": 0,
        }
        self.timeline = Timeline(f"generator {gen_id}")
        self.produced: list[str] = []
        self.dropped: dict[str, str] = {}
        self.evals: list[dict[str, float]] = []
        self._in_flight = 0
        # held-out prompts are fixed: tokenize them once, not at every evaluation
        self._heldout = self.task.heldout()
        self._heldout_ids = [self.tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in self._heldout]

    # -- control, called from other threads --------------------------------------------------
    def ready(self) -> int:
        return self.gen_id

    def init_weight_sync(self, host: str, port: int, member_id: str, layout: list[dict[str, Any]],
                         late: bool = False) -> None:
        """Join the push group as ``member_id``; a late joiner takes the next version before it serves."""
        self.llm.collective_rpc("init_receiver", args=(host, port, member_id, layout, self.cfg.sync.backend,
                                                       self.cfg.sync.timeout_s))
        if late:
            with self._lock:
                self._pending_version = -1  # the loop receives the learner's next version first
        else:
            self.llm.collective_rpc("join_push_group", args=(self.cfg.sync.timeout_s,))

    def request_update(self, version: int) -> None:
        """Learner rank 0 is about to push ``version``; the loop joins the broadcast at a step boundary."""
        with self._lock:
            self._pending_version = version

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"gen_id": self.gen_id, "version": self.version, "in_flight": self._in_flight,
                    **self.counters, "evals": list(self.evals),
                    **{f"time/{k}_s": v for k, v in self.timeline.totals().items()}}

    def timeline_dict(self) -> dict[str, Any]:
        return self.timeline.to_dict()

    def ledger(self) -> dict[str, Any]:
        with self._lock:
            return {"produced": list(self.produced), "dropped": dict(self.dropped)}

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        cfg = self.cfg
        gen_cfg = cfg.generator
        client = make_client(cfg, self.buffer_address, consumer=f"generator-{self.gen_id}")
        patience = cfg.buffer.redis_retry_s + cfg.buffer.request_timeout_s
        sample_params = SamplingParams(
            max_tokens=gen_cfg.max_new_tokens, temperature=gen_cfg.temperature, logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )
        eval_params = SamplingParams(max_tokens=gen_cfg.max_new_tokens, temperature=0.0,
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        problems = self.task.train_problems(seed=cfg.train.seed * 7919 + self.gen_id)
        tracker = RolloutTracker()
        eval_out: dict[str, str] = {}
        eval_version = -1
        eval_pending = 0
        seq = 0
        last_refused = 0.0
        self._running.set()
        try:
            while not self._stop.is_set():
                # 1) weight update at a step boundary
                with self._lock:
                    pending = self._pending_version
                drain = gen_cfg.update_mode == "drain"
                if pending is not None and eval_pending == 0 and (not drain or len(tracker) == 0):
                    self._load_version(pending)
                    continue
                # 2) held-out eval on generator 0 when its version reaches a multiple of eval_every
                if (self.gen_id == 0 and gen_cfg.eval_every and eval_pending == 0
                        and self.version % gen_cfg.eval_every == 0 and self.version != eval_version):
                    eval_version = self.version
                    for i, ids in enumerate(self._heldout_ids):
                        self.engine.add_request(f"{EVAL_PREFIX}{i}", {"prompt_token_ids": ids}, eval_params)
                        eval_pending += 1
                # 3) admission
                want = gen_cfg.groups_in_flight - len(tracker)
                if want > 0 and not (pending is not None and drain) and time.monotonic() - last_refused > 0.005:
                    granted, _ = with_retry(lambda: client.admit(want), "admit", patience)
                    if granted < want:
                        last_refused = time.monotonic()
                    for _ in range(granted):
                        problem = next(problems)
                        seq += 1
                        ids = self.tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
                        group = GroupInProgress(f"g{self.gen_id}-{self._run_tag}-{seq}", ids,
                                                cfg.train.group_size, dataclasses.asdict(problem), self.version)
                        for rid in tracker.start(group):
                            self.engine.add_request(rid, {"prompt_token_ids": ids}, sample_params)
                self._in_flight = len(tracker)
                # 4) one engine step
                if not self.engine.has_unfinished_requests():
                    self.timeline.enter("wait_admission")
                    time.sleep(0.002)
                    continue
                self.timeline.enter("generate")
                outputs = self.engine.step()
                for out in outputs:
                    if out.request_id.startswith(EVAL_PREFIX):
                        if out.finished:
                            eval_out[out.request_id] = self.tokenizer.decode(out.outputs[0].token_ids,
                                                                             skip_special_tokens=True)
                            eval_pending -= 1
                            if eval_pending == 0:
                                self._record_eval(eval_version, eval_out)
                                eval_out = {}
                        continue
                    c = out.outputs[0]
                    lps = [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs or [])]
                    self.counters["tokens"] += len(c.token_ids)
                    done = tracker.on_output(out.request_id, list(c.token_ids), lps, self.version,
                                             c.finish_reason if out.finished else None)
                    if done is not None:
                        self.timeline.enter("reward_and_put")
                        self._finish_group(done, client, patience)
        finally:
            self.timeline.stop()
            abandoned = [f"{gid}/{i}" for gid, g in tracker.groups.items() for i in range(g.n)]
            if eval_pending:
                abandoned += [f"{EVAL_PREFIX}{i}" for i in range(len(self._heldout))]
            if abandoned:
                self.engine.abort_request(abandoned)
            self._running.clear()
            if len(tracker):
                with contextlib.suppress(Exception):  # best effort: the buffer may already be gone
                    client.release(len(tracker))
            client.close()
        return self.stats()

    def _load_version(self, version: int) -> None:
        self.timeline.enter("paused_for_push")
        try:
            received = self.llm.collective_rpc("receive_update", kwargs={"timeout_s": self.cfg.sync.timeout_s})[0]
        except Exception as exc:  # timeout, excluded or a broken group: stay pending, retry at the next step
            log.warning("generator %d: weight update to version %d failed, retrying: %s", self.gen_id, version, exc)
            with self._lock:
                self.counters["update_failures"] += 1
            return
        with self._lock:
            self.version = int(received["version"])  # what actually arrived (a late joiner's first version)
            if self._pending_version is not None and self._pending_version <= self.version:
                self._pending_version = None
            self.counters["updates"] += 1

    def _record_eval(self, version: int, outputs: dict[str, str]) -> None:
        problems = self._heldout
        correct = sum(self.task.reward(problems[int(rid[len(EVAL_PREFIX):])], text) for rid, text in outputs.items())
        with self._lock:
            self.evals.append({"version": version, "accuracy": correct / len(problems), "time": time.time()})

    def _finish_group(self, done: GroupInProgress, client: BufferClient, patience: float) -> None:
        problem = self.task.make(done.meta["a"], done.meta["b"])
        try:
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in done.tokens]
            rewards = [float(self.task.reward(problem, text)) for text in texts]
        except Exception as exc:  # a user reward function must never take the generator down
            log.exception("generator %d: reward failed for group %s", self.gen_id, done.group_id)
            with self._lock:
                self.counters["reward_errors"] += 1
                self.produced.append(done.group_id)
                self.dropped[done.group_id] = f"reward_error: {exc!r}"
            client.release(1)
            return
        group = done.to_group(rewards, self.gen_id)
        with_retry(lambda: client.put(group), f"put {group.group_id}", patience)
        with self._lock:
            self.produced.append(done.group_id)
            self.counters["groups"] += 1
            self.counters["samples"] += len(rewards)
            self.counters["reward_sum"] += sum(rewards)

    # -- scoring for verification (only while the loop is not running) -----------------------
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """vLLM's log-prob of every token after the first, for each sequence (prompt_logprobs)."""
        from vllm import SamplingParams

        if self._running.is_set():
            raise RuntimeError("score() needs the generator loop stopped first (call stop() and wait for run())")
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        return [[o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))] for o, s in zip(outs, sequences)]
