"""The generator loop's phases, one pass each: swap in a staged version, start held-out requests, admit groups,
step the engine. :class:`~async_rlhf.generator.actor.GeneratorActor` runs them in turn (see its module's
diagram); they live here, on a mixin, so each can be driven with a stand-in engine in a unit test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from async_rlhf.buffer.client import with_retry
from async_rlhf.generator.engine_args import prompt_inputs
from async_rlhf.generator.groups import GroupRunner
from async_rlhf.generator.prompt_filter import UninformativePromptFilter
from async_rlhf.generator.prompt_fit import PromptFit
from async_rlhf.generator.stream import PromptStream, group_id
from async_rlhf.rewards.base import Completion

EVAL_PREFIX = "eval:"
MAX_SKIPS_PER_DRAW = 64
"""Prompts passed over for one group at most (then the last one drawn is generated): bounds the loop's time when
nearly every prompt is solved."""
MAX_TOO_LONG_PER_DRAW = 1024
"""Prompts without room in the context window passed over for one group at most (each is tokenized; the first
``prompt_fit.STOP_AFTER`` of a generator that never saw one fit stop the run instead)."""
UPDATE_POLL_S = 0.005
"""How often the loop of a tensor-parallel engine asks its workers (other processes: an RPC round trip each)
whether a new version has arrived. An engine of one worker, which runs in the loop's own process, is asked before
every engine step (:func:`update_poll_s`)."""


def update_poll_s(tensor_parallel: int) -> float:
    """Seconds between the loop's asks for a staged version: 0 (every pass, so before every engine step) when the
    engine's one worker runs in this process (``collective_rpc`` is a method call there: 0.6 us measured on the tiny
    engine, whose steps take 1.4-4 ms), else :data:`UPDATE_POLL_S`."""
    return 0.0 if tensor_parallel <= 1 else UPDATE_POLL_S


@dataclass
class LoopState:
    """What one pass of the generator's loop leaves for the next."""

    staged: int | None = None
    """The newest version the workers have staged (None: nothing new since the last load)."""
    last_poll: float = 0.0
    last_refused: float = 0.0
    """When the buffer last admitted fewer groups than asked (admission is not asked again for 5 ms)."""
    eval_version: int = -1
    eval_pending: int = 0
    eval_out: dict[str, Completion] = field(default_factory=dict)


