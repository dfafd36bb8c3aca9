"""The default agent of ``task.name=agent``: asks the policy the task's question with the stock ``openai`` SDK and
scores the answer. Any agent has this shape: ``async def run(task, client) -> reward``.

    launch/cluster.py --generators 2 --learners 1 task.name=agent agent.entry=async_rlhf.agent.examples.addition:run
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI


async def run(task: dict[str, Any], client: AsyncOpenAI) -> float:
    reply = await client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=8)
    answer = reply.choices[0].message.content or ""
    digits = ""
    for ch in answer.strip():  # the leading run of digits is the answer (the task's own rule)
        if not ch.isdigit():
            break
        digits += ch
    return 1.0 if digits == task["answer"] else 0.0
