"""Chat prompts: a prompt given as messages goes through the tokenizer's chat template.

    prompt (file record, Python item, eval record)
      "12+30="                          -> text prompt
      [{"role": "user", "content": ..}] -> chat prompt (Prompt.messages)
    ChatRenderer(tokenizer, prompts.chat_template).render(prompt)
      auto   messages -> apply_chat_template(messages, add_generation_prompt=True); text stays text
      on     every prompt through the template (a text prompt as one user message); no template: refused
      off    text as is; messages refused
    -> Prompt(text = the rendered string, data = {...record fields, "messages": [...]}) -> token ids

What a reward source sees for a chat prompt: ``prompt`` is the rendered text (exactly what the model was
given, template tokens included), ``data["messages"]`` the messages; a reward function may also ask for
``prompt_ids`` (the token ids the model was given).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from async_rlhf.env.base import Prompt

MODES = ("auto", "on", "off")
"""prompts.chat_template; true/false (YAML booleans) are read as on/off."""


CHECKED_RECORDS = 1000
"""Records of each prompt file rendered before the run starts (the rest are checked as they are drawn)."""


class ChatPromptError(ValueError):
    """A prompt the chat-template setting cannot take; the message names the fix."""


def is_messages(value: Any) -> bool:
    """Whether ``value`` looks like chat messages (a list of mappings) rather than text."""
    return isinstance(value, (list, tuple)) and all(isinstance(m, Mapping) for m in value)


def to_messages(value: Any, where: str = "prompt") -> list[dict[str, str]]:
    """``value`` as a checked list of ``{"role", "content"}`` messages (string fields), else ChatPromptError."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ChatPromptError(f"{where}: chat messages must be a non-empty list of "
                              '{"role": ..., "content": ...} objects')
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatPromptError(f"{where}: message {i} is {m!r:.80}; every message needs a string 'role' and a "
                                  "string 'content'")
        out.append({str(k): v for k, v in m.items() if v is not None})  # (a Parquet struct fills absent keys)
    return out


def chat_mode(value: str) -> str:
    """prompts.chat_template normalised to auto | on | off (true/false/yes/no accepted)."""
    v = str(value).strip().lower()
    v = {"true": "on", "yes": "on", "1": "on", "false": "off", "no": "off", "0": "off"}.get(v, v)
    if v not in MODES:
        raise ChatPromptError(f"prompts.chat_template must be auto, true or false; got {value!r}")
    return v


class ChatRenderer:
    """Renders prompts for one tokenizer under one ``prompts.chat_template`` setting, and encodes them."""

    def __init__(self, tokenizer: Any, mode: str = "auto", model: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.mode = chat_mode(mode)
        self.model = model
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        if self.mode == "on" and not self.has_template:
            raise ChatPromptError(f"prompts.chat_template=true but the tokenizer of {model} has no chat template: "
                                  "add one (chat_template.jinja or tokenizer_config.json's chat_template) or set "
                                  "prompts.chat_template=auto")

    def render(self, prompt: Prompt) -> Prompt:
        """The prompt as the model is given it (text prompts unchanged unless the mode is on)."""
        messages = prompt.messages
        if messages is None:
            if self.mode != "on":
                return prompt
            messages = [{"role": "user", "content": prompt.text}]
        elif self.mode == "off":
            raise ChatPromptError("a prompt is a list of chat messages but prompts.chat_template=false: set "
                                  "prompts.chat_template=auto to render it with the tokenizer's chat template, or "
                                  "give text prompts")
        elif not self.has_template:
            raise ChatPromptError(f"a prompt is a list of chat messages but the tokenizer of {self.model} has no "
                                  "chat template: add one to the model directory (chat_template.jinja) or give "
                                  "text prompts")
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return Prompt(str(text), {**prompt.data, "messages": list(messages)}, list(messages))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of an already rendered prompt (the template put in any special tokens it wants)."""
        return list(self.tokenizer(prompt.text, add_special_tokens=False)["input_ids"])

    def prepare(self, prompt: Prompt) -> tuple[Prompt, list[int]]:
        """``render`` then ``encode``."""
        rendered = self.render(prompt)
        return rendered, self.encode(rendered)


def check_chat_setup(cfg: Any, model_path: str | None) -> None:
    """Before anything starts: refuse (ChatPromptError) a chat-template setting the model's tokenizer cannot
    serve, and a held-out or prompt file whose messages it cannot render (the first CHECKED_RECORDS of each).
    ``model_path`` None: the tiny model (a character tokenizer without a chat template). Loads the tokenizer
    only when a prompt is messages or the setting is true."""
    from async_rlhf.prompts.base import to_prompt

    files = [f for f in [cfg.prompts.eval_path] + ([cfg.prompts.path] if cfg.prompts.source == "file" else []) if f]
    prompts: list[tuple[str, int, Prompt]] = []
    if files:
        import datasets

        from async_rlhf.prompts.files import load_records

        datasets.disable_progress_bars()  # a refusal is one line on stderr
        try:
            for path in files:
                try:
                    records = load_records(path)[:CHECKED_RECORDS]
                    prompts += [(path, i, to_prompt(r, cfg.prompts.text_field)) for i, r in enumerate(records)]
                except Exception as exc:  # noqa: BLE001 - a bad file: one line naming it
                    raise ChatPromptError(f"{path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                                          ) from None
        finally:
            datasets.enable_progress_bars()
    if chat_mode(cfg.prompts.chat_template) != "on" and all(p.messages is None for _, _, p in prompts):
        return
    if model_path:
        from async_rlhf.tokenizer import load_tokenizer

        tok, name = load_tokenizer(model_path), model_path
    else:
        from async_rlhf.tiny.tokenizer import build_tokenizer

        tok, name = build_tokenizer(), "the tiny model"
    renderer = ChatRenderer(tok, cfg.prompts.chat_template, name)
    for path, i, prompt in prompts:
        try:
            renderer.render(prompt)
        except ChatPromptError as exc:
            raise ChatPromptError(f"{path} record {i}: {exc}") from None
