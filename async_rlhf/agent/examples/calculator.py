"""The shipped tool-use agent (``agent.task=calculator``): the stock ``openai`` SDK, a calculator tool the model may
call, its result sent back as a ``tool`` message, the final answer scored.

    launch/cluster.py --generators 2 --learners 1 task.name=agent agent.task=calculator

(the task brings this agent, ``agent.tool_parser=tiny_calculator`` and ``generator.max_new_tokens=10``).

The policy sees the tool's definition through its chat template (the tiny tool policy's ignores it: its character
vocabulary cannot spell one) and writes a call in its own format, which the endpoint's tool parser turns into an
OpenAI tool call (``arguments``: ``{"expression": "12+34"}``).
"""

from __future__ import annotations

import json
from typing import Any

import openai
from openai import AsyncOpenAI

from async_rlhf.env.arithmetic import leading_digits
from async_rlhf.env.calculator import MAX_TOOL_ROUNDS, calculate

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates a sum or difference of integers, e.g. 12+34.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


def run_tool(arguments: str) -> str:
    """The calculator on a call's JSON arguments (``error`` for arguments it cannot read)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error"
    expression = args.get("expression") if isinstance(args, dict) else None
    return calculate(expression) if isinstance(expression, str) else "error"


async def run(task: dict[str, Any], client: AsyncOpenAI) -> float:
    messages: list[dict[str, Any]] = list(task["messages"])
    for _ in range(MAX_TOOL_ROUNDS + 1):
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except openai.BadRequestError:  # no room left in the context window: the episode ends unanswered
            return 0.0
        message = reply.choices[0].message
        if not message.tool_calls:
            return 1.0 if leading_digits(message.content or "") == task["answer"] else 0.0
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [{"id": c.id, "type": "function",
                                         "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                        for c in message.tool_calls]})
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call.function.arguments)})
    return 0.0  # still calling tools after MAX_TOOL_ROUNDS calls