class LoopPhases:
    """Mixin of :class:`~async_rlhf.generator.actor.GeneratorActor`: the attributes it reads (``cfg``, ``engine``,
    ``version``, ``timeline``, ...) are the actor's."""

    cfg: Any
    gen_id: int
    engine: Any
    version: int
    timeline: Any
    counters: dict[str, Any]
    policy: Any
    _last_swap: float
    """When the engine last loaded a version (``time.monotonic``)."""
    chat: Any
    prompt_filter: UninformativePromptFilter | None
    _fit: PromptFit
    """Whether an encoded prompt leaves room in the engine's context window (``prompt_fit.py``)."""

    def _swap_due(self, staged: int, now: float) -> bool:
        """Whether to load the staged version now: every ``generator.min_swap_interval_s`` at most, unless
        the engine already lags it by ``train.max_staleness`` versions (its tokens would soon be too stale)."""
        lag = staged - self.version
        return staged < 0 or now - self._last_swap >= self.cfg.generator.min_swap_interval_s or (
            lag >= max(1, self.cfg.train.max_staleness))

    def _swap_phase(self, st: LoopState) -> bool:
        """A weight update, received by the worker's fetch thread while the engine keeps generating, swapped in
        at a step boundary (in_flight) or once nothing is in flight (drain). True: this pass is done (a version
        was loaded, or a late joiner waits for its first one)."""
        drain = self.cfg.generator.update_mode == "drain"
        now = time.monotonic()
        if now - st.last_poll >= update_poll_s(self.cfg.resources.tensor_parallel) or self._awaiting_first:
            st.last_poll = now
            st.staged = self._staged()
        if st.staged is not None and st.eval_pending == 0 and (not drain or len(self._groups) == 0) and (
                self._awaiting_first or self._swap_due(st.staged, now)):
            self._load_version()
            st.staged = None
            return True
        if self._awaiting_first:  # a late joiner serves nothing before its first version
            self.timeline.enter("paused_for_push")
            time.sleep(0.002)
            return True
        return False

    def _eval_phase(self, st: LoopState, eval_params: Any) -> None:
        """Held-out greedy requests on generator 0 when its version reaches or passes a multiple of ``eval_every``
        (with ``min_swap_interval_s`` the engine may jump over it: versions that arrive meanwhile coalesce)."""
        every = self.cfg.generator.eval_every
        if (self.gen_id == 0 and every and st.eval_pending == 0
                and (st.eval_version < 0 or self.version // every > st.eval_version // every)):
            st.eval_version = self.version
            for i, ids in enumerate(self._heldout_ids):
                self.engine.add_request(f"{EVAL_PREFIX}{i}", prompt_inputs(ids, self.version), eval_params)
                st.eval_pending += 1

    def _admit_phase(self, st: LoopState, client: Any, problems: PromptStream, source: Any, runner: GroupRunner,
                     patience: float) -> None:
        """Ask the buffer to admit more groups (staleness rule) while fewer than ``groups_in_flight`` run."""
        gen_cfg = self.cfg.generator
        drain = gen_cfg.update_mode == "drain"
        want = gen_cfg.groups_in_flight - len(self._groups)
        if (want <= 0 or (st.staged is not None and drain) or self._draining.is_set()
                or time.monotonic() - st.last_refused <= 0.005 or self._swap_held_by_eval(st)):
            return
        want = min(want, problems.reissue_left + source.prefetch(want))  # prompts ready now
        granted, live = with_retry(lambda: client.admit(want), "admit", patience) if want else (0, 0)
        if granted < want or want == 0:
            st.last_refused = time.monotonic()
        if granted and live > self.version and not drain and st.eval_pending == 0:
            # the buffer's version is held by every generator (it is set once the push is acknowledged):
            # serve it before starting these groups, or they are born behind; with min_swap_interval_s, only
            # when due (they may start up to max_staleness - 1 versions behind: each swap pauses the engine)
            st.staged = self._staged()
            if st.staged is not None and st.staged >= live and self._swap_due(st.staged, time.monotonic()):
                self._load_version()
                st.staged = None
        for _ in range(granted):
            seq, prompt, ids, passed_over = self._draw(problems, source)
            self._position = max(self._position, problems.position)
            runner.start(group_id(self.gen_id, self._run_tag, seq, passed_over), prompt, ids)
        if granted:
            runner.pump()  # the new groups' first turns reach the engine

    def _swap_held_by_eval(self, st: LoopState) -> bool:
        """A newer version is staged and due, but held-out requests keep it back: groups admitted now would be born
        behind it (a few engine steps later the evaluation is done, the swap made, and they start on it)."""
        return bool(st.eval_pending and st.staged is not None and st.staged > self.version
                    and self._swap_due(st.staged, time.monotonic()))

    def _draw(self, problems: PromptStream, source: Any) -> tuple[int, Any, list[int], int]:
        """The next prompt to generate, rendered (chat messages through the template), its token ids, its position
        and how many prompts right before it were passed over. A drawn prompt is replaced by the next one, while
        that one is ready now and next in the stream, when the prompt filter skips it (at most
        ``MAX_SKIPS_PER_DRAW`` times) or when it leaves no room in the context window (``prompt_fit.py``; counted
        in ``prompts_too_long``, at most ``MAX_TOO_LONG_PER_DRAW`` times): the group's id then names the passed
        over positions, which the driver's ledger counts as used up. A re-issued prompt (a resume's) is always
        generated; one too long is then dropped by the group runner (reason ``prompt_too_long``)."""
        fresh = problems.reissue_left == 0
        filt = self.prompt_filter if fresh else None
        passed_over = skipped = too_long = 0

        def can_pass() -> bool:  # the next draw is ready now and next in the stream (asked only when needed)
            return fresh and problems.next_is_contiguous and bool(source.prefetch(1))

        while True:
            seq, prompt = next(problems)
            prompt = self.chat.render(prompt)
            if filt is not None and skipped < MAX_SKIPS_PER_DRAW and can_pass() and not filt.admit(prompt):
                skipped += 1
            else:
                ids = self.chat.encode(prompt)
                fits = self._fit.fits(ids)  # raises PromptsTooLong when no prompt has fitted yet
                self.counters["prompts_too_long_max_tokens"] = self._fit.longest
                if fits or too_long >= MAX_TOO_LONG_PER_DRAW or not can_pass():
                    return seq, prompt, ids, passed_over
                too_long += 1
                self.counters["prompts_too_long"] = self.counters.get("prompts_too_long", 0) + 1
            passed_over += 1

    def _step_phase(self, st: LoopState, runner: GroupRunner, rewards: Any) -> None:
        """One engine step: new tokens stamped with the version that computed them, finished held-out requests
        collected; or, with nothing for the engine, a short wait while environments and late rewards run."""
        self.policy.flush()  # turns asked for since the last pump
        if not self.engine.has_unfinished_requests():
            self._clock.idle()
            # idle with groups in flight: they await their environment or a late reward
            self.timeline.enter("wait_env_or_reward" if self._groups else "wait_admission")
            time.sleep(0.002)
            runner.pump()  # environments and late rewards awaiting something other than the engine
            return
        self.timeline.enter("generate")
        outputs = self.engine.step()
        stamp = self._clock.step(self.version)
        # an environment's observation after a turn that ends here is stamped no older than the turn's tokens
        self.policy.version = max(getattr(self.policy, "version", stamp), stamp)
        finished = False
        for out in outputs:
            if out.request_id.startswith(EVAL_PREFIX):
                if out.finished:
                    self._eval_output(st, out, rewards, runner)
                continue
            c = out.outputs[0]
            lps = [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs or [])]
            self.counters["tokens"] += len(c.token_ids)
            # one output per sample: a request of n samples (a group's turns, see rollout.py) names it by index
            self.policy.on_output(out.request_id, list(c.token_ids), lps, stamp, c.finish_reason, c.index)
            finished = finished or c.finish_reason is not None
        if finished or runner.reward_tasks or time.monotonic() - runner.last_pump > 0.01:
            runner.pump()

    def _eval_output(self, st: LoopState, out: Any, rewards: Any, runner: GroupRunner) -> None:
        c = out.outputs[0]
        rid = out.request_id
        st.eval_out[rid] = Completion(self._decode(list(c.token_ids)), c.token_ids, c.finish_reason or "stop",
                                      self._heldout_ids[int(rid[len(EVAL_PREFIX):])])
        st.eval_pending -= 1
        if st.eval_pending == 0:
            self._record_eval(st.eval_version, st.eval_out, rewards, runner)
            st.eval_out = {}

