"""Agents: the user's own agent code (an OpenAI SDK client) drives rollouts, token-exact (issue 45).

    ledger.py      EpisodeLedger: one episode's token ids, loss mask, behaviour log-probs and versions per branch,
                   exact by construction (sampled ids are never re-rendered); plan -> engine -> record
    tool_calls.py  ToolCallParser: assistant text -> content + tool calls, through vLLM's tool-call parsers
    engine.py      TokenEngine: the seam to the engine (prompt ids -> sampled ids, log-probs, versions; streamed)
    episodes.py    EpisodeRegistry: episode id -> ledger, calls serialized, deadlines, idempotent retries
    endpoint.py    build_app: the OpenAI-compatible HTTP app (/s/<episode id>/v1/chat/completions; fastapi)
    policy_engine  PolicyEngine: the TokenEngine of a generator (calls become turns of its vLLM engine loop)
    serving.py     AgentServer: per generator, the endpoint on one thread, the user's agents on another
    environment.py AgentEnv: a group's episodes played by the agent; ledgers -> trained samples (token-checked)
    build.py       serve_agents: the generator's AgentEnv from the configuration (task.name=agent)
    examples/      the shipped agents (addition, calculator: stock openai SDK)

Nothing here imports transformers or vLLM at module level: the tokenizer is passed in, vLLM's parser is
imported on the first completion that needs it. endpoint.py imports fastapi; this package's import does not.
"""

from async_rlhf.agent.ledger import EpisodeLedger
from async_rlhf.agent.tool_calls import ParsedCompletion, ToolCallParser
from async_rlhf.agent.turns import Branch, Plan, RecordedTurn, common_prompt_len

__all__ = ["Branch", "EpisodeLedger", "ParsedCompletion", "Plan", "RecordedTurn", "ToolCallParser",
           "common_prompt_len"]
