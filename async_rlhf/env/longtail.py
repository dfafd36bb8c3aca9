"""The long-tail task: correct responses from 1 to 40 tokens, most short, a few very long.

Prompt ``"37*05="`` asks for the two-digit pattern ``37`` written out to exactly 5 characters: ``"37373"``.
The length ``n`` (1..40) is drawn with probability proportional to ``1 / n`` (training mean ~11, one
problem in 11 asks for 30 or more characters), so in a batch of 16 prompt groups the longest answer is usually 4x the
mean: the tail that makes synchronous RL wait for its slowest sample while the engine runs nearly empty.

The reward rule is the addition task's (``async_rlhf.env.arithmetic.score_completion``): the maximal
leading run of digits must equal the answer, so stopping early and running on both score 0. Problems are
``Problem(a=pattern, b=length, ...)`` like addition's, so the generator rebuilds them from ``a`` and ``b``.
The tiny model learns the pattern at once; its SFT warm start learns from a teacher who counts in pairs
(:meth:`LongTailTask.sloppy_answer`), so RL has to teach it to stop after an odd number of characters.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator

from async_rlhf.env.arithmetic import AdditionEnv, Problem, score_completion

MAX_LENGTH = 40
"""Longest answer, in characters (= tokens of the character tokenizer), eos not counted."""
PATTERNS = 100


def length_weights(max_length: int = MAX_LENGTH) -> list[float]:
    """P(n) proportional to 1/n for n = 1..max_length (index n - 1)."""
    raw = [1.0 / n for n in range(1, max_length + 1)]
    total = sum(raw)
    return [w / total for w in raw]


class LongTailTask:
    """Pattern repetition to a heavy-tailed length; a fixed held-out split (same length law) never trained on."""

    def __init__(self, heldout_size: int = 200, seed: int = 0, max_length: int = MAX_LENGTH) -> None:
        if not 1 <= max_length <= 40:
            raise ValueError(f"max_length={max_length} must be in 1..40 (prompt + answer must fit the tiny "
                             "model's 64 positions)")
        self.max_length = max_length
        self.space = PATTERNS * max_length
        if not 0 <= heldout_size <= self.space // 2:
            raise ValueError(f"heldout_size={heldout_size} must be between 0 and half of the {self.space} "
                             "possible long-tail problems")
        self._cumulative = list(itertools.accumulate(length_weights(max_length)))
        rng = random.Random(f"longtail-heldout-{max_length}-{seed}")
        codes: dict[int, None] = {}
        while len(codes) < heldout_size:
            codes[self._draw_code(rng)] = None
        self._heldout_codes = frozenset(codes)
        self._heldout = [self.make(*self._decode(code)) for code in codes]

    def _draw_code(self, rng: random.Random) -> int:
        n = min(self.max_length, bisect.bisect_left(self._cumulative, rng.random()) + 1)
        return rng.randrange(PATTERNS) * self.max_length + (n - 1)

    def _decode(self, code: int) -> tuple[int, int]:
        pattern, n_minus_1 = divmod(code, self.max_length)
        return pattern, n_minus_1 + 1

    def make(self, a: int, b: int) -> Problem:
        """Pattern ``a`` (0..99) written out to ``b`` characters."""
        if not (0 <= a < PATTERNS and 1 <= b <= self.max_length):
            raise ValueError(f"long-tail problem needs pattern 0..{PATTERNS - 1} and length 1..{self.max_length}, "
                             f"got ({a}, {b})")
        return Problem(a=a, b=b, prompt=f"{a:02d}*{b:02d}=", answer=(f"{a:02d}" * self.max_length)[:b])

    def heldout(self) -> list[Problem]:
        return list(self._heldout)

    def is_heldout(self, problem: Problem) -> bool:
        return problem.a * self.max_length + problem.b - 1 in self._heldout_codes

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Infinite deterministic stream with the heavy-tailed length law (held-out problems skipped)."""
        rng = random.Random(f"longtail-train-{self.max_length}-{seed}")
        while True:
            code = self._draw_code(rng)
            if code not in self._heldout_codes:
                yield self.make(*self._decode(code))

    def reward(self, problem: Problem, completion_text: str) -> float:
        return score_completion(problem, completion_text)

    def completion_target(self, problem: Problem) -> str:
        return problem.answer

    def sloppy_answer(self, problem: Problem) -> str:
        """The SFT's sloppy teacher (``task.sft_forget_carry`` of its targets): it counts in pairs, so an odd
        length gets one character too many. Right exactly on even lengths (~42% of problems); RL has to learn
        to stop on odd ones."""
        n = problem.b + problem.b % 2
        return (f"{problem.a:02d}" * self.max_length)[:n]

    @property
    def max_prompt_chars(self) -> int:
        return 6

    @property
    def max_answer_chars(self) -> int:
        return self.max_length


class LongTailEnv(AdditionEnv):
    """The long-tail task as a single-turn environment: the same prompt data (operands and answer) and the same
    exact-leading-digits verifier as addition, over this task's problems."""

    name = "longtail"

    def __init__(self, task: LongTailTask) -> None:
        self.task = task  # type: ignore[assignment]
