"""The agent episode ledger (async_rlhf/agent/ledger.py): the trained ids are the engine's ids, exactly.

The "engine" here is the test choosing output ids: canonical ones (the encoding of the text the template would
render), adversarial ones (pairs of tokens the BPE merges into one when their text is re-encoded) and random ones.
Templates: the tiny llama_bpe's own (``<|user|>..<|end|>``, no tool support), the real Qwen2.5 template (tools,
``<|im_end|>\\n`` after every turn) on the llama_bpe tokenizer with Qwen's added tokens, a plain-text template
whose generation prompt ends in a space (a BPE merge across the prompt/sample boundary), and one that strips
thinking from earlier turns (not append-only).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from agent_templates import QWEN25_TEMPLATE, TOOLS, fresh_tokenizer  # tests/agent_templates.py

from async_rlhf.agent import EpisodeLedger, common_prompt_len
from async_rlhf.agent.turns import template_message
from async_rlhf.types import Group, Sample

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant: {% endif %}")
"""No special tokens between turns; the generation prompt ends in a space, which BPE attaches to the next word."""
STRIP_THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""The llama_bpe template, but earlier assistant turns lose their thinking (as Qwen3's does)."""


@pytest.fixture(scope="module")
def tok(llama_bpe_dir):
    from async_rlhf.tokenizer import load_tokenizer

    return load_tokenizer(llama_bpe_dir)


@pytest.fixture(scope="module")
def stops(llama_bpe_dir, tok) -> list[int]:
    from async_rlhf.tokenizer import stop_token_ids

    return stop_token_ids(llama_bpe_dir, tok)  # [<|end|>, </s>]


@pytest.fixture(scope="module")
def qwen_tok(llama_bpe_dir):
    return fresh_tokenizer(llama_bpe_dir, QWEN25_TEMPLATE, qwen_tokens=True)


def template_ids(tokenizer, messages, tools=None, gen=True) -> list[int]:
    """What re-tokenizing the whole history gives (the thing the ledger never trains on). Tool-call arguments go
    to the template as objects, as vLLM's chat rendering passes them (a JSON text would be quoted again)."""
    out = tokenizer.apply_chat_template([template_message(m) for m in messages], tools=tools, tokenize=True,
                                        add_generation_prompt=gen)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def sample(ledger, plan, ids, version=0, finish_reason="stop", versions=None):
    """The engine's answer to ``plan``: ``ids`` with made-up log-probs, recorded."""
    logprobs = [-0.1 - 0.01 * i for i in range(len(ids))]
    return ledger.record(plan, ids, logprobs, versions if versions is not None else [version] * len(ids),
                         finish_reason)


def merged_pairs(tokenizer, limit=3) -> list[list[int]]:
    """Pairs of token ids whose decoded text re-encodes to different ids (BPE merges them), from the merges."""
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    pairs = []
    for merge in merges:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        ids = tokenizer.convert_tokens_to_ids([left, right])
        if tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) != ids:
            pairs.append(ids)
        if len(pairs) == limit:
            break
    return pairs


def check_branch(b) -> None:
    assert len(b.ids) == len(b.mask) == len(b.logprobs) == len(b.versions)
    for t in b.turns:
        assert b.mask[t.start:t.end] == [1] * (t.end - t.start)
    sampled = {i for t in b.turns for i in range(t.start, t.end)}
    assert {i for i, m in enumerate(b.mask) if m} == sampled, "mask 1 exactly on sampled tokens"
    assert all(b.logprobs[i] == 0.0 for i in range(len(b.ids)) if i not in sampled)


