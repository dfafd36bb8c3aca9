"""Multi-turn environment: guess a secret digit from higher/lower hints, with a reward after every turn.

    prompt  "guess 0-9:"                     secret 6
    turn 1  policy "3"      env " higher:"   turn reward -0.1
    turn 2  policy "8"      env " lower:"    turn reward -0.1
    turn 3  policy "6"      (episode ends)   turn reward +1.0

The first digit of a turn is the guess; a turn without a digit is a wrong guess answered " digit:". The hint
tokens are observations: in the context of later turns, never trained. A correct guess earns 1, every wrong
turn costs ``step_penalty``, so fewer turns mean a higher return; the secret is never in the prompt, only the
hints reveal it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from async_rlhf.env.base import Environment, Policy, Prompt, Trajectory

PROMPT = "guess 0-9:"


def first_digit(text: str) -> int | None:
    for ch in text:
        if ch.isdigit():
            return int(ch)
    return None


def hint(guess: int | None, secret: int) -> str:
    """The observation after a wrong guess."""
    if guess is None:
        return " digit:"
    return " higher:" if guess < secret else " lower:"


class GuessNumberEnv(Environment):
    name = "guess_number"

    def __init__(self, max_turns: int = 4, step_penalty: float = 0.1) -> None:
        if max_turns < 1:
            raise ValueError(f"task.max_turns must be at least 1, got {max_turns}")
        self.max_turns = max_turns
        self.step_penalty = step_penalty

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng = random.Random(f"guess-number-{seed}")
        while True:
            yield Prompt(PROMPT, {"secret": rng.randrange(10)})

    async def rollout(self, prompt: Prompt, prompt_ids: list[int], policy: Policy) -> Trajectory:
        secret = int(prompt.data["secret"])
        traj = Trajectory()
        context = list(prompt_ids)
        for turn_no in range(self.max_turns):
            turn = await policy.generate(context)
            if not turn.token_ids:  # no room left in the context window
                break
            text = policy.decode(turn.token_ids)
            traj.add_turn(turn, text)
            guess = first_digit(text)
            if guess == secret:
                traj.reward_last_turn(1.0)
                return traj
            traj.reward_last_turn(-self.step_penalty)
            if turn_no == self.max_turns - 1:
                break
            obs = policy.encode(hint(guess, secret))
            traj.add_observation(obs, policy.version)
            context = context + turn.token_ids + obs
        return traj

    def verify(self, prompt: Prompt, completion: str) -> float:
        """The final reward of source ``task``: none beyond the per-turn rewards."""
        return 0.0
