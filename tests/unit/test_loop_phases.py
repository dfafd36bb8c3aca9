"""The generator loop's phases, each driven by hand with a stand-in engine, buffer client and group runner (the
real loop runs them in turn on a vLLM engine: tests/integration)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from async_rlhf.config import load_config
from async_rlhf.env.base import Prompt
from async_rlhf.generator.engine_args import VersionClock
from async_rlhf.generator.loop_phases import EVAL_PREFIX, MAX_SKIPS_PER_DRAW, LoopPhases, LoopState
from async_rlhf.generator.prompt_filter import UninformativePromptFilter
from async_rlhf.generator.prompt_fit import PromptFit, context_len
from async_rlhf.generator.stream import PromptStream


@dataclass
class Engine:
    outputs: list[Any] = field(default_factory=list)
    requests: list[tuple[str, Any]] = field(default_factory=list)

    def add_request(self, rid: str, prompt: dict, params: Any) -> None:
        self.requests.append((rid, prompt["prompt_token_ids"]))

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs)

    def step(self) -> list[Any]:
        out, self.outputs = self.outputs, []
        return out


def output(rid: str, tokens: list[int], finished: bool, index: int = 0) -> Any:
    """vLLM's delta for sample ``index`` of a request (finish_reason only on its last delta)."""
    lps = [{t: SimpleNamespace(logprob=-0.5)} for t in tokens]
    return SimpleNamespace(request_id=rid, finished=finished,
                           outputs=[SimpleNamespace(token_ids=tokens, logprobs=lps, index=index,
                                                    finish_reason="stop" if finished else None)])


class Generator(LoopPhases):
    """The attributes the phases read, as plain values; loads and evaluations are recorded."""

    def __init__(self, *overrides: str, gen_id: int = 0, staged: int | None = None) -> None:
        self.cfg = load_config(None, ["generator.eval_every=2", "generator.groups_in_flight=3", *overrides])
        self.gen_id, self.version, self.engine = gen_id, 0, Engine()
        self.timeline = SimpleNamespace(states=[], enter=lambda s: self.timeline.states.append(s))
        self.counters: dict[str, Any] = {"tokens": 0}
        self.policy = SimpleNamespace(outputs=[], on_output=lambda *a: self.policy.outputs.append(a),
                                      flush=lambda: None)
        self.chat = SimpleNamespace(render=lambda p: Prompt(f"<{p.text}>"), encode=lambda p: [7, len(p.text)])
        self.prompt_filter: UninformativePromptFilter | None = None
        self._fit = PromptFit(context_len(self.cfg))
        self._heldout_ids = [[1, 2], [3]]
        self._awaiting_first, self._groups, self._draining = False, {}, threading.Event()
        self._position, self._run_tag, self._clock = 0, "t", VersionClock(0)
        self.staged_version, self.loads, self.evals = staged, [], []
        self._last_swap = time.monotonic()

    def _staged(self) -> int | None:
        return self.staged_version

    def _load_version(self) -> None:
        self.loads.append(self.staged_version)
        self.version, self.staged_version = self.staged_version, None

    def _decode(self, ids: list[int]) -> str:
        return ",".join(map(str, ids))

    def _record_eval(self, version: int, outputs: dict, rewards: Any, runner: Any) -> None:
        self.evals.append((version, sorted(outputs)))


class Runner:
    def __init__(self) -> None:
        self.started: list[tuple[str, str, list[int]]] = []
        self.pumps, self.reward_tasks, self.last_pump, self.groups = 0, set(), 0.0, {}

    def start(self, gid: str, prompt: Prompt, ids: list[int]) -> None:
        self.started.append((gid, prompt.text, ids))

    def pump(self) -> None:
        self.pumps += 1


def Problems(cycle: int = 0, reissue: tuple[int, ...] = (), start: int = 0) -> PromptStream[Prompt]:  # noqa: N802
    """The stream of prompts p0, p1, ... (``cycle``: p0 .. p<cycle-1> again and again) at positions 1, 2, ..."""
    texts = (f"p{n % cycle if cycle else n}" for n in itertools.count())
    return PromptStream((Prompt(t) for t in texts), start=start, reissue=reissue)


class Client:
    def __init__(self, granted: int, live: int = 0) -> None:
        self.granted, self.live, self.asked = granted, live, []

    def admit(self, want: int) -> tuple[int, int]:
        self.asked.append(want)
        return min(want, self.granted), self.live


SOURCE = SimpleNamespace(prefetch=lambda n: n)


