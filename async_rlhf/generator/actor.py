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
import functools
import logging
import threading
import time
import uuid
from typing import Any

from async_rlhf.buffer.build import make_client
from async_rlhf.buffer.client import stop_retries
from async_rlhf.config import Config
from async_rlhf.env.registry import make_env
from async_rlhf.evaluation import score_eval_set
from async_rlhf.generator.groups import GroupRunner
from async_rlhf.generator.lanes import Layout, lane_source, offset_stream
from async_rlhf.generator.loop_phases import EVAL_PREFIX, LoopPhases, LoopState
from async_rlhf.generator.prompt_filter import UninformativePromptFilter
from async_rlhf.generator.prompt_fit import PromptFit, context_len
from async_rlhf.generator.rollout import EnginePolicy
from async_rlhf.generator.stream import client_name
from async_rlhf.rewards.base import Completion
from async_rlhf.rewards.streak import FailureStreak
from async_rlhf.timeline import Timeline

log = logging.getLogger(__name__)




class GeneratorActor(LoopPhases):
    def __init__(self, gen_id: int, cfg: Config, model_path: str, buffer_address: str) -> None:
        from async_rlhf.run_logs import to_role_log

        to_role_log(cfg, f"generator-{gen_id}")  # first: what vLLM prints goes to run.dir/logs, not the console
        from async_rlhf.startup import phases
        from async_rlhf.startup.reporter import StartupReporter

        startup = StartupReporter(f"generator {gen_id}")  # the driver's start-up progress and deadlines
        startup.phase(phases.IMPORTS, "vllm")
        from vllm import LLM, SamplingParams  # heavy import at the edge
        from vllm.sampling_params import RequestOutputKind

        from async_rlhf.endpoints import bind_gloo_to_node
        from async_rlhf.generator.engine_args import (
            VersionClock,
            apply_compile_stance,
            engine_kwargs,
            engine_lag,
        )
        from async_rlhf.prompts.chat import ChatRenderer
        from async_rlhf.tokenizer import load_tokenizer, stop_token_ids

        bind_gloo_to_node()  # the push group's gloo pairs listen where the sender can reach them
        self.gen_id = gen_id
        self.cfg = cfg
        self.buffer_address = buffer_address
        engine = engine_kwargs(cfg)  # per-device defaults; in-flight updates turn async scheduling off
        apply_compile_stance(engine, cfg.resources.generator_gpus > 0)  # nothing compiled at run time
        startup.phase(phases.ENGINE)  # the model load is inside
        self.llm = LLM(
            model=model_path,
            worker_extension_cls="async_rlhf.generator.worker_ext.WeightSyncWorker",
            seed=cfg.train.seed * 1000 + gen_id,
            **engine,
        )
        self._clock = VersionClock(engine_lag(engine, cfg.resources.generator_gpus > 0))
        """Stamps the tokens of each engine step with the version that computed them."""
        self.engine = self.llm.llm_engine
        # detokenize=False: the loop reads token ids and log-probs only (text is decoded once per finished turn,
        # by the policy); vLLM's per-token detokenizing of outputs and log-prob tokens cost ~10% of its step here
        self._rollout_params = functools.cache(lambda max_tokens, n: SamplingParams(
            n=n, max_tokens=max_tokens, temperature=cfg.generator.temperature, logprobs=0,
            stop_token_ids=self.stop_ids, output_kind=RequestOutputKind.DELTA, detokenize=False))
        self.tokenizer = load_tokenizer(model_path)  # the model's own (special tokens, chat template)
        self.stop_ids = stop_token_ids(model_path, self.tokenizer)  # generation_config.json's eos ids too
        self.chat = ChatRenderer(self.tokenizer, cfg.prompts.chat_template, model_path)
        self.env = make_env(cfg.task)
        self.policy = EnginePolicy(self._add_turn_request, self._encode, self._decode,
                                   cfg.generator.max_new_tokens, context_len(cfg))  # the engine's window
        if cfg.task.name == "agent":  # the user's agent drives episodes through this generator's endpoint
            from async_rlhf.agent.build import serve_agents

            self.env = serve_agents(self.env, cfg, self.tokenizer, self.stop_ids, self.policy, model_path)
        self._fit = PromptFit(context_len(cfg))
        """Prompts without room in the context window are passed over, or the run stops (prompt_fit.py)."""
        self._groups: dict[str, Any] = {}
        """Prompt groups admitted and not yet put (``GroupRunner.groups`` while the loop runs)."""
        self.version = 0
        self._lock = threading.Lock()
        self._awaiting_first = False  # a late joiner serves nothing before its first version
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._running = threading.Event()
        self._resume: dict[str, Any] = {}
        self._layout: dict[str, Any] | None = None
        self._position = 0
        self._run_tag = uuid.uuid4().hex[:6]
        self.counters: dict[str, float] = {
            "tokens": 0, "groups": 0, "samples": 0, "reward_sum": 0.0, "reward_errors": 0, "updates": 0,
            "update_failures": 0, "reward_timeouts": 0, "rewards_late": 0, "env_errors": 0,
            "prompts_too_long": 0, "prompts_too_long_max_tokens": 0, "samples_truncated": 0,
        }
        self.prompt_filter: UninformativePromptFilter | None = None
        """Passes over prompts whose last groups taught nothing (prompts.skip_uninformative); made by run()."""
        self.timeline = Timeline(f"generator {gen_id}")
        self._reward_streak = FailureStreak(cfg.rewards.max_consecutive_failures, cfg.rewards.sources)
        self.produced: list[str] = []
        self.dropped: dict[str, str] = {}
        self.evals: list[dict[str, float]] = []
        self._in_flight = 0
        # held-out prompts are fixed: tokenize them once, not at every evaluation. With prompts.eval_path they
        # are the user's, scored by rewards.sources (only generator 0 evaluates); else the task's own
        self._eval_set = bool(cfg.prompts.eval_path)
        self._eval_tasks: set[Any] = set()
        if self._eval_set:
            from async_rlhf.evaluation import load_eval_prompts

            self._heldout = load_eval_prompts(cfg) if gen_id == 0 else []
        else:
            self._heldout = self.env.heldout()
        prepared = [self.chat.prepare(p) for p in self._heldout]
        self._heldout = [p for p, _ in prepared]  # rendered: what the reward sources see
        self._heldout_ids = [ids for _, ids in prepared]
        startup.phase(phases.STARTED)

    # -- control, called from other threads --------------------------------------------------
    def ready(self) -> int:
        return self.gen_id

    def init_weight_sync(self, host: str, port: int, member_id: str, layout: list[dict[str, Any]],
                         late: bool = False) -> None:
        """Join the push group as ``member_id`` and start receiving every push in the background; a late
        joiner takes the next version before it serves."""
        from async_rlhf.config import push_min_gbps

        sync = self.cfg.sync
        self.llm.collective_rpc("init_receiver", args=(host, port, member_id, layout, sync.backend, sync.timeout_s,
                                                       sync.receive_buffers, push_min_gbps(self.cfg)))
        if not late:
            # forming the first group is start-up (every member and the sender arrive when they are built):
            # it has the start-up phase's budget, not the steady-state push timeout
            self.llm.collective_rpc("join_push_group", args=(max(sync.timeout_s, self.cfg.run.startup_phase_s),))
        elif not self._running.is_set():
            with self._lock:
                self._awaiting_first = True  # the loop receives the learner's next version first
        # a live generator re-joining (Fleet.heal) keeps serving its version meanwhile: pausing it for the next
        # version would never end while an evaluation or, in drain mode, a group waits for an engine step
        self.llm.collective_rpc("start_fetching", kwargs={"timeout_s": sync.timeout_s})

    def raw_receive(self, tag: str, members: list[str], nbytes: int, reps: int) -> None:
        """After training: every worker of this engine takes part in learner rank 0's raw broadcast ``tag`` of
        ``nbytes`` (async_rlhf/sync/raw.py) as rank 1 + its index in ``members`` (push member ids)."""
        self.llm.collective_rpc("raw_receive", args=(tag, list(members), int(nbytes), int(reps)))

    def stop(self, drain: bool = False) -> None:
        """End the loop; with ``drain``, admit nothing more and end once every group in flight is put.
        Without it, buffer requests give up within a short grace (the buffer may be what is gone)."""
        if not drain:
            stop_retries()
        (self._draining if drain else self._stop).set()

    def resume_stream(self, position: int, reissue: list[int], skip: list[int], version: int | None = None,
                      layout: dict[str, Any] | None = None) -> None:
        """Before run(): continue the prompt stream after ``position``, re-issuing ``reissue`` first;
        ``version``: the version of the weights this engine was started from (a resumed checkpoint); ``layout``:
        how a file or Python source is dealt to the fleet (``generator/lanes.py``; None: strides of the
        configured fleet)."""
        self._resume = {"start": int(position), "reissue": list(reissue), "skip": list(skip)}
        self._layout = dict(layout) if layout is not None else None
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
                    "prompts_skipped": self.prompt_filter.skipped if self.prompt_filter is not None else 0,
                    **getattr(self.env, "counters", {}),
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
        client = make_client(cfg, self.buffer_address, consumer=client_name(self.gen_id))
        patience = cfg.buffer.redis_retry_s + cfg.buffer.request_timeout_s
        from async_rlhf.prompts.build import make_prompts
        from async_rlhf.rewards.build import make_rewards

        seed = cfg.train.seed * 7919 + self.gen_id
        layout = self._current_layout()
        lane = self._lane(layout)
        if lane is not None and cfg.prompts.source in ("file", "python") and not layout.is_default():
            source, base = lane_source(cfg, layout, self.gen_id), layout.base.get(self.gen_id, 0)
        else:
            source, base = make_prompts(cfg, self.env, seed, consumer=client_name(self.gen_id), lane=lane), 0
        rewards = make_rewards(cfg, self.env)
        filt = self.prompt_filter = (UninformativePromptFilter(cfg.prompts.skip_min_retry, seed)
                                     if cfg.prompts.skip_uninformative else None)
        runner = GroupRunner(self.env, rewards, self.policy, client, group_size=cfg.train.group_size,
                             reward_timeout_s=cfg.rewards.timeout_s, patience_s=patience, generator=self.gen_id,
                             current_version=lambda: self.version, record=self._record,
                             on_reward_phase=lambda: self.timeline.enter("reward_and_put"),
                             reward_client=lambda: make_client(cfg, self.buffer_address,
                                                               consumer=client_name(self.gen_id)),
                             on_returns=filt.observe if filt is not None else lambda p, r: None)
        self._groups = runner.groups
        eval_params = SamplingParams(max_tokens=gen_cfg.max_new_tokens, temperature=0.0, detokenize=False,
                                     stop_token_ids=self.stop_ids, output_kind=RequestOutputKind.FINAL_ONLY)
        problems = offset_stream(source, base, **self._resume)
        st = LoopState()
        self._last_swap = time.monotonic()
        self._running.set()
        try:
            while not self._stop.is_set() and not (self._draining.is_set() and len(self._groups) == 0):
                self._reward_streak.check(self.gen_id)  # a broken reward source stops the run, named
                if self._swap_phase(st):
                    continue
                self._eval_phase(st, eval_params)
                self._admit_phase(st, client, problems, source, runner, patience)
                self._in_flight = len(self._groups)
                self._step_phase(st, runner, rewards)
            if self._draining.is_set() and not self._stop.is_set():
                # scaled down: its groups are all put, but late rewards may still be on their way; each ends by
                # itself within rewards.timeout_s plus the buffer's patience (issue 31: they were cancelled)
                runner.settle(cfg.rewards.timeout_s + patience, give_up=self._stop.is_set)
            # a stopped generator holds the newest version it received (the learner's last push was
            # acknowledged before it stopped): load it, so the engine ends on the final weights
            last = self._staged()
            if last is not None and last > self.version:
                self._load_version()
        finally:
            self.timeline.stop()
            abandoned = self.policy.cancel_all()
            open_groups = len(runner.groups)
            for task in list(self._eval_tasks):
                task.cancel()
            if self._draining.is_set():  # what is still pending goes back now, its prompt to be issued again
                with contextlib.suppress(Exception):
                    runner.abandon_pending()
            with contextlib.suppress(Exception):
                runner.cancel_all()
            if st.eval_pending:
                abandoned += [f"{EVAL_PREFIX}{i}" for i in range(len(self._heldout))]
            if abandoned:
                self.engine.abort_request(abandoned)
            self._running.clear()
            if open_groups:
                with contextlib.suppress(Exception):  # best effort: the buffer may already be gone
                    client.release(open_groups)
            client.close()
            with contextlib.suppress(Exception):
                self.env.close()  # an agent endpoint and its episodes' thread
            with contextlib.suppress(Exception):
                rewards.close()  # first: a remote scorer closes its connections on the runner's loop
                runner.close()
                source.close()
        return self.stats()

    def _current_layout(self) -> Layout:
        """How the fleet shares a file or Python source: the driver's (``resume_stream``), else strides of the
        configured fleet."""
        return Layout.from_dict(self._layout) if self._layout else Layout.default(self.cfg.generators)

    def _lane(self, layout: Layout) -> tuple[int, int] | None:
        """This generator's stride of a file or Python prompt source: lane ``gen_id`` of the layout's fleet (a
        restarted generator, or one re-added under a freed id, continues its lane); None beyond that fleet,
        where prompts are drawn on their own and may repeat within an epoch."""
        if self.gen_id < layout.lanes:
            return (self.gen_id, layout.lanes)
        if self.cfg.prompts.source in ("file", "python"):
            log.warning("generator %d is beyond the configured fleet (generators=%d): it draws prompts on its own "
                        "shuffle, so prompts may repeat within an epoch", self.gen_id, layout.lanes)
        return None

    def _staged(self) -> int | None:
        """The version every worker of the engine (one per TP rank) has staged (see ``common_staged``)."""
        from async_rlhf.generator.worker_ext import common_staged

        return common_staged(self.llm.collective_rpc("staged_version"))

    def _load_version(self) -> None:
        self.timeline.enter("paused_for_push")
        self._last_swap = time.monotonic()
        try:
            exact: dict[str, Any] = {}
            if self.cfg.resources.tensor_parallel > 1:  # every TP worker loads one agreed version (worker_ext.py)
                from async_rlhf.generator.worker_ext import agreed_version

                agreed = agreed_version(self.llm.collective_rpc("hold_staged"))
                if agreed is None:  # one worker holds nothing (or failed): load nothing, or shards would differ
                    errors = [e for e in self.llm.collective_rpc("release_hold") if e]
                    raise RuntimeError(f"the engine's TP workers do not all hold a version; none loaded "
                                       f"({'; '.join(errors) or 'nothing staged on some worker'})")
                exact["version"] = agreed
            per_worker = self.llm.collective_rpc("apply_update", kwargs=exact)  # sync/pause_s: the swap itself
            received = per_worker[0]
            if len({int(r["version"]) for r in per_worker}) > 1:  # TP workers must serve one version
                raise RuntimeError(f"the engine's TP workers loaded different versions "
                                   f"{[int(r['version']) for r in per_worker]}")
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

    def _record_eval(self, version: int, outputs: dict[str, Completion], rewards: Any, runner: GroupRunner) -> None:
        prompts = self._heldout
        if self._eval_set:  # scored by the reward sources, which may be late: awaited between engine steps
            order = sorted(outputs, key=lambda rid: int(rid[len(EVAL_PREFIX):]))
            task = runner.loop.create_task(score_eval_set(
                version, rewards, [prompts[int(r[len(EVAL_PREFIX):])] for r in order], [outputs[r] for r in order],
                self.cfg.rewards.timeout_s, self._eval_done))
            self._eval_tasks.add(task)
            task.add_done_callback(self._eval_tasks.discard)
            return
        correct = sum(self.env.score_heldout(prompts[int(rid[len(EVAL_PREFIX):])], text)
                      for rid, text in outputs.items())
        with self._lock:
            self.evals.append({"version": version, "accuracy": correct / len(prompts), "time": time.time()})

    def _eval_done(self, version: int, figures: dict[str, float] | None, error: str = "") -> None:
        if figures is None:  # a failed evaluation is reported, never stops generation
            log.warning("generator %d: held-out evaluation at version %d failed: %s", self.gen_id, version, error)
            return
        with self._lock:
            self.evals.append({"version": version, **figures, "time": time.time()})

    # -- environments and rewards (coroutines in generator/groups.py, run between engine steps) -----
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _add_turn_request(self, request_id: str, context_ids: list[int], max_tokens: int, n: int) -> None:
        from async_rlhf.generator.engine_args import prompt_inputs

        self.policy.version = self.version  # observation tokens are stamped with the version being served
        # salted with that version: never prompt KV of older weights from vLLM's prefix cache (engine_args.py)
        self.engine.add_request(request_id, prompt_inputs(context_ids, self.version),
                                self._rollout_params(max_tokens, n))

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
        from async_rlhf.generator.engine_args import prompt_inputs

        outs = self.llm.generate([prompt_inputs(s, self.version) for s in sequences], params, use_tqdm=False)
        return [[o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))] for o, s in zip(outs, sequences)]
