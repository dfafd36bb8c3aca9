"""vLLM tool-call parser ``tiny_calculator``: the tiny tool policy's compact format (``async_rlhf.tiny.tool_policy``).

    <tool_call>12+34</tool_call>   ->   calculator({"expression": "12+34"})

Hermes wants a JSON object per call, which a character-level model with a 64-token window cannot afford; this
parser is registered with vLLM's maintained plugin API (``ToolParserManager.register_module``, the mechanism of
``vllm serve --tool-parser-plugin``), so ``vllm serve --tool-parser-plugin async_rlhf/agent/tiny_tool_parser.py
--tool-call-parser tiny_calculator`` would serve the same format. ``agent.tool_parser=tiny_calculator`` loads it
(``async_rlhf.agent.tool_calls.PLUGINS``).

The call's name is the request's tool when it offers exactly one function, else ``calculator``. Text before the
first call is the content. Malformed (a call opened and not closed, an empty expression, a closing marker with no
call): ``tools_called=False`` with the whole text as content, which ``ToolCallParser`` reports as a parse error.
Streaming is not implemented: the endpoint answers a turn in one piece (docs/agents.md).
"""

from __future__ import annotations

import json
import re

from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager

NAME = "tiny_calculator"
START, END = "<tool_call>", "</tool_call>"
DEFAULT_TOOL = "calculator"
_CALL = re.compile(re.escape(START) + "(.*?)" + re.escape(END), re.S)


@ToolParserManager.register_module(NAME)
class TinyCalculatorToolParser(ToolParser):
    """``<tool_call>EXPRESSION</tool_call>`` -> a call with arguments ``{"expression": EXPRESSION}``."""

    tool_call_start_token = START
    tool_call_end_token = END
    supports_required_and_named = False  # no JSON schema to force: the format is not JSON

    def extract_tool_calls(self, model_output: str, request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        if START not in model_output:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        calls = _CALL.findall(model_output)
        opened, closed = model_output.count(START), model_output.count(END)
        if not calls or len(calls) != opened or opened != closed or any(not c.strip() for c in calls):
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        name = _tool_name(request)
        content = model_output[:model_output.find(START)]
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[ToolCall(function=FunctionCall(name=name, arguments=json.dumps({"expression": c})))
                        for c in calls],
            content=content or None)


def _tool_name(request: ChatCompletionRequest) -> str:
    tools = [t for t in request.tools or [] if getattr(t, "type", "function") == "function"]
    return tools[0].function.name if len(tools) == 1 else DEFAULT_TOOL