def test_swap_loads_a_staged_version_unless_held_out_requests_or_drain_hold_it_back() -> None:
    gen, st = Generator(staged=3), LoopState()
    st.eval_pending = 1
    assert gen._swap_phase(st) is False and gen.loads == []  # held-out requests finish on one version
    st.eval_pending = 0
    assert gen._swap_phase(st) is True and gen.loads == [3] and gen.version == 3 and st.staged is None
    drain = Generator("generator.update_mode=drain", staged=1)
    drain._groups = {"g": object()}
    assert drain._swap_phase(LoopState()) is False and drain.loads == []  # drain: only once nothing is in flight
    late = Generator()
    late._awaiting_first = True
    assert late._swap_phase(LoopState()) is True and late.loads == [] and late.timeline.states == ["paused_for_push"]


def test_eval_requests_start_on_generator_zero_once_per_due_version() -> None:
    gen, st = Generator(), LoopState()
    gen.version = 2
    gen._eval_phase(st, "greedy")
    assert gen.engine.requests == [(f"{EVAL_PREFIX}0", [1, 2]), (f"{EVAL_PREFIX}1", [3])] and st.eval_pending == 2
    st.eval_pending = 0
    gen._eval_phase(st, "greedy")
    assert len(gen.engine.requests) == 2  # version 2 was evaluated already
    gen.version = 3
    gen._eval_phase(st, "greedy")
    assert len(gen.engine.requests) == 2  # no multiple of 2 reached since
    gen.version = 5  # coalesced swaps jumped over 4: evaluated at 5, once
    gen._eval_phase(st, "greedy")
    st.eval_pending = 0
    gen._eval_phase(st, "greedy")
    assert len(gen.engine.requests) == 4 and st.eval_version == 5
    other = Generator(gen_id=1)
    other.version = 2
    other._eval_phase(LoopState(), "greedy")
    assert other.engine.requests == []


def test_admission_starts_granted_groups_through_the_chat_template_and_backs_off_when_refused() -> None:
    gen, st, runner, client = Generator(), LoopState(), Runner(), Client(granted=2)
    gen._admit_phase(st, client, Problems(), SOURCE, runner, patience=1.0)
    assert client.asked == [3] and [(t, ids) for _, t, ids in runner.started] == [("<p0>", [7, 4]), ("<p1>", [7, 4])]
    assert gen._position == 2 and runner.pumps == 1 and st.last_refused > 0  # fewer than asked: wait a moment
    gen._admit_phase(st, client, Problems(), SOURCE, runner, patience=1.0)
    assert client.asked == [3]  # not asked again within 5 ms


def test_admission_serves_the_buffers_live_version_before_starting_groups() -> None:
    gen, st, runner = Generator(staged=4), LoopState(), Runner()
    gen._admit_phase(st, Client(granted=3, live=4), Problems(), SOURCE, runner, patience=1.0)
    assert gen.loads == [4] and gen.version == 4 and len(runner.started) == 3


def test_admission_with_a_swap_interval_starts_groups_behind_within_the_staleness_bound() -> None:
    gen, st, runner = Generator("generator.min_swap_interval_s=60", "train.max_staleness=2", staged=4), LoopState(), \
        Runner()
    gen.version = 3
    gen._admit_phase(st, Client(granted=1, live=4), Problems(), SOURCE, runner, patience=1.0)
    assert gen.loads == [] and gen.version == 3 and len(runner.started) == 1, "one behind: not due yet"
    gen.staged_version, st.last_refused = 5, 0.0
    gen._admit_phase(st, Client(granted=1, live=5), Problems(), SOURCE, runner, patience=1.0)
    assert gen.loads == [5] and len(runner.started) == 2, "two behind (max_staleness): loaded before starting"


def test_a_step_stamps_tokens_with_the_serving_version_and_collects_held_out_answers() -> None:
    gen, st, runner = Generator(), LoopState(), Runner()
    gen.version, st.eval_version, st.eval_pending = 5, 4, 2
    gen.engine.outputs = [output("g-0", [11, 12], False), output(f"{EVAL_PREFIX}1", [9], True)]
    gen._step_phase(st, runner, rewards=None)
    (rid, tokens, lps, stamp, reason, index), = gen.policy.outputs
    assert (rid, tokens, lps, reason, index) == ("g-0", [11, 12], [-0.5, -0.5], None, 0) and stamp == 5
    assert gen.counters["tokens"] == 2 and st.eval_pending == 1 and gen.evals == []
    gen.engine.outputs = [output(f"{EVAL_PREFIX}0", [8], True), output("g-1", [4], True, index=3)]
    gen._step_phase(st, runner, rewards=None)
    assert gen.policy.outputs[-1] == ("g-1", [4], [-0.5], 5, "stop", 3), "sample 3 of a request of n samples"
    assert gen.evals == [(4, [f"{EVAL_PREFIX}0", f"{EVAL_PREFIX}1"])] and st.eval_out == {}
    gen._step_phase(st, runner, rewards=None)  # nothing for the engine: wait, and let environments run
    assert gen.timeline.states[-1] == "wait_admission" and runner.pumps >= 1


