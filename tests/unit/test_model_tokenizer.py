"""The model's own tokenizer and stop tokens (async_rlhf/tokenizer.py), chat prompts (prompts/chat.py) and the
Llama/BPE test model (tiny/llama_bpe.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from async_rlhf.config import ConfigError, load_config
from async_rlhf.env.base import Prompt
from async_rlhf.prompts.base import to_prompt
from async_rlhf.prompts.chat import ChatPromptError, ChatRenderer, check_chat_setup
from async_rlhf.tokenizer import copy_tokenizer_files, generation_eos_ids, load_tokenizer, stop_token_ids

MESSAGES = [{"role": "user", "content": "What is 12+30?"}]


@pytest.fixture(scope="module")
def llama_dir(llama_bpe_dir: Path) -> Path:
    return llama_bpe_dir


def _user_char_model(root: Path) -> Path:
    """A user's Qwen2 directory with its own 16-token character tokenizer (no <unk>, max length 128)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", *"0123456789", "+", "=", "Ġ", "?"])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("."), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<pad>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", model_max_length=128)
    root.mkdir(parents=True)
    tok.save_pretrained(str(root))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    return root


def test_a_users_tokenizer_keeps_its_own_special_tokens_and_max_length(tmp_path: Path) -> None:
    from async_rlhf.tiny.tokenizer import load_tokenizer as tiny_loader

    d = _user_char_model(tmp_path / "user")
    tok = load_tokenizer(d)
    assert len(tok) == 16 and tok.unk_token != "<unk>" and tok.model_max_length == 128
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    ids = tok("12 + 3=", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12 + 3=" and len(ids) == 7
    old = tiny_loader(d)  # the path every model took before: the tiny special tokens and max length forced
    assert len(old) > 16 and old.unk_token == "<unk>" and old.model_max_length == 64


def test_the_tiny_model_loads_as_before(tiny_model_dir: Path) -> None:
    from async_rlhf.tiny.tokenizer import load_tokenizer as tiny_loader

    own, tiny = load_tokenizer(tiny_model_dir), tiny_loader(tiny_model_dir)
    text = "07+45=052 ab"
    assert own(text)["input_ids"] == tiny(text)["input_ids"]
    assert (len(own), own.pad_token_id, own.eos_token_id, own.model_max_length) == (
        len(tiny), tiny.pad_token_id, tiny.eos_token_id, 64)


def test_stop_tokens_come_from_the_generation_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    assert stop_token_ids(tiny_model_dir, tok) == [tok.eos_token_id]  # an int in generation_config.json
    d = tmp_path / "m"
    d.mkdir()
    assert generation_eos_ids(d) == []
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert stop_token_ids(d, tok) == [7, 2], "a list, the tokenizer's eos (2) not repeated"
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        generation_eos_ids(d)


def test_copy_keeps_the_chat_template_and_the_generation_config(tmp_path: Path, llama_dir: Path) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))  # what save_pretrained wrote
    copied = copy_tokenizer_files(llama_dir, out)
    assert {"chat_template.jinja", "tokenizer.json", "generation_config.json"} <= set(copied)
    assert (out / "generation_config.json").read_text() == (llama_dir / "generation_config.json").read_text()
    assert load_tokenizer(out).chat_template == load_tokenizer(llama_dir).chat_template


def test_llama_bpe_is_small_sub_word_chat_ready_and_deterministic(tmp_path: Path, llama_dir: Path) -> None:
    from transformers import AutoConfig

    from async_rlhf.tiny.llama_bpe import END, build_llama_bpe

    info = json.loads((llama_dir / "llama_bpe_info.json").read_text())
    assert 1_000_000 <= info["parameters"] <= 3_000_000 and 300 <= info["vocab_size"] <= 1000
    assert AutoConfig.from_pretrained(llama_dir).model_type == "llama"
    tok = load_tokenizer(llama_dir)
    ids = tok("What is 12+30?", add_special_tokens=False)["input_ids"]
    assert len(ids) < len("What is 12+30?"), "sub-word: fewer tokens than characters"
    assert tok.decode(ids) == "What is 12+30?"
    assert stop_token_ids(llama_dir, tok) == [tok.convert_tokens_to_ids(END), tok.eos_token_id]
    again = build_llama_bpe(tmp_path / "again")

    def digest(d: Path, name: str) -> str:
        return hashlib.sha256((d / name).read_bytes()).hexdigest()

    for name in ("tokenizer.json", "model.safetensors", "chat_template.jinja", "generation_config.json"):
        assert digest(again, name) == digest(llama_dir, name), f"{name} differs between two builds"


def test_chat_prompts_render_through_the_template(llama_dir: Path) -> None:
    tok = load_tokenizer(llama_dir)
    prompt = to_prompt({"prompt": MESSAGES, "answer": "42"})
    assert prompt.text == "" and prompt.messages == MESSAGES and prompt.data == {"answer": "42"}
    rendered, ids = ChatRenderer(tok, "auto").prepare(prompt)
    assert rendered.text == "<s><|user|>What is 12+30?<|end|><|assistant|>"
    assert rendered.data == {"answer": "42", "messages": MESSAGES}
    assert tok.convert_ids_to_tokens(ids[:2] + ids[-2:]) == ["<s>", "<|user|>", "<|end|>", "<|assistant|>"]
    assert ChatRenderer(tok, "auto").render(rendered) == rendered, "rendering twice changes nothing"
    text = Prompt("12+30=", {"answer": "42"})
    assert ChatRenderer(tok, "auto").render(text) == text, "auto leaves text prompts alone"
    on = ChatRenderer(tok, "on").render(text)
    assert on.text == "<s><|user|>12+30=<|end|><|assistant|>" and on.data["messages"][0]["content"] == "12+30="
    with pytest.raises(ChatPromptError, match="prompts.chat_template=false: set prompts.chat_template=auto"):
        ChatRenderer(tok, "false").render(prompt)