def test_canonical_turns_equal_the_whole_template_render(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(tok, episode_id="e1", stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    previous: list[int] = []
    for n, answer in enumerate(["The answer is 42.", "The answer is 43.", "The answer is 44."]):
        plan = ledger.plan(messages)
        assert plan.prompt_ids == template_ids(tok, messages), "canonical text: the splice is the template's"
        assert plan.prompt_ids[:len(previous)] == previous, "each prompt extends the last prompt + its sample"
        out = ledger.encode(answer) + [end]
        turn = sample(ledger, plan, out)
        assert turn.message == {"role": "assistant", "content": answer}
        assert (turn.response_id, turn.finish_reason, turn.tool_parse_error) == (f"chatcmpl-e1-{n}", "stop", False)
        previous = plan.prompt_ids + out
        # the SDK's message.model_dump() comes back with its null fields
        messages = [*messages, {**turn.message, "refusal": None, "audio": None, "tool_calls": None},
                    {"role": "user", "content": f"And {42 + n}+1?"}]
    [b] = ledger.branches()
    assert b.ids == previous
    check_branch(b)
    assert ledger.counters == {"turns": 3, "tool_calls": 0, "tool_parse_errors": 0, "forks": 0, "retries": 0,
                               "token_mismatch": 0}


def test_qwen_tool_calls_splice_the_template_text_after_end_of_turn(qwen_tok) -> None:
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    newline = qwen_tok.encode("\n", add_special_tokens=False)
    ledger = EpisodeLedger(qwen_tok, episode_id="q", stop_token_ids=[im_end])
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 12+30?"}]
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12+30"}}\n</tool_call>'

    plan = ledger.plan(messages, TOOLS)
    assert plan.prompt_ids == template_ids(qwen_tok, messages, TOOLS)
    out1 = ledger.encode(call) + [im_end]
    turn = sample(ledger, plan, out1, version=3)
    assert turn.finish_reason == "tool_calls" and not turn.tool_parse_error
    assert turn.message == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_q_0", "type": "function",
         "function": {"name": "calc", "arguments": '{"expression": "12+30"}'}}]}
    messages += [turn.message, {"role": "tool", "tool_call_id": "call_q_0", "content": "42"}]

    plan2 = ledger.plan(messages, TOOLS)
    assert plan2.prompt_ids == template_ids(qwen_tok, messages, TOOLS)
    assert plan2.prompt_ids[:len(plan.prompt_ids) + len(out1)] == plan.prompt_ids + out1
    # "\n" after the sampled <|im_end|> is the template's, not the model's: the tail starts with it, mask 0
    assert plan2.prompt_ids[turn.end:turn.end + len(newline)] == newline
    out2 = ledger.encode("The answer is 42.") + [im_end]
    turn2 = sample(ledger, plan2, out2, version=4)
    assert turn2.message == {"role": "assistant", "content": "The answer is 42."}
    messages += [turn2.message, {"role": "user", "content": "Thanks."}]
    plan3 = ledger.plan(messages, TOOLS)
    assert plan3.prompt_ids == template_ids(qwen_tok, messages, TOOLS)

    [b] = ledger.branches()
    check_branch(b)
    assert b.mask[turn.end:turn.end + len(newline)] == [0] * len(newline)
    assert b.versions[turn.end] == 4, "an observation token carries the version of the turn it precedes"
    assert ledger.counters["tool_calls"] == 1 and ledger.counters["token_mismatch"] == 0


