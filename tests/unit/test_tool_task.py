"""The tool-use task (issue 45 item 5): the tiny tool policy's tokenizer and chat template, the ``tiny_calculator``
tool-call parser (vLLM's parser API), the agent ledger over a tool episode, the SFT teachers' data and the greedy
protocol the held-out figure plays."""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest
import torch

from async_rlhf.agent.examples.calculator import CALCULATOR, run_tool
from async_rlhf.agent.ledger import EpisodeLedger
from async_rlhf.agent.tool_calls import ToolCallParser
from async_rlhf.env.arithmetic import AdditionTask
from async_rlhf.env.base import Prompt
from async_rlhf.env.calculator import CalculatorEnv, calculate, call_text, called_expression, response_text
from async_rlhf.tiny.tool_policy import TOOL_TOKENS, build_tool_tokenizer, play_greedy
from async_rlhf.tiny.tool_sft import episode, teacher_batch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tool_tokenizer()


def call_message(expression: str, call_id: str = "c0") -> dict[str, Any]:
    function = {"name": "calculator", "arguments": {"expression": expression}}
    return {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                                                                  "function": function}]}


EPISODE = [{"role": "user", "content": "12+34="}, call_message("12+34"),
           {"role": "tool", "tool_call_id": "c0", "content": "46"}, {"role": "assistant", "content": "046"}]


def test_markers_are_one_token_each_and_survive_a_decode_that_skips_special_tokens(tok: Any) -> None:
    ids = [tok.convert_tokens_to_ids(t) for t in TOOL_TOKENS]
    assert len(set(ids)) == 4 and all(i != tok.unk_token_id for i in ids)
    text = "12+34=" + call_text("12+34")
    enc = tok.encode(text, add_special_tokens=False)
    assert len(enc) == 6 + 1 + 5 + 1
    assert tok.decode(enc, skip_special_tokens=True) == text  # the generator's evaluation sees the call


def test_template_renders_an_episode_compactly_and_is_append_only(tok: Any) -> None:
    text = tok.apply_chat_template(EPISODE, tokenize=False)
    assert text == "12+34=<tool_call>12+34</tool_call></s><tool_response>46</tool_response>046</s>"
    assert len(tok.encode(text, add_special_tokens=False)) <= 32  # well inside the 64-token window
    for n in range(1, len(EPISODE)):
        head = tok.apply_chat_template(EPISODE[:n], tokenize=False)
        assert text.startswith(head) and head == tok.apply_chat_template(EPISODE[:n], tokenize=False,
                                                                          add_generation_prompt=True)
    # the task's own prompt is what a one-message episode renders; tools and a system message render nothing
    assert tok.apply_chat_template(EPISODE[:1], tools=[CALCULATOR], tokenize=False) == "12+34="
    with_system = [{"role": "system", "content": "You may use tools."}, *EPISODE]
    assert tok.apply_chat_template(with_system, tools=[CALCULATOR], tokenize=False) == text


def test_parser_reads_the_compact_call_through_vllms_api(tok: Any) -> None:
    parser = ToolCallParser(tok, "tiny_calculator")
    parsed = parser.parse(call_text("12+34"), [CALCULATOR])
    assert parsed.tool_calls == [("calculator", '{"expression": "12+34"}')] and parsed.content is None
    assert not parsed.error
    # a subclass of vLLM's ToolParser, registered with its ToolParserManager (the --tool-parser-plugin mechanism)
    assert "ToolParser" in [c.__name__ for c in type(parser._parser).__mro__]
    assert "tiny_calculator" in sys.modules["vllm.tool_parsers"].ToolParserManager.list_registered()
    assert parser.parse("046", [CALCULATOR]).tool_calls == []
    assert not parser.parse("046", [CALCULATOR]).error


@pytest.mark.parametrize("text", ["<tool_call>12+3", "<tool_call></tool_call>",
                                  "<tool_call>1+2</tool_call></tool_call>", "<tool_call><tool_call>1</tool_call>"])
def test_a_malformed_call_is_content_with_a_flag(tok: Any, text: str) -> None:
    parsed = ToolCallParser(tok, "tiny_calculator").parse(text, [CALCULATOR])
    assert parsed.error and parsed.tool_calls == [] and parsed.content == text