def test_messages_without_a_template_are_refused_naming_the_fix(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    with pytest.raises(ChatPromptError, match="has no chat template: add one"):
        ChatRenderer(tok, "auto", "tiny").render(to_prompt(MESSAGES))
    with pytest.raises(ChatPromptError, match="prompts.chat_template=true but the tokenizer of tiny has no chat"):
        ChatRenderer(tok, "true", "tiny")
    for bad in ([{"role": "user"}], [{"role": "user", "content": 3}]):
        with pytest.raises(ChatPromptError, match="string 'role' and a string 'content'"):
            to_prompt({"prompt": bad})
    with pytest.raises(ChatPromptError, match="must be a non-empty list"):
        to_prompt({"prompt": []})
    with pytest.raises(ValueError, match="a string or a list of chat messages"):
        to_prompt({"prompt": 3})


def test_the_launcher_check_refuses_messages_the_model_cannot_render(tmp_path: Path, llama_dir: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"prompt": MESSAGES}) + "\n")
    cfg = load_config(None, [f"prompts.eval_path={eval_file}"])
    with pytest.raises(ChatPromptError, match=r"eval.jsonl record 0: .*the tiny model has no chat template"):
        check_chat_setup(cfg, None)
    check_chat_setup(cfg, str(llama_dir))  # its template renders them
    with pytest.raises(ChatPromptError, match="record 0: a prompt is a list of chat messages but prompts.chat"):
        check_chat_setup(load_config(None, [f"prompts.eval_path={eval_file}", "prompts.chat_template=false"]),
                         str(llama_dir))
    with pytest.raises(ChatPromptError, match="chat_template=true but the tokenizer of the tiny model"):
        check_chat_setup(load_config(None, ["prompts.chat_template=true"]), None)


def test_chat_template_config_key() -> None:
    assert load_config(None, []).prompts.chat_template == "auto"
    assert load_config(None, ["prompts.chat_template=true"]).prompts.chat_template == "on"
    assert load_config(None, ["prompts.chat_template=false"]).prompts.chat_template == "off"
    assert load_config(None, ["prompts.chat_template='True'"]).prompts.chat_template == "on"
    with pytest.raises(ConfigError, match="prompts.chat_template must be one of auto, on, off; got 'always'"):
        load_config(None, ["prompts.chat_template=always"])


def test_generation_stops_on_any_stop_token() -> None:
    from async_rlhf.tiny.sft import generate_batch

    class Counter(torch.nn.Module):
        """Greedy next token = last token + 1."""

        def forward(self, input_ids, attention_mask=None, position_ids=None):
            logits = torch.nn.functional.one_hot((input_ids + 1) % 20, 20).float()
            return type("Out", (), {"logits": logits})()

    assert generate_batch(Counter(), [[3], [10]], 6, 0, [6, 12]) == [[4, 5, 6], [11, 12]]
    assert generate_batch(Counter(), [[3]], 6, 0, 99) == [[4, 5, 6, 7, 8, 9]]


def test_files_and_python_sources_give_chat_prompts(tmp_path: Path) -> None:
    import pandas as pd

    from async_rlhf.prompts.base import IterablePrompts
    from async_rlhf.prompts.files import file_prompts

    rows = [{"prompt": MESSAGES, "answer": "42"}, {"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "p.parquet")
    for name in ("p.jsonl", "p.parquet"):
        src = file_prompts(str(tmp_path / name), seed=0)
        got = sorted((next(src) for _ in range(2)), key=lambda p: p.data["answer"])
        assert [p.messages for p in got] == [rows[1]["prompt"], MESSAGES], name
        assert all(p.text == "" and set(p.data) == {"answer"} for p in got)
    py = IterablePrompts([MESSAGES, "12+30=", {"prompt": MESSAGES, "x": 1}])
    assert [p.messages for p in py] == [MESSAGES, None, MESSAGES]


SEEN = []


def record_reward(prompt, completion, data, *, prompt_ids, completion_ids, finish_reason):
    SEEN.append({"prompt": prompt, "prompt_ids": prompt_ids, "ids": completion_ids, "reason": finish_reason,
                 "messages": data["messages"]})
    return 1.0


def test_the_launchers_held_out_evaluation_renders_chats_and_stops_on_the_generation_config(
        tmp_path: Path, llama_dir: Path) -> None:
    from async_rlhf.evaluation import eval_figures
    from async_rlhf.tiny.llama_bpe import END

    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}]}) + "\n"
                                 for i in range(6)))
    cfg = load_config(None, ["task.name=custom", "prompts.source=file", f"prompts.path={eval_file}",
                             f"prompts.eval_path={eval_file}", "rewards.sources=function",
                             f"rewards.function={__name__}:record_reward", "generator.max_new_tokens=12"])
    SEEN.clear()
    assert eval_figures(str(llama_dir), cfg) == {"reward_mean": 1.0, "accuracy": 1.0}
    tok = load_tokenizer(llama_dir)
    stops = [tok.convert_tokens_to_ids(END), tok.eos_token_id]
    assert len(SEEN) == 6
    for s in SEEN:
        assert s["prompt"] == tok.apply_chat_template(s["messages"], tokenize=False, add_generation_prompt=True)
        assert s["prompt_ids"] == tok(s["prompt"], add_special_tokens=False)["input_ids"]
        ended = bool(s["ids"]) and s["ids"][-1] in stops
        assert s["reason"] == ("stop" if ended else "length") and (ended or len(s["ids"]) == 12)
