"""The addition task: short prompts with a verifiable integer answer and a binary reward.

Format: operands zero-padded to ``digits`` characters, the sum zero-padded to ``digits + 1`` characters, e.g.
with ``digits=2``: prompt ``"07+45="``, answer ``"052"``. Every answer has the same width, so each output
position has one meaning (carry digit, tens, units); with variable-width answers the SFT of the tiny model
plateaued for hundreds of steps on most seeds, with fixed width it learns within ~100-250 steps on every seed
we tried. The SFT target is the answer; the SFT appends eos.

Reward rule: leading whitespace of the completion is stripped, then the maximal run of leading digits is
compared with the answer string. Anything after that run (the eos string, padding, more text) is ignored;
an empty run, a wrong sum or a different width (``"52"`` for ``"052"``) scores 0.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from async_rlhf.env.base import Prompt, SingleTurnEnv


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    prompt: str
    answer: str


def leading_digits(text: str) -> str:
    text = text.lstrip()
    end = 0
    while end < len(text) and text[end] in "0123456789":
        end += 1
    return text[:end]


def score_completion(problem: Problem, completion_text: str) -> float:
    """The reward rule of the module docstring; needs no task instance."""
    return 1.0 if leading_digits(completion_text) == problem.answer else 0.0


class AdditionTask:
    """``a + b`` with operands in ``[0, 10**digits)``; a fixed held-out split never appears in training."""

    def __init__(self, digits: int = 2, heldout_size: int = 200, seed: int = 0) -> None:
        if digits < 1:
            raise ValueError(f"digits must be at least 1, got {digits}")
        self.digits = digits
        self.seed = seed
        self.space = 10 ** (2 * digits)
        if not 0 <= heldout_size <= self.space // 2:
            raise ValueError(
                f"heldout_size={heldout_size} must be between 0 and half of the {self.space} possible "
                f"problems with digits={digits}"
            )
        # A separate stream from training: the held-out set depends on the seed only.
        rng = random.Random(f"addition-heldout-{digits}-{seed}")
        codes = rng.sample(range(self.space), heldout_size)
        self._heldout_codes = frozenset(codes)
        self._heldout = [self.make(*divmod(code, 10**digits)) for code in codes]

    def make(self, a: int, b: int) -> Problem:
        """The problem ``a + b`` in this task's format."""
        d = self.digits
        return Problem(a=a, b=b, prompt=f"{a:0{d}d}+{b:0{d}d}=", answer=f"{a + b:0{d + 1}d}")

    def heldout(self) -> list[Problem]:
        """The held-out problems (fixed order, deterministic from the seed)."""
        return list(self._heldout)

    def is_heldout(self, problem: Problem) -> bool:
        return problem.a * 10**self.digits + problem.b in self._heldout_codes

    def train_problems(self, seed: int) -> Iterator[Problem]:
        """Infinite deterministic stream of uniformly drawn training problems (held-out ones skipped)."""
        rng = random.Random(f"addition-train-{self.digits}-{seed}")
        while True:
            code = rng.randrange(self.space)
            if code in self._heldout_codes:
                continue
            yield self.make(*divmod(code, 10**self.digits))

    def reward(self, problem: Problem, completion_text: str) -> float:
        """1.0 when the leading digit run of the completion equals the answer, else 0.0 (see module doc)."""
        return score_completion(problem, completion_text)

    def completion_target(self, problem: Problem) -> str:
        """What the SFT trains on after the prompt (eos appended by the SFT): the correct answer."""
        return problem.answer

    def carry_free_answer(self, problem: Problem) -> str:
        """The answer of a student who forgets every carry: digit-wise sums mod 10, same width.

        Equal to the correct answer exactly when the addition has no carry (about 30% of 2-digit problems).
        The SFT warm start mixes it in as a sloppy teacher (see ``async_rlhf.tiny.sft``).
        """
        d = self.digits
        digits = (str((int(x) + int(y)) % 10) for x, y in zip(f"{problem.a:0{d}d}", f"{problem.b:0{d}d}"))
        return "0" + "".join(digits)

    def has_carry(self, problem: Problem) -> bool:
        return self.carry_free_answer(problem) != problem.answer

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.digits + 2

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1


class AdditionEnv(SingleTurnEnv):
    """The addition task as an environment: its problems as prompts, its exact-answer rule as verifier."""

    name = "addition"

    def __init__(self, task: AdditionTask) -> None:
        self.task = task

    @staticmethod
    def to_prompt(problem: Problem) -> Prompt:
        return Prompt(problem.prompt, {"a": problem.a, "b": problem.b, "answer": problem.answer})

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return (self.to_prompt(p) for p in self.task.train_problems(seed))

    def verify(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if leading_digits(completion) == str(prompt.data["answer"]) else 0.0

    def heldout(self) -> list[Prompt]:
        return [self.to_prompt(p) for p in self.task.heldout()]


class RewardModelEnv(AdditionEnv):
    """Addition prompts scored by a reward model (``rewards.sources=model``); the exact-answer rule is kept
    for the held-out evaluation only, so the reward the policy trains on is the model's alone."""

    name = "reward_model"

    @property
    def has_verifier(self) -> bool:
        return False
