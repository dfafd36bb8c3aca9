"""Agents: the user's own agent code (an OpenAI SDK client) drives rollouts, token-exact (issue 45).

    ledger.py      EpisodeLedger: one episode's token ids, loss mask, behaviour log-probs and versions per branch,
                   exact by construction (sampled ids are never re-rendered); plan -> engine -> record
    tool_calls.py  ToolCallParser: assistant text -> content + tool calls, through vLLM's tool-call parsers

Nothing here imports transformers or vLLM at module level: the tokenizer is passed in, vLLM's parser is
imported on the first completion that needs it.
"""

from async_rlhf.agent.ledger import Branch, EpisodeLedger, Plan, RecordedTurn, common_prompt_len
from async_rlhf.agent.tool_calls import ParsedCompletion, ToolCallParser

__all__ = ["Branch", "EpisodeLedger", "ParsedCompletion", "Plan", "RecordedTurn", "ToolCallParser",
           "common_prompt_len"]