def test_ledger_ids_of_a_tool_episode_extend_exactly_and_equal_the_template(tok: Any) -> None:
    eos = tok.eos_token_id
    led = EpisodeLedger(tok, {}, "e", [eos], "tiny_calculator")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "12+34="}]
    p1 = led.plan(messages, [CALCULATOR])
    out1 = tok.encode(call_text("12+34"), add_special_tokens=False) + [eos]
    t1 = led.record(p1, out1, [-0.5] * len(out1), [3] * len(out1))
    assert t1.finish_reason == "tool_calls" and t1.message["content"] is None
    call = t1.message["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "12+34"}'}
    messages += [t1.message, {"role": "tool", "tool_call_id": call["id"], "content": run_tool(
        call["function"]["arguments"])}]
    p2 = led.plan(messages, [CALCULATOR])
    assert not p2.fork and p2.prompt_ids[:len(p1.prompt_ids) + len(out1)] == p1.prompt_ids + out1
    assert p2.prompt_ids[len(p1.prompt_ids) + len(out1):] == tok.encode(response_text("46"), add_special_tokens=False)
    out2 = tok.encode("046", add_special_tokens=False) + [eos]
    t2 = led.record(p2, out2, [-0.1] * 4, [4] * 4)
    (branch,) = led.branches()
    assert branch.ids == p2.prompt_ids + out2
    assert branch.ids == tok.encode(tok.apply_chat_template(EPISODE, tokenize=False), add_special_tokens=False)
    assert branch.mask == [0] * 6 + [1] * len(out1) + [0] * 4 + [1] * 4
    assert branch.versions[-4:] == [4] * 4 and t2.message == {"role": "assistant", "content": "046"}
    assert led.counters["tool_calls"] == 1 and led.counters["forks"] == led.counters["token_mismatch"] == 0


def test_ledger_answers_a_malformed_call_as_content_and_counts_it(tok: Any) -> None:
    eos = tok.eos_token_id
    led = EpisodeLedger(tok, {}, "e", [eos], "tiny_calculator")
    plan = led.plan([{"role": "user", "content": "11+11="}], [CALCULATOR])
    out = tok.encode("<tool_call>11+1", add_special_tokens=False) + [eos]
    turn = led.record(plan, out, [0.0] * len(out), [0] * len(out))
    assert turn.message == {"role": "assistant", "content": "<tool_call>11+1"} and turn.tool_parse_error
    assert led.counters["tool_parse_errors"] == 1 and led.counters["tool_calls"] == 0


def test_calculator_and_its_scoring() -> None:
    assert calculate("12+34") == "46" and calculate("5-12") == "-7" and calculate("07+03") == "10"
    for bad in ("", "1+", "+1", "1*2", "a", "1" * 30):
        assert calculate(bad) == "error"
    assert run_tool('{"expression": "1+2"}') == "3" and run_tool("{1+2}") == "error" and run_tool("[]") == "error"
    assert called_expression("x" + call_text("1+2") + "y") == "1+2" and called_expression("046") is None
    env = CalculatorEnv(AdditionTask())
    prompt = env.to_prompt(AdditionTask().make(12, 34))
    assert isinstance(prompt, Prompt)
    assert env.score_heldout(prompt, call_text("12+34")) == 1.0
    assert env.score_heldout(prompt, call_text("12+43")) == 0.0
    assert env.score_heldout(prompt, "046") == 1.0 and env.score_heldout(prompt, "036") == 0.0


def test_teacher_episodes_are_the_template_with_mask_on_assistant_turns(tok: Any) -> None:
    task = AdditionTask()
    p = task.make(17, 25)
    ids, mask = episode(tok, p, None)
    messages = [{"role": "user", "content": p.prompt}, call_message("17+25"),
                {"role": "tool", "tool_call_id": "c0", "content": "42"}, {"role": "assistant", "content": "042"}]
    assert ids == tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert mask == [0] * 6 + [1] * 8 + [0] * 4 + [1] * 4
    ids, mask = episode(tok, p, task.carry_free_answer(p))
    assert tok.decode(ids, skip_special_tokens=False) == "17+25=032</s>" and mask == [0] * 6 + [1] * 4
    problems = [task.make(a, b) for a in range(10, 90, 3) for b in range(10, 90, 3)]
    calls = [len(ids) > 10 for ids, _ in teacher_batch(tok, problems, task, random.Random(0), sloppy=True)]
    assert 0.2 < sum(calls) / len(calls) < 0.4
    clean = teacher_batch(tok, problems, task, random.Random(0), sloppy=False)
    assert all(tok.decode(ids, skip_special_tokens=False).endswith(p.answer + "</s>")
               for (ids, _), p in zip(clean, problems, strict=True))


class ScriptedModel(torch.nn.Module):
    """A causal LM that writes a script (prompt -> the whole episode after it, tool results included, which the
    protocol appends): the protocol without training."""

    def __init__(self, tok: Any, script: dict[str, str]) -> None:
        super().__init__()
        self.tok, self.script = tok, script
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any = None) -> Any:
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], len(self.tok))
        for row, (ids, att) in enumerate(zip(input_ids.tolist(), attention_mask.tolist(), strict=True)):
            context = self.tok.decode([i for i, a in zip(ids, att, strict=True) if a], skip_special_tokens=False)
            prompt = next(k for k in self.script if context.startswith(k))
            done, whole = context[len(prompt):], self.script[prompt]
            rest = whole[len(done):] if whole.startswith(done) else ""  # a finished row keeps being fed
            nxt = self.tok.encode(rest, add_special_tokens=False)[0] if rest else self.tok.eos_token_id
            logits[row, -1, nxt] = 1.0
        return type("Out", (), {"logits": logits})()


def test_play_greedy_calls_the_tool_and_answers_with_its_result(tok: Any) -> None:
    task = AdditionTask()
    problems = [task.make(12, 34), task.make(17, 25), task.make(10, 10)]
    script = {"12+34=": call_text("12+34") + "</s>" + response_text("46") + "046</s>",
              "17+25=": "032</s>",  # from memory, the carry forgotten
              "10+10=": call_text("10+11") + "</s>" + response_text("21") + "021</s>"}  # a miscopied call
    figures = play_greedy(ScriptedModel(tok, script), tok, problems)
    assert figures == {"accuracy": pytest.approx(1 / 3), "tool_share": pytest.approx(2 / 3)}


def test_the_calculator_task_starts_from_the_tool_policys_build(tmp_path: Any) -> None:
    from async_rlhf.config import Config
    from async_rlhf.policy_source import resolve_model
    from async_rlhf.tiny.cache import INFO_FILE
    from async_rlhf.tiny.tool_sft import tool_policy_dir

    cfg = Config()
    cfg.task.name, cfg.agent.task = "agent", "calculator"
    build = tool_policy_dir(tmp_path, cfg.task, seed=cfg.train.seed)
    build.mkdir()
    (build / INFO_FILE).write_text("{}")  # a finished build: found without building or importing torch
    assert resolve_model(cfg, tmp_path) == str(build)
    assert build.name.startswith("tiny-tool-") and build != tool_policy_dir(tmp_path, cfg.task, seed=1)