def test_adversarial_ids_are_kept_and_prompts_extend(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    pairs = merged_pairs(tok)
    assert pairs, "the tiny BPE has merges"
    rng = random.Random(0)
    ordinary = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    ledger = EpisodeLedger(tok, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    context: list[int] = []
    outputs = []
    for n in range(4):
        plan = ledger.plan(messages)
        assert plan.prompt_ids[:len(context)] == context
        out = [*pairs[n % len(pairs)], *rng.sample(ordinary, 5), *pairs[(n + 1) % len(pairs)], end]
        turn = sample(ledger, plan, out)
        outputs.append((turn, out))
        context = plan.prompt_ids + out
        messages += [turn.message, {"role": "user", "content": "Again."}]
    [b] = ledger.branches()
    for turn, out in outputs:
        assert b.ids[turn.start:turn.end] == out, "the sampled ids, byte for byte"
    check_branch(b)
    # re-tokenizing the same history gives other ids: the drift the ledger avoids
    assert template_ids(tok, messages[:-1], gen=False) != b.ids
    assert ledger.counters["token_mismatch"] == 0


def test_merge_across_the_generation_prompt_boundary(llama_bpe_dir) -> None:
    plain = fresh_tokenizer(llama_bpe_dir, PLAIN_TEMPLATE)
    eos = plain.eos_token_id
    ledger = EpisodeLedger(plain)  # stops on </s>, which is not the template's closing "\n"
    messages = [{"role": "user", "content": "What is 12+30?"}]
    plan = ledger.plan(messages)
    out = ledger.encode("The answer is 42.") + [eos]
    assert plain.encode("assistant: The", add_special_tokens=False) != \
        plain.encode("assistant: ", add_special_tokens=False) + plain.encode("The", add_special_tokens=False)
    turn = sample(ledger, plan, out)
    messages += [turn.message, {"role": "user", "content": "And 42+1?"}]
    plan2 = ledger.plan(messages)
    assert plan2.prompt_ids[:turn.end] == plan.prompt_ids + out
    nl = ledger.encode("\n")
    assert plan2.prompt_ids[turn.end:turn.end + len(nl)] == nl, "the closing text after a foreign stop token"
    assert plan2.prompt_ids != template_ids(plain, messages), "re-tokenizing would merge ' The'"
    sample(ledger, plan2, ledger.encode("43") + [eos])
    check_branch(ledger.branches()[0])


def test_a_turn_cut_by_length_gets_the_closing_text(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(tok, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    plan = ledger.plan(messages)
    out = ledger.encode("The answer")
    turn = sample(ledger, plan, out, finish_reason="length")
    assert turn.finish_reason == "length" and turn.message["content"] == "The answer"
    plan2 = ledger.plan([*messages, turn.message, {"role": "user", "content": "Go on."}])
    assert plan2.prompt_ids[turn.end] == end
    sample(ledger, plan2, [end])
    b = ledger.branches()[0]
    assert b.mask[turn.end] == 0, "<|end|> the model did not sample is template text"
    assert b.ids[:turn.end] == plan.prompt_ids + out


def test_versions_of_a_turn_spanning_a_push(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(tok, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    plan = ledger.plan(messages)
    out = ledger.encode("The answer is 42.") + [end]
    a = 3
    turn = sample(ledger, plan, out, versions=[7] * a + [8] * (len(out) - a))
    plan2 = ledger.plan([*messages, turn.message, {"role": "user", "content": "Sure?"}])
    turn2 = sample(ledger, plan2, ledger.encode("Yes.") + [end], version=9)
    [b] = ledger.branches()
    assert b.versions[turn.start:turn.end] == [7] * a + [8] * (len(out) - a)
    assert b.versions[turn2.start:turn2.end] == [9] * (turn2.end - turn2.start)
    assert b.oldest_version() == 7 and ledger.oldest_version() == 7
    assert b.versions[turn.end:turn2.start] == [9] * (turn2.start - turn.end)

    p = common_prompt_len(ledger.branches())
    assert p == len(plan.prompt_ids)
    s = b.to_sample(1.0, turn_rewards=[0.5, -0.1], prompt_len=p)
    s = Sample.from_wire(s.to_wire())  # passes the wire's checks
    assert s.completion_ids.tolist() == b.ids[p:] and s.loss_mask.tolist() == b.mask[p:]
    assert s.reward == pytest.approx(1.4) and s.token_rewards[turn.end - 1 - p] == pytest.approx(0.5)
    assert s.token_rewards[turn2.end - 1 - p] == pytest.approx(0.9)
    group = Group("g", np.asarray(b.ids[:p], np.int32), [s])
    assert group.min_version == 7, "staleness from the oldest sampled version"


def test_rewritten_history_forks(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(tok, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    for answer in ["The answer is 41.", "The answer is 42."]:
        plan = ledger.plan(messages)
        turn = sample(ledger, plan, ledger.encode(answer) + [end], version=1)
        messages += [turn.message, {"role": "user", "content": "Sure?"}]
    old = ledger.branches()[0]
    old_ids, old_mask = list(old.ids), list(old.mask)

    edited = [messages[0], {"role": "assistant", "content": "The answer is 42."}, *messages[2:]]
    plan = ledger.plan(edited)
    assert plan.fork and plan.branch is None and plan.parent == 0 and "shares 1 of its 4" in plan.fork_reason
    assert plan.prompt_ids == template_ids(tok, edited), "the new branch starts from the whole history, rendered"
    turn = sample(ledger, plan, ledger.encode("Yes.") + [end], version=2)
    b0, b1 = ledger.branches()
    assert b1.parent == 0 and (b0.ids, b0.mask) == (old_ids, old_mask), "the old branch is kept as it was"
    assert b1.mask == [0] * turn.start + [1] * (turn.end - turn.start), "no trained span re-rendered into it"
    assert ledger.counters["forks"] == 1

    # the new branch is extended as usual; a summarised history (turns dropped) forks again
    edited += [turn.message, {"role": "user", "content": "Thanks."}]
    plan = ledger.plan(edited)
    assert plan.branch == 1 and not plan.fork
    sample(ledger, plan, ledger.encode("Bye.") + [end], version=2)
    summary = [messages[0], {"role": "user", "content": "(You said 42.) Sure?"}]
    plan = ledger.plan(summary)
    assert plan.fork and plan.parent in (0, 1)
    sample(ledger, plan, [end], version=3)
    assert ledger.counters["forks"] == 2 and len(ledger.branches()) == 3
    # a conversation sharing no message (a sub-agent's) is a root branch: no fork
    plan = ledger.plan([{"role": "user", "content": "What is 1+1?"}])
    assert not plan.fork and plan.parent is None
    # an agent that goes back to the first history extends that branch, exactly
    plan = ledger.plan(messages)
    assert plan.branch == 0 and not plan.fork and plan.prompt_ids[:len(old_ids)] == old_ids
    for b in ledger.branches():
        check_branch(b)
    assert ledger.counters["token_mismatch"] == 0


def test_changed_tools_fork(qwen_tok) -> None:
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    ledger = EpisodeLedger(qwen_tok, stop_token_ids=[im_end])
    messages = [{"role": "user", "content": "What is 12+30?"}]
    turn = sample(ledger, ledger.plan(messages, TOOLS), ledger.encode("42") + [im_end])
    messages += [turn.message, {"role": "user", "content": "Sure?"}]
    assert ledger.plan(messages, TOOLS).branch == 0
    plan = ledger.plan(messages, None)
    assert plan.fork and "tools differ" in plan.fork_reason


def test_a_template_that_strips_thinking_forks(llama_bpe_dir, stops) -> None:
    strip = fresh_tokenizer(llama_bpe_dir, STRIP_THINKING_TEMPLATE)
    end = strip.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(strip, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    turn = sample(ledger, ledger.plan(messages), ledger.encode("The answer is 42.") + [end])
    messages += [turn.message, {"role": "user", "content": "Sure?"}]
    plan = ledger.plan(messages)
    assert plan.branch == 0, "no thinking: the template is append-only here"
    turn = sample(ledger, plan, ledger.encode("<think>12+30=42</think>Yes.") + [end])
    messages += [turn.message, {"role": "user", "content": "Thanks."}]
    plan = ledger.plan(messages)
    assert plan.fork and plan.parent == 0 and "append-only" in plan.fork_reason
    assert plan.prompt_ids == template_ids(strip, messages)
    sample(ledger, plan, [end])
    assert ledger.counters["forks"] == 1


def test_malformed_tool_calls_come_back_as_content(qwen_tok) -> None:
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    ledger = EpisodeLedger(qwen_tok, stop_token_ids=[im_end])
    messages = [{"role": "user", "content": "What is 12+30?"}]
    for n, bad in enumerate(['<tool_call>\n{"name": "calc", "arguments": {12+30}}\n</tool_call>',
                             '<tool_call>\n{"name": "calc"}\n</tool_call>',
                             '<tool_call>\n{"name": "calc", "arguments": "12+30"}\n</tool_call>',
                             'I will call it. <tool_call>\n{"name": "calc", "argu']):
        plan = ledger.plan(messages, TOOLS)
        turn = sample(ledger, plan, ledger.encode(bad) + ([im_end] if n < 3 else []),
                      finish_reason="stop" if n < 3 else "length")
        assert turn.tool_parse_error and turn.message == {"role": "assistant", "content": bad}
        assert turn.finish_reason == ("stop" if n < 3 else "length")
        messages += [turn.message, {"role": "user", "content": "Use the tool properly."}]
    assert ledger.counters["tool_parse_errors"] == 4 and ledger.counters["tool_calls"] == 0
    assert ledger.counters["forks"] == 0, "the agent sends the content back: the branch goes on"
    # content before a good call is kept; two calls get two ledger ids
    two = ('Adding. <tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "calc", "arguments": {"expression": "3+4"}}\n</tool_call>')
    turn = sample(ledger, ledger.plan(messages, TOOLS), ledger.encode(two) + [im_end])
    assert turn.message["content"] == "Adding. " and not turn.tool_parse_error
    assert [c["id"] for c in turn.message["tool_calls"]] == ["call_0_0", "call_0_1"]
    assert [json.loads(c["function"]["arguments"]) for c in turn.message["tool_calls"]] == [
        {"expression": "1+2"}, {"expression": "3+4"}]


def test_a_retry_with_the_same_key_records_one_turn(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(tok, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    plan = ledger.plan(messages, key="k1")
    turn = sample(ledger, plan, ledger.encode("42") + [end])
    retry = ledger.plan(messages, key="k1")
    assert retry.replay == turn and retry.prompt_ids == []
    assert sample(ledger, retry, []) == turn
    # a retry that raced the original: both sampled, one recorded
    messages += [turn.message, {"role": "user", "content": "Sure?"}]
    first, second = ledger.plan(messages, key="k2"), ledger.plan(messages, key="k2")
    t1 = sample(ledger, first, ledger.encode("Yes.") + [end])
    assert sample(ledger, second, ledger.encode("No.") + [end]) == t1
    assert ledger.recorded("k2") == t1 and ledger.turn(t1.response_id) == t1
    assert ledger.counters["turns"] == 2 and ledger.counters["retries"] == 2
    assert len(ledger.branches()) == 1 and len(ledger.branches()[0].turns) == 2
    # a plan never recorded (the engine failed) leaves no trace
    ledger.plan([*messages, t1.message, {"role": "user", "content": "Ok."}], key="k3")
    assert ledger.recorded("k3") is None and ledger.counters["turns"] == 2


def test_two_calls_in_flight_on_one_history_make_a_sibling(tok, stops) -> None:
    end = tok.convert_tokens_to_ids("<|end|>")
    ledger = EpisodeLedger(tok, stop_token_ids=stops)
    messages = [{"role": "user", "content": "What is 12+30?"}]
    turn = sample(ledger, ledger.plan(messages), ledger.encode("42") + [end])
    messages += [turn.message, {"role": "user", "content": "Sure?"}]
    p1, p2 = ledger.plan(messages), ledger.plan(messages)
    assert p1.prompt_ids == p2.prompt_ids and p1.branch == p2.branch == 0
    t1 = sample(ledger, p1, ledger.encode("Yes.") + [end])
    out2 = ledger.encode("No.") + [end]
    t2 = sample(ledger, p2, out2)
    b0, b1 = ledger.branches()
    assert (t1.branch, t2.branch) == (0, 1) and b1.parent == 0
    assert b1.ids == p2.prompt_ids + out2, "the sibling holds the exact ids its call was given"
    assert b1.mask == [0] * len(p2.prompt_ids) + [1] * len(out2)
    assert ledger.counters["forks"] == 1 and ledger.counters["token_mismatch"] == 0
    assert common_prompt_len([b0, b1]) == turn.start, "their first sampled token bounds the shared prompt"
