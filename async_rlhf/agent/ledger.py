"""The token ledger of one agent episode: the ids the learner trains on are the ids the engine sampled, exactly.

An agent (the user's OpenAI-SDK code) sends the whole chat history on every call. Re-rendering that history
through the chat template and re-tokenizing it gives ids that differ from what was sampled (a BPE merge across
two sampled tokens, a template that reformats a tool call, drops a separator or strips thinking). The ledger
never does that: it keeps each branch of the episode as the engine's own ids and renders only what is new.

    agent (OpenAI SDK)            EpisodeLedger                                         engine
    ──────────────────            ─────────────                                         ──────
    messages, tools, key ──> plan(messages, tools, key)
                               key already recorded ──────> Plan.replay: answer it, sample nothing
                               messages extend branch b?  (each earlier message equal to the one recorded;
                                                            assistant turns: content + tool calls the ledger
                                                            returned)
                                 yes: text = rest of the closing text after b's last sampled token
                                             + render(history + tail, gen) - render(history)    (checked prefix)
                                      prompt_ids = b.ids + encode(text)                         (text: mask 0)
                                 no:  fork: prompt_ids = encode(render(messages, gen)) in a new branch (all mask 0)
                               Plan.prompt_ids ─────────────────────────────────────────> generate(prompt_ids)
                                                                                            │ ids, logprobs,
    response <── RecordedTurn <── record(plan, ids, logprobs, versions, finish_reason) <───┘ versions
    (assistant message,             appends the plan's new ids (mask 0) + the sampled ids (mask 1) to the branch,
     tool calls with the            parses tool calls (vLLM's parser), issues the response and tool-call ids
     ledger's ids)

Guarantees (tests/unit/test_agent_ledger.py):
  - every sampled id is in its branch as the engine returned it, with its behaviour log-prob and the policy
    version that sampled it (a turn that spans a weight push is ``[v]*a + [v+1]*b``); loss mask 1 exactly there;
  - the prompt of each call of a branch extends the branch (its earlier prompt + what was sampled), so the
    prefix cache holds it and the trained sequence is the context the model actually saw;
  - where the sampled text is canonical (it re-encodes to the same ids) and the template is append-only, the
    branch equals ``apply_chat_template`` of the whole history.

Decisions:
  - **Not-sampled tokens** (the first prompt, rendered tails, forked history) have loss mask 0, log-prob 0.0 (the
    project's convention for observations, ``env.base.Trajectory``; the learner computes some terms over all columns
    before masking, e.g. the proximal log-probs, where a NaN would spread: NaN * 0 is NaN) and the version of the
    turn they precede (the first sampled token of the next record), so a branch's minimum version over all tokens is
    its oldest sampled version (``Group.min_version`` reads all).
  - **Template text after an end-of-turn token.** The chat template closes an assistant turn with a fixed text
    (``<|im_end|>\\n`` for Qwen, ``<|end|>`` for the tiny llama_bpe), found once per tool set by rendering a
    probe turn. When the last sampled token is a stop token whose text begins that closing text, the rest
    (``\\n``) is template text: it opens the next tail, mask 0. A turn cut by length (no stop token sampled) or
    ended by another stop token gets the whole closing text spliced after it, mask 0, so the next context is well
    formed. A rendered history whose last assistant turn does not end with the closing text (a template that
    closes tool-call turns otherwise) cannot be spliced: it forks.
  - **Forks.** Messages that do not extend a branch (the agent edited, summarised, reordered or dropped turns,
    changed its tools; or the template is not append-only: the rendered history is not a prefix of the rendered
    history + tail, e.g. thinking stripped from earlier turns) start a new branch from the whole history
    rendered and tokenized, all mask 0: no trained span is re-rendered into it. The branch it diverged from (its
    ``parent``: the one sharing the longest message prefix) is left as it is, its own trainable sequence. It is
    not closed: a call whose history extends it later (the agent went back, or interleaves two conversations
    that share a system prompt) extends it exactly; an extension goes to the branch with the longest matching
    history. A record whose branch grew since its plan (two calls in flight on one history) starts a sibling
    branch from the exact ids that call was given, mask 0 on the shared part. ``forks`` counts both: every new
    branch that shares a first message with an earlier one (so also a second conversation with the same system
    prompt). A call sharing no message with any branch starts a root branch: no fork.
  - **Matching assistant turns.** An assistant message the agent sends back matches the recorded turn at its
    position when its content and tool calls (name, arguments as JSON) are equal; tool-call ids are not
    compared (frameworks that re-key calls still match), and a message that changed is an edit: fork.
  - **Idempotency.** ``plan(.., key=k)`` of a key already recorded returns ``Plan.replay`` (the recorded turn);
    ``record`` of a plan whose key got recorded meanwhile (a retry raced the original) returns the first turn
    and drops its own output. Either way one turn; each replay counts in ``retries``. (The endpoint may rather
    hold a retry whose key is still in flight until the original is recorded: the ledger does not track plans.)
  - **Content** is the decoded completion without its trailing stop token, special tokens kept (a tool-call
    marker may be a special token).
  - **Tool calls** are parsed by vLLM's parser (``tool_calls.ToolCallParser``); a malformed call comes back as
    plain content with ``tool_parse_error=True`` and is counted, never raised.

For the endpoint: one ``EpisodeLedger`` per episode (URL path ``/s/<episode id>/v1``), on the
generator that serves the episode. ``plan`` and ``record`` are synchronous and never await: call them from the
serving event loop (not thread-safe). ``plan`` raises ValueError for messages the template cannot render (a 400).
The endpoint sends ``Plan.prompt_ids`` to the engine with its usual sampling params (stop ids: those given here),
records the output, and answers with ``RecordedTurn.message`` / ``response_id`` / ``finish_reason`` / usage
(``prompt_tokens``, ``completion_tokens``); ``turn(response_id)`` and ``recorded(key)`` look turns up. Record
each plan once. At the episode's end ``branches()`` become samples (``Branch.to_sample``, prompt split at
``common_prompt_len`` of the group's branches); ``counters`` hold the figures summary.json reports (``turns``,
``tool_calls``, ``tool_parse_errors``, ``forks``, ``retries``, ``token_mismatch``: by construction 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from async_rlhf.agent.tool_calls import ToolCallParser
from async_rlhf.agent.turns import (
    Branch,
    Plan,
    RecordedTurn,
    normal_message,
    template_message,
    tools_key,
)

PROBE = "ledgerprobe7q"
"""The assistant content of the probe turn that finds the template's closing text (one word, no spaces)."""
COUNTERS = ("turns", "tool_calls", "tool_parse_errors", "forks", "retries", "token_mismatch")


