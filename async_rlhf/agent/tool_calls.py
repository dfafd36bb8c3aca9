"""Tool calls out of an assistant completion's text, through vLLM's own tool-call parsers.

    parser = ToolCallParser(tokenizer)                # hermes: <tool_call>{"name": .., "arguments": {..}}</tool_call>
    parser.parse('Let me add. <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>', tools)
      -> ParsedCompletion(content='Let me add. ', tool_calls=[('calc', '{"e": "1+2"}')], error=False)
    parser.parse('<tool_call>{"name": "calc", "arguments": {1+2}}</tool_call>', tools)
      -> ParsedCompletion(content='<tool_call>{"name": ...}</tool_call>', tool_calls=[], error=True)

The parsing is vLLM's (``ToolParserManager.get_tool_parser(name)(tokenizer)`` and its ``extract_tool_calls(text,
ChatCompletionRequest)``: the maintained public API its OpenAI server uses), built lazily on the first completion
that needs it: importing ``vllm.tool_parsers`` takes seconds, and a hermes completion without ``<tool_call>`` is
answered without it (the same first check vLLM's hermes parser makes). No engine is needed.

Names are vLLM's (``vllm serve --tool-call-parser``), plus the project's own parsers in ``PLUGINS``, registered with
vLLM's ToolParserManager on first use like a ``--tool-parser-plugin``: ``tiny_calculator``, the tiny tool policy's
``<tool_call>12+34</tool_call>`` (``async_rlhf.agent.tiny_tool_parser``).

Never an exception for what the model wrote: a completion whose tool call does not parse (bad JSON, no name, no
``arguments``, arguments that are not a JSON object) comes back whole as plain content with ``error=True``. vLLM's
parser logs a traceback for each such completion; that one record is dropped while it parses here (an RL run
samples malformed calls by the thousand). Tool calls get no ids here: the ledger issues them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

HERMES_START = "<tool_call>"
PLUGINS = {"tiny_calculator": ("async_rlhf.agent.tiny_tool_parser", "TinyCalculatorToolParser")}
"""The project's own parsers, registered with vLLM's ToolParserManager on first use (lazily: importing a parser
module imports vLLM), so ``agent.tool_parser`` names them like vLLM's."""
CALL_START = {"hermes": HERMES_START, "tiny_calculator": "<tool_call>"}
"""A parser's call marker: a completion without it is plain content, answered without importing vLLM."""


@dataclass(frozen=True)
class ParsedCompletion:
    """An assistant completion split into content and tool calls."""

    content: str | None
    """Text outside the tool calls (None when there is none next to a call); the whole text when ``error``."""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)
    """(function name, arguments as a JSON object text) of each call, in order."""
    error: bool = False
    """The text holds a tool call that does not parse: it is returned as content, with no calls."""


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


class ToolCallParser:
    """One vLLM tool-call parser (``name`` as in ``vllm serve --tool-call-parser``) over ``tokenizer``."""

    def __init__(self, tokenizer: Any, name: str = "hermes") -> None:
        self.tokenizer = tokenizer
        self.name = name
        self._parser: Any = None
        self._logger: logging.Logger | None = None

    def _vllm_parser(self) -> Any:
        if self._parser is None:
            from vllm.tool_parsers import ToolParserManager

            if self.name in PLUGINS and self.name not in ToolParserManager.tool_parsers:
                ToolParserManager.register_lazy_module(self.name, *PLUGINS[self.name])
            cls = ToolParserManager.get_tool_parser(self.name)
            self._parser = cls(self.tokenizer)
            self._logger = logging.getLogger(cls.__module__)
        return self._parser

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedCompletion:
        """Content and tool calls of a complete assistant text (stop token excluded); ``tools`` are the request's
        OpenAI tool definitions (some parsers read their schemas; hermes does not)."""
        if self.name in CALL_START and CALL_START[self.name] not in text:
            return ParsedCompletion(content=text)
        parser = self._vllm_parser()
        try:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

            request = ChatCompletionRequest(model="ledger", messages=[], tools=tools or None)
        except Exception:  # tool definitions vLLM does not accept: parse without them
            request = ChatCompletionRequest(model="ledger", messages=[])
        drop = _DropRecords()
        assert self._logger is not None
        self._logger.addFilter(drop)
        try:
            info = parser.extract_tool_calls(text, request)
        except Exception:
            return ParsedCompletion(content=text, error=True)
        finally:
            self._logger.removeFilter(drop)
        if not info.tools_called:
            # vLLM answers a call it could not parse with the text as content and no calls
            return ParsedCompletion(content=text, error=self._has_marker(text))
        calls = []
        for call in info.tool_calls:
            name, arguments = call.function.name, call.function.arguments
            try:
                ok = isinstance(name, str) and bool(name) and isinstance(json.loads(arguments), dict)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                return ParsedCompletion(content=text, error=True)
            calls.append((name, arguments))
        return ParsedCompletion(content=info.content or None, tool_calls=calls)

    def _has_marker(self, text: str) -> bool:
        """Whether the text starts a tool call in this parser's format (then no calls parsed means malformed)."""
        start = getattr(self._parser, "tool_call_start_token", None) or CALL_START.get(self.name)
        return start is not None and start in text
