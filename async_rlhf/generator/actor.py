"""Generator actor: one vLLM engine, a prompt stream, and the loop that keeps requests in flight.

    loop (one thread; Ray calls such as stats/stop run on other threads and only read or set flags)
    +-> a new version staged?   (the worker's fetch thread receives every push on its own, unannounced)
    |                           in_flight: load it between two engine steps (at most every
    |                           min_swap_interval_s unless it lags by max_staleness; newer ones coalesce)
    |                           drain: stop admitting, load once nothing is in flight
    |   fewer than groups_in_flight groups?  prompts ready? ask the buffer to admit more (staleness rule)
    |   held-out eval due (generator 0)?     add greedy requests to the same engine
    |   engine.step()  ->  new tokens, stamped with the version being served
    |   pump the event loop: environment coroutines resume (next turn, observation), finished groups are
    |   rewarded and put; slow rewards are awaited there while the engine keeps stepping
    +-- nothing in flight?  wait a little (counted as waiting for admission)

The vLLM engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so a version swap is a
plain call between two steps and tokens before and after it carry different versions.

Environments are coroutines (``async_rlhf.env.base``) on an asyncio loop owned by this thread and run in
small slices between engine steps (``GroupRunner.pump`` in ``generator/groups.py``). A group is put to the
buffer as soon as its trajectories are done: with its rewards when every reward source is immediate (a
verifier), otherwise at once with ``rewards_pending`` and its rewards sent later (``client.reward``) by a task
that awaits the sources. A reward that fails or times out is counted and never stops the loop; the buffer
drops that group after ``buffer.reward_deadline_s`` with reason ``reward_timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Any

from async_rlhf.buffer.build import make_client
from async_rlhf.buffer.client import with_retry
from async_rlhf.config import Config
from async_rlhf.env.registry import make_env
from async_rlhf.generator.groups import GroupRunner
from async_rlhf.generator.rollout import EnginePolicy
from async_rlhf.generator.stream import PromptStream, group_id
from async_rlhf.rewards.streak import FailureStreak
from async_rlhf.timeline import Timeline

log = logging.getLogger(__name__)

EVAL_PREFIX = "eval:"
UPDATE_POLL_S = 0.005
"""How often the loop asks the worker whether a new version has arrived (a collective_rpc round trip)."""


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
        self.env = make_env(cfg.task)
        self.policy = EnginePolicy(self._add_turn_request, self._encode, self._decode,
                                   cfg.generator.max_new_tokens, cfg.model.max_model_len)
        self._sampling: dict[int, Any] = {}
        self._groups: dict[str, Any] = {}
        """Prompt groups admitted and not yet put (``GroupRunner.groups`` while the loop runs)."""
        self.version = 0
        self._lock = threading.Lock()
        self._awaiting_first = False  # a late joiner serves nothing before its first version
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._running = threading.Event()
        self._resume: dict[str, Any] = {}
        self._position = 0
        self._run_tag = uuid.uuid4().hex[:6]
        self.counters: dict[str, float] = {
            "tokens": 0, "groups": 0, "samples": 0, "reward_sum": 0.0, "reward_errors": 0, "updates": 0,
            "update_failures": 0, "reward_timeouts": 0, "rewards_late": 0, "env_errors": 0,
        }
        self.timeline = Timeline(f"generator {gen_id}")
        self._reward_streak = FailureStreak(cfg.rewards.max_consecutive_failures, cfg.rewards.sources)
        self.produced: list[str] = []
        self.dropped: dict[str, str] = {}
        self.evals: list[dict[str, float]] = []
        self._in_flight = 0
        # held-out prompts are fixed: tokenize them once, not at every evaluation
        self._heldout = self.env.heldout()
        self._heldout_ids = [self._encode(p.text) for p in self._heldout]

    # -- control, called from other threads --------------------------------------------------
    def ready(self) -> int:
        return self.gen_id

    def init_weight_sync(self, host: str, port: int, member_id: str, layout: list[dict[str, Any]],
                         late: bool = False) -> None:
        """Join the push group as ``member_id`` and start receiving every push in the background; a late
        joiner takes the next version before it serves."""
        sync = self.cfg.sync
        self.llm.collective_rpc("init_receiver", args=(host, port, member_id, layout, sync.backend, sync.timeout_s,
                                                       sync.receive_buffers))
        if late:
            with self._lock:
                self._awaiting_first = True  # the loop receives the learner's next version first
        else:
            self.llm.collective_rpc("join_push_group", args=(sync.timeout_s,))
        self.llm.collective_rpc("start_fetching", kwargs={"timeout_s": sync.timeout_s})

    def stop(self, drain: bool = False) -> None:
        """End the loop; with ``drain``, admit nothing more and end once every group in flight is put."""
        (self._draining if drain else self._stop).set()

    def resume_stream(self, position: int, reissue: list[int], skip: list[int], version: int | None = None) -> None:
        """Before run(): continue the prompt stream after ``position``, re-issuing ``reissue`` first;
        ``version``: the version of the weights this engine was started from (a resumed checkpoint)."""
        self._resume = {"start": int(position), "reissue": list(reissue), "skip": list(skip)}
        self._position = int(position)
        if version is not None:
            with self._lock:
                self.version = int(version)

    def pid(self) -> int:
        import os

        return os.getpid()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"gen_id": self.gen_id, "version": self.version, "in_flight": self._in_flight,
                    "position": self._position,
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
        self._sampling = {n: SamplingParams(max_tokens=n, temperature=gen_cfg.temperature, logprobs=0,
                                            output_kind=RequestOutputKind.DELTA)
                          for n in range(1, gen_cfg.max_new_tokens + 1)}
        from async_rlhf.prompts.build import make_prompts
        from async_rlhf.rewards.build import make_rewards

        seed = cfg.train.seed * 7919 + self.gen_id
        source = make_prompts(cfg, self.env, seed, consumer=f"generator-{self.gen_id}")
        rewards = make_rewards(cfg, self.env)
        runner = GroupRunner(self.env, rewards, self.policy, client, group_size=cfg.train.group_size,
                             reward_timeout_s=cfg.rewards.timeout_s, patience_s=patience, generator=self.gen_id,
                             current_version=lambda: self.version, record=self._record,
                             on_reward_phase=lambda: self.timeline.enter("reward_and_put"),
                             reward_client=lambda: make_client(cfg, self.buffer_address,
                                                               consumer=f"generator-{self.gen_id}"))
        self._groups = runner.groups
        eval_params = SamplingParams(max_tokens=gen_cfg.max_new_tokens, temperature=0.0,
                                     output_kind=RequestOutputKind.FINAL_ONLY)
        problems = PromptStream(source, **self._resume)
        eval_out: dict[str, str] = {}
        eval_version = -1
        eval_pending = 0
        last_refused = 0.0
        last_poll, staged = 0.0, None
        self._last_swap = time.monotonic()
        self._running.set()
        try:
            while not self._stop.is_set() and not (self._draining.is_set() and len(self._groups) == 0):
                self._reward_streak.check(self.gen_id)  # a broken reward source stops the run, named
                # 1) weight update: received by the worker's fetch thread while the engine keeps generating,
                #    swapped in at a step boundary (in_flight) or once nothing is in flight (drain)
                drain = gen_cfg.update_mode == "drain"
                now = time.monotonic()
                if now - last_poll >= UPDATE_POLL_S or self._awaiting_first:
                    last_poll = now
                    staged = self.llm.collective_rpc("staged_version")[0]
                pending = staged is not None
                if pending and eval_pending == 0 and (not drain or len(self._groups) == 0) and (
                        self._awaiting_first or self._swap_due(staged, now)):
                    self._load_version()
                    staged = None
                    continue
                if self._awaiting_first:  # a late joiner serves nothing before its first version
                    self.timeline.enter("paused_for_push")
                    time.sleep(0.002)
                    continue
                # 2) held-out eval on generator 0 when its version reaches a multiple of eval_every
                if (self.gen_id == 0 and gen_cfg.eval_every and eval_pending == 0
                        and self.version % gen_cfg.eval_every == 0 and self.version != eval_version):
                    eval_version = self.version
                    for i, ids in enumerate(self._heldout_ids):
                        self.engine.add_request(f"{EVAL_PREFIX}{i}", {"prompt_token_ids": ids}, eval_params)
                        eval_pending += 1
                # 3) admission
                want = gen_cfg.groups_in_flight - len(self._groups)
                if (want > 0 and not (pending and drain) and not self._draining.is_set()
                        and time.monotonic() - last_refused > 0.005):
                    want = min(want, problems.reissue_left + source.prefetch(want))  # prompts ready now
                    granted, live = with_retry(lambda: client.admit(want), "admit", patience) if want else (0, 0)
                    if granted < want or want == 0:
                        last_refused = time.monotonic()
                    if granted and live > self.version and not drain and eval_pending == 0:
                        # the buffer's version is held by every generator (it is set once the push is
                        # acknowledged): serve it before starting these groups, or they are born stale
                        staged = self.llm.collective_rpc("staged_version")[0]
                        if staged is not None and staged >= live:
                            self._load_version()
                            staged = None
                    for _ in range(granted):
                        seq, prompt = next(problems)
                        self._position = max(self._position, problems.position)
                        runner.start(group_id(self.gen_id, self._run_tag, seq), prompt, self._encode(prompt.text))
                    if granted:
                        runner.pump()  # the new groups' first turns reach the engine
                self._in_flight = len(self._groups)
                # 4) one engine step
                if not self.engine.has_unfinished_requests():
                    # idle with groups in flight: they await their environment or a late reward
                    self.timeline.enter("wait_env_or_reward" if self._groups else "wait_admission")
                    time.sleep(0.002)
                    runner.pump()  # environments and late rewards awaiting something other than the engine
                    continue
                self.timeline.enter("generate")
                outputs = self.engine.step()
                finished = False
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
                    self.policy.on_output(out.request_id, list(c.token_ids), lps, self.version,
                                          c.finish_reason if out.finished else None)
                    finished = finished or out.finished
                if finished or runner.reward_tasks or time.monotonic() - runner.last_pump > 0.01:
                    runner.pump()
            # a stopped generator holds the newest version it received (the learner's last push was
            # acknowledged before it stopped): load it, so the engine ends on the final weights
            last = self.llm.collective_rpc("staged_version")[0]
            if last is not None and last > self.version:
                self._load_version()
        finally:
            self.timeline.stop()
            abandoned = self.policy.cancel_all()
            open_groups = len(runner.groups)
            with contextlib.suppress(Exception):
                runner.cancel_all()
            if eval_pending:
                abandoned += [f"{EVAL_PREFIX}{i}" for i in range(len(self._heldout))]
            if abandoned:
                self.engine.abort_request(abandoned)
            self._running.clear()
            if open_groups:
                with contextlib.suppress(Exception):  # best effort: the buffer may already be gone
                    client.release(open_groups)
            client.close()
            with contextlib.suppress(Exception):
                runner.close()
                source.close()
                rewards.close()
        return self.stats()

    def _swap_due(self, staged: int, now: float) -> bool:
        """Whether to load the staged version now: every ``generator.min_swap_interval_s`` at most, unless
        the engine already lags it by ``train.max_staleness`` versions (its tokens would soon be too stale)."""
        lag = staged - self.version
        return staged < 0 or now - self._last_swap >= self.cfg.generator.min_swap_interval_s or (
            lag >= max(1, self.cfg.train.max_staleness))

    def _load_version(self) -> None:
        self.timeline.enter("paused_for_push")
        self._last_swap = time.monotonic()
        try:
            received = self.llm.collective_rpc("apply_update")[0]  # sync/pause_s: the swap itself
        except Exception as exc:  # a failed fetch, or a load error: the fetch thread goes on with the next push
            log.warning("generator %d: weight update failed, waiting for the next version: %s", self.gen_id, exc)
            with self._lock:
                self.counters["update_failures"] += 1
            return
        with self._lock:
            self.version = int(received["version"])  # what actually arrived (a late joiner's first version)
            self._awaiting_first = False
            self.counters["updates"] += 1
            # time this engine stood still for the update (receiver side: the load into the engine)
            pause = float(received["sync/pause_s"])
            c = self.counters
            c["sync/pause_s_sum"] = c.get("sync/pause_s_sum", 0.0) + pause
            c["sync/pause_s_max"] = max(c.get("sync/pause_s_max", 0.0), pause)
            c["sync/pause_s_last"] = pause
            c["sync/pause_s_mean"] = c["sync/pause_s_sum"] / c["updates"]
            c["sync/transfer_s_last"] = float(received["sync/transfer_s"])
            c["sync/coalesced"] = float(received.get("sync/coalesced", 0.0))

    def _record_eval(self, version: int, outputs: dict[str, str]) -> None:
        prompts = self._heldout
        correct = sum(self.env.verify(prompts[int(rid[len(EVAL_PREFIX):])], text) for rid, text in outputs.items())
        with self._lock:
            self.evals.append({"version": version, "accuracy": correct / len(prompts), "time": time.time()})

    # -- environments and rewards (coroutines in generator/groups.py, run between engine steps) -----
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _add_turn_request(self, request_id: str, context_ids: list[int], max_tokens: int) -> None:
        self.policy.version = self.version  # observation tokens are stamped with the version being served
        self.engine.add_request(request_id, {"prompt_token_ids": context_ids}, self._sampling[max_tokens])

    def _record(self, event: str, gid: str, rewards: list[float] | None, reason: str) -> None:
        """Ledger and counters of the GroupRunner's events (see ``generator/groups.py``)."""
        self._reward_streak.observe(event, reason)
        with self._lock:
            if event in ("put", "put_pending"):
                self.produced.append(gid)
                self.counters["groups"] += 1
            elif event == "dropped":
                self.produced.append(gid)
                self.dropped[gid] = reason
            elif event in self.counters:
                self.counters[event] += 1
            if event == "rewarded":
                self.counters["rewards_late"] += 1
            if rewards is not None:
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