def solved_filter(*solved: str, min_retry: float = 0.01) -> UninformativePromptFilter:
    """A filter that saw ``solved`` (rendered prompts) uniform in 10 groups in a row each."""
    filt = UninformativePromptFilter(min_retry, seed=0)
    for text in solved:
        for _ in range(10):
            filt.observe(Prompt(text), [1.0, 1.0])
    return filt


def test_admission_passes_over_prompts_the_filter_skips_and_counts_them() -> None:
    gen, st, runner = Generator(), LoopState(), Runner()
    gen.prompt_filter = solved_filter("<p0>", "<p2>", min_retry=0.0001)
    gen._admit_phase(st, Client(granted=2), Problems(cycle=4), SOURCE, runner, patience=1.0)
    assert [t for _, t, _ in runner.started] == ["<p1>", "<p3>"]
    assert [gid for gid, _, _ in runner.started] == ["g0-t-2~1", "g0-t-4~1"], "its position, and one passed over"
    assert gen.prompt_filter.skipped == 2 and gen._position == 4


def test_admission_never_filters_a_reissued_prompt_nor_skips_with_none_ready_and_bounds_its_draws() -> None:
    gen, runner = Generator(), Runner()
    gen.prompt_filter = solved_filter("<p0>", min_retry=0.0001)
    gen._admit_phase(LoopState(), Client(granted=1), Problems(cycle=1, reissue=(1,), start=1), SOURCE, runner, 1.0)
    assert [t for _, t, _ in runner.started] == ["<p0>"] and gen.prompt_filter.skipped == 0
    gen._admit_phase(LoopState(), Client(granted=1), Problems(cycle=1),
                     SimpleNamespace(prefetch=lambda n: 0 if n == 1 else n), runner, 1.0)
    assert len(runner.started) == 2 and gen.prompt_filter.skipped == 0, "nothing else ready: generated anyway"
    problems = Problems(cycle=1)  # every prompt solved: the last of MAX_SKIPS_PER_DRAW + 1 draws is generated
    gen._admit_phase(LoopState(), Client(granted=1), problems, SOURCE, runner, 1.0)
    assert len(runner.started) == 3 and problems.position == MAX_SKIPS_PER_DRAW + 1
    assert runner.started[-1][0] == f"g0-t-{MAX_SKIPS_PER_DRAW + 1}~{MAX_SKIPS_PER_DRAW}"
    assert gen.prompt_filter.skipped == MAX_SKIPS_PER_DRAW


def test_admission_waits_while_an_evaluation_holds_back_a_due_swap() -> None:
    """Groups admitted while held-out requests keep a due swap back would be born a version behind (issue 31)."""
    gen, st, runner, client = Generator(staged=4), LoopState(), Runner(), Client(granted=3, live=4)
    st.staged, st.eval_pending = 4, 1
    gen._admit_phase(st, client, Problems(), SOURCE, runner, patience=1.0)
    assert client.asked == [] and runner.started == [] and gen.loads == []
    st.eval_pending = 0  # the evaluation finished: the swap comes first, then the groups, on the new version
    assert gen._swap_phase(st) is True and gen.version == 4
    gen._admit_phase(st, client, Problems(), SOURCE, runner, patience=1.0)
    assert client.asked == [3] and len(runner.started) == 3


def test_a_turn_finished_after_a_swap_stamps_its_observation_no_older_than_its_tokens() -> None:
    """Observation tokens carry ``policy.version``; it was the version of the turn's request, older than the turn's
    own tokens when a swap came mid-turn (issue 31)."""
    gen, st, runner = Generator(), LoopState(), Runner()
    gen.policy.version = 0  # the turn was requested at version 0
    gen.version = 1  # swapped in while it ran
    gen.engine.outputs = [output("g-0", [11], True)]
    gen._step_phase(st, runner, rewards=None)
    assert gen.policy.outputs[-1][3] == 1 and gen.policy.version == 1