class EpisodeLedger:
    """The branches of one episode's token ids (see the module docstring)."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None,
                 episode_id: str = "0", stop_token_ids: Sequence[int] | None = None,
                 tool_parser: str | ToolCallParser = "hermes") -> None:
        """``stop_token_ids``: the ids the engine stops on (``async_rlhf.tokenizer.stop_token_ids``; default the
        tokenizer's eos); a trailing one is not part of the content. ``tool_parser``: a vLLM tool-call parser
        name or a parser."""
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.episode_id = str(episode_id)
        ids = list(stop_token_ids) if stop_token_ids is not None else [tokenizer.eos_token_id]
        self.stop_token_ids = {int(i) for i in ids if i is not None}
        self.parser = tool_parser if isinstance(tool_parser, ToolCallParser) else ToolCallParser(tokenizer,
                                                                                                 tool_parser)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._branches: list[Branch] = []
        self._by_key: dict[str, RecordedTurn] = {}
        self._by_response: dict[str, RecordedTurn] = {}
        self._closing: dict[str, str | None] = {}
        self._n_responses = 0
        self._n_calls = 0

    # ---- rendering -------------------------------------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> str:
        """The chat template's text of ``messages`` (template form); ValueError when the template cannot."""
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                                      add_generation_prompt=gen, **self.chat_template_kwargs)
        except Exception as exc:  # jinja's TemplateError ("roles must alternate"), missing keys
            raise ValueError(f"the chat template cannot render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        """Template text to ids: no special tokens added (the template writes its own)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def closing_text(self, tools: list[dict[str, Any]] | None) -> str | None:
        """What the template writes after an assistant turn's content (``<|im_end|>\\n``), from a probe turn;
        None when the probe's content is not found in its rendering."""
        key = tools_key(tools)
        if key not in self._closing:
            probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": PROBE}]
            try:
                text = self.render(probe, tools, gen=False)
            except ValueError:
                text = ""
            at = text.rfind(PROBE)
            self._closing[key] = text[at + len(PROBE):] if at >= 0 else None
        return self._closing[key]

    # ---- plan ------------------------------------------------------------------------------------------------

    def plan(self, messages: Sequence[Any], tools: Sequence[Any] | None = None, key: str | None = None) -> Plan:
        """The prompt ids for the agent's next call with ``messages`` (its whole history). Changes nothing but
        ``counters["retries"]``: a plan that is never recorded (the engine failed, the client went away) leaves no
        trace."""
        if key is not None and key in self._by_key:
            self.counters["retries"] += 1
            return Plan(prompt_ids=[], key=key, replay=self._by_key[key])
        tools_list = [dict(t) for t in tools] if tools else None
        msgs = [template_message(m) for m in messages]
        if not msgs:
            raise ValueError("a call needs at least one message")
        norm = tuple(normal_message(m) for m in msgs)
        tkey = tools_key(tools_list)
        common = dict(key=key, messages=norm, tools=tools_list, tools_key=tkey)

        best = None
        for b in self._branches:
            h = len(b.messages)
            if (b.tools_key == tkey and h <= len(norm) and tuple(b.messages) == norm[:h]
                    and (best is None or h > len(best.messages))):
                best = b
        if best is not None:
            tail_or_reason = self._tail(best, msgs, tools_list)
            if isinstance(tail_or_reason, list):
                return Plan(prompt_ids=best.ids + tail_or_reason, new_tokens=len(tail_or_reason), branch=best.index,
                            base_len=len(best.ids), **common)
            reason, parent = tail_or_reason, best  # the template is not append-only here: fork
        else:
            parent, shared = None, 0
            for b in self._branches:
                n = 0
                while n < min(len(b.messages), len(norm)) and b.messages[n] == norm[n]:
                    n += 1
                if n > shared:
                    parent, shared = b, n
            reason = "" if parent is None else (
                f"the history does not extend branch {parent.index}: it shares {shared} of its "
                f"{len(parent.messages)} messages" + ("" if parent.tools_key == tkey else ", and the tools differ"))
        ids = self.encode(self.render(msgs, tools_list, gen=True))
        return Plan(prompt_ids=ids, new_tokens=len(ids), fork=parent is not None, fork_reason=reason,
                    parent=None if parent is None else parent.index, **common)

    def _tail(self, b: Branch, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int] | str:
        """The ids that extend branch ``b`` to ``msgs`` (its history + a tail), or why they cannot."""
        h = len(b.messages)
        old = self.render(msgs[:h], tools, gen=False)
        new = self.render(msgs, tools, gen=True)
        if not new.startswith(old):
            return (f"the chat template is not append-only here: the rendered history of branch {b.index} is not a "
                    "prefix of the rendered history + new messages")
        close = self.closing_text(tools)
        if close is None or not old.endswith(close):
            return f"the rendered last assistant turn of branch {b.index} does not end with the template's closing text"
        rest = close[len(b.covered):] if b.covered and close.startswith(b.covered) else close
        return self.encode(rest + new[len(old):])

    # ---- record ----------------------------------------------------------------------------------------------

    def record(self, plan: Plan, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
               finish_reason: str = "stop") -> RecordedTurn:
        """Record what the engine sampled for ``plan``: the plan's new ids (mask 0) and the sampled ones (mask 1,
        with their log-probs and versions) join the branch; returns the assistant turn to answer with."""
        if plan.replay is not None:
            return plan.replay
        if plan.key is not None and plan.key in self._by_key:
            self.counters["retries"] += 1
            return self._by_key[plan.key]
        token_ids = [int(i) for i in token_ids]
        if not (len(token_ids) == len(logprobs) == len(versions)):
            raise ValueError(f"token_ids ({len(token_ids)}), logprobs ({len(logprobs)}) and versions "
                             f"({len(versions)}) must have one length")
        fill = int(versions[0]) if len(versions) else None

        b = self._branches[plan.branch] if plan.branch is not None else None
        if b is not None and len(b.ids) == plan.base_len:
            new_ids = plan.prompt_ids[plan.base_len:]
        else:  # a new branch: planned as one, or its branch moved on since the plan (a sibling)
            sibling = plan.branch is not None
            b = Branch(index=len(self._branches), parent=plan.branch if sibling else plan.parent,
                       tools_key=plan.tools_key)
            self._branches.append(b)
            if plan.fork or sibling:
                self.counters["forks"] += 1
            new_ids = list(plan.prompt_ids)
        if fill is None:
            fill = b.versions[-1] if b.versions else 0
        b.ids += new_ids
        b.mask += [0] * len(new_ids)
        b.logprobs += [0.0] * len(new_ids)
        b.versions += [fill] * len(new_ids)
        start = len(b.ids)
        b.ids += token_ids
        b.mask += [1] * len(token_ids)
        b.logprobs += [float(x) for x in logprobs]
        b.versions += [int(v) for v in versions]
        # by construction 0: the branch is exactly the context the engine was given + what it sampled
        self.counters["token_mismatch"] += sum(x != y for x, y in zip(b.ids[:start], plan.prompt_ids, strict=False))
        self.counters["token_mismatch"] += abs(start - len(plan.prompt_ids))
        self.counters["token_mismatch"] += sum(x != y for x, y in zip(b.ids[start:], token_ids, strict=True))

        turn = self._turn(plan, b, start, token_ids, finish_reason)
        b.turns.append(turn)
        b.messages = [*plan.messages, normal_message(template_message(turn.message))]
        stopped = bool(token_ids) and token_ids[-1] in self.stop_token_ids
        b.covered = self.tokenizer.decode([token_ids[-1]], skip_special_tokens=False) if stopped else ""
        self._by_response[turn.response_id] = turn
        if plan.key is not None:
            self._by_key[plan.key] = turn
        self.counters["turns"] += 1
        return turn

    def _turn(self, plan: Plan, b: Branch, start: int, token_ids: list[int], finish_reason: str) -> RecordedTurn:
        content_ids = token_ids[:-1] if token_ids and token_ids[-1] in self.stop_token_ids else token_ids
        text = self.tokenizer.decode(content_ids, skip_special_tokens=False) if content_ids else ""
        parsed = self.parser.parse(text, plan.tools)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = []
            for name, arguments in parsed.tool_calls:
                message["tool_calls"].append({"id": f"call_{self.episode_id}_{self._n_calls}", "type": "function",
                                              "function": {"name": name, "arguments": arguments}})
                self._n_calls += 1
            self.counters["tool_calls"] += len(parsed.tool_calls)
        elif message["content"] is None:
            message["content"] = ""
        self.counters["tool_parse_errors"] += int(parsed.error)
        response_id = f"chatcmpl-{self.episode_id}-{self._n_responses}"
        self._n_responses += 1
        return RecordedTurn(response_id=response_id, message=message,
                            finish_reason="tool_calls" if parsed.tool_calls else finish_reason,
                            tool_parse_error=parsed.error, text=text, branch=b.index, start=start,
                            end=start + len(token_ids), prompt_tokens=start, engine_finish_reason=finish_reason)

    # ---- reading ---------------------------------------------------------------------------------------------

    def branches(self) -> list[Branch]:
        """Every branch, in creation order: each is its own trainable sequence."""
        return list(self._branches)

    def turns_in_order(self) -> list[RecordedTurn]:
        """Every recorded turn, in the order it was sampled (one per engine call; replays add none)."""
        return list(self._by_response.values())

    def turn(self, response_id: str) -> RecordedTurn | None:
        return self._by_response.get(response_id)

    def recorded(self, key: str) -> RecordedTurn | None:
        """The turn recorded under an idempotency key, if any."""
        return self._by_key.get(key)

    def oldest_version(self) -> int | None:
        """The oldest policy version of any sampled token of the episode (None before the first)."""
        versions = [v for v in (b.oldest_version() for b in self._branches) if v is not None]
        return min(versions) if versions else None
