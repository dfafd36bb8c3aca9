"""The tool-use variant of the addition task (``task.name=agent agent.task=calculator``, issue 45).

The same problems, prompts and held-out split as addition (``12+34=`` -> ``046``); the model may call a calculator
tool before it answers, in the tiny tool policy's format (``async_rlhf.tiny.tool_policy``)::

    12+34=<tool_call>12+34</tool_call></s><tool_response>46</tool_response>046</s>

and the agent that plays the episode (``async_rlhf.agent.examples.calculator``) executes the call and sends the
result back. The reward is the agent's: 1 when the final answer is right (the addition rule).

Held-out figures: the launcher's ``accuracy_start``/``accuracy_end`` play the whole protocol greedily
(``async_rlhf.policy_source.heldout_accuracy`` -> ``tool_policy.play_greedy``). The generators' periodic
evaluation sees the first turn only (greedy, one completion per prompt): there a call whose expression the
calculator answers with the sum counts as right (the tool is exact; what is not measured is copying its result,
which the warm start does near-perfectly), an answer by the addition rule.
"""

from __future__ import annotations

import re

from async_rlhf.env.arithmetic import AdditionEnv
from async_rlhf.env.base import Prompt

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"
MAX_TOOL_ROUNDS = 2
"""Tool calls one episode may make before its answer (the example agent's and the greedy evaluation's limit)."""
_CALL = re.compile(re.escape(CALL_START) + "(.*?)" + re.escape(CALL_END), re.S)
_EXPRESSION = re.compile(r"\d+(?:[+-]\d+)*")


def calculate(expression: str) -> str:
    """The calculator: integer sums and differences (``12+34`` -> ``46``); ``error`` for anything else."""
    if not _EXPRESSION.fullmatch(expression) or len(expression) > 20:
        return "error"
    total, sign, num = 0, 1, ""
    for ch in expression + "+":
        if ch.isdigit():
            num += ch
        else:
            total += sign * int(num)
            sign, num = (1 if ch == "+" else -1), ""
    return str(total)


def call_text(expression: str) -> str:
    """An assistant turn's text calling the calculator (eos not included)."""
    return f"{CALL_START}{expression}{CALL_END}"


def response_text(result: str) -> str:
    """The rendered tool message carrying ``result`` (what the tiny tool policy's template writes for it)."""
    return f"{RESPONSE_START}{result}{RESPONSE_END}"


def called_expression(text: str) -> str | None:
    """The expression of the first well-formed call in an assistant turn's text, None when it calls nothing."""
    m = _CALL.search(text)
    return m.group(1) if m else None


class CalculatorEnv(AdditionEnv):
    name = "calculator"

    def score_heldout(self, prompt: Prompt, completion: str) -> float:
        expression = called_expression(completion)
        if expression is None:
            return self.verify(prompt, completion)
        return 1.0 if calculate(expression) == str(int(prompt.data["answer"])) else 0.0
