"""The tiny tool policy: the tiny character tokenizer plus a calculator tool-call format and a chat template.

What it adds to the tiny policy (``async_rlhf.tiny.tokenizer``, ``async_rlhf.tiny.model``), for the tool-use task
of the agent runs (``agent.task=calculator``, issue 45):

    tokens     <tool_call>  </tool_call>  <tool_response>  </tool_response>    (ids 51..54, added tokens)
    template   user        its content, raw                 12+34=
               assistant   content, each call, eos          <tool_call>12+34</tool_call></s>   or   046</s>
               tool        the result between markers       <tool_response>46</tool_response>
               system      nothing; ``tools`` nothing (the character vocabulary cannot spell a JSON schema)
    a whole tool episode:  12+34=<tool_call>12+34</tool_call></s><tool_response>46</tool_response>046</s>

Arguments are rendered from the object (as vLLM and the agent ledger give them to a template; a JSON text is
written as it is). The template is append-only (a history renders as a prefix of the history + any tail) and adds
no generation prompt, so the agent ledger splices only what is new and a one-message episode renders the task's
own prompt.
A call's arguments are the JSON object ``{"expression": "12+34"}``; the model writes only the expression (a JSON
call would not fit the 64-token window): ``async_rlhf.agent.tiny_tool_parser`` reads it with vLLM's tool-parser
API. The markers are added tokens that are not "special": a decode that skips special tokens keeps them, so the
generator's held-out completions still show a call.

The held-out figure of the task plays the protocol greedily (:func:`play_greedy`): generate; a turn that calls
the calculator gets its result appended and generates again; the final answer is scored by the addition rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from async_rlhf.env.calculator import (  # the format's text and the tool itself live with the task
    CALL_END,
    CALL_START,
    MAX_TOOL_ROUNDS,
    RESPONSE_END,
    RESPONSE_START,
    calculate,
    called_expression,
    response_text,
)

TOOL_TOKENS = (CALL_START, CALL_END, RESPONSE_START, RESPONSE_END)
TOOL_MAX_NEW_TOKENS = 10
"""The longest turn of the task: a call ``<tool_call>12+34</tool_call></s>`` is 8 tokens with 2-digit operands
(generator.max_new_tokens of the task's command; the default 6 cuts every call)."""
CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}{{ m['content'] or '' }}"
    "{%- for tc in m.get('tool_calls') or [] %}{%- set args = tc['function']['arguments'] %}" + CALL_START
    + "{%- if args is mapping %}{{ args['expression'] }}{%- else %}{{ args }}{%- endif %}" + CALL_END
    + "{%- endfor %}{{ eos_token }}"
    "{%- elif m['role'] == 'tool' %}" + RESPONSE_START + "{{ m['content'] }}" + RESPONSE_END
    + "{%- endif %}"
    "{%- endfor %}"
)


def build_tool_tokenizer() -> Any:
    """The tiny character tokenizer with the four tool markers (one id each) and the chat template."""
    from tokenizers import AddedToken

    from async_rlhf.tiny.tokenizer import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tool_model(out_dir: Path, seed: int = 0) -> Path:
    """The tiny Qwen2 over the tool tokenizer, randomly initialised, saved with its tokenizer (and template)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from async_rlhf.tiny.model import tiny_config
    from async_rlhf.tiny.tokenizer import save_tokenizer

    tok = build_tool_tokenizer()
    cfg = tiny_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id, max_new_tokens=TOOL_MAX_NEW_TOKENS)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    save_tokenizer(tok, out_dir)
    return out_dir


def play_greedy(model: Any, tok: Any, problems: Sequence[Any], max_new_tokens: int = TOOL_MAX_NEW_TOKENS,
                temperature: float = 0.0, batch_size: int = 256, seed: int = 0) -> dict[str, float]:
    """The tool protocol played on ``problems`` (``Problem``: prompt, answer): each turn generated (greedy at
    temperature 0); a turn that calls the calculator gets the result as a tool message and generates again (at
    most MAX_TOOL_ROUNDS calls); the last turn's answer scored by the addition rule. ``accuracy`` and
    ``tool_share`` (share of episodes that called the tool)."""
    import torch

    from async_rlhf.env.arithmetic import score_completion
    from async_rlhf.tiny.sft import generate_batch

    if not problems:
        return {"accuracy": 0.0, "tool_share": 0.0}
    eos = tok.eos_token_id
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    correct = called = 0.0
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(problems), batch_size):
            chunk = list(problems[start:start + batch_size])
            contexts = [tok.encode(p.prompt, add_special_tokens=False) for p in chunk]
            final: list[str] = [""] * len(chunk)
            used = [False] * len(chunk)
            live = list(range(len(chunk)))
            for rnd in range(MAX_TOOL_ROUNDS + 1):
                if not live:
                    break
                outs = generate_batch(model, [contexts[i] for i in live], max_new_tokens, tok.pad_token_id, eos,
                                      temperature=temperature, generator=gen)
                still = []
                for i, out in zip(live, outs, strict=True):
                    text = tok.decode(out[:-1] if out and out[-1] == eos else out, skip_special_tokens=False)
                    expression = called_expression(text)
                    room = len(contexts[i]) + len(out) + 12 <= tok.model_max_length
                    if expression is None or rnd == MAX_TOOL_ROUNDS or not room or not out or out[-1] != eos:
                        final[i] = "" if expression is not None else text
                        continue
                    used[i] = True
                    contexts[i] = contexts[i] + list(out) + tok.encode(response_text(calculate(expression)),
                                                                       add_special_tokens=False)
                    still.append(i)
                live = still
            correct += sum(score_completion(p, t) for p, t in zip(chunk, final, strict=True))
            called += sum(used)
    finally:
        model.train(was_training)
    return {"accuracy": correct / len(problems), "tool_share": called / len(problems)}
