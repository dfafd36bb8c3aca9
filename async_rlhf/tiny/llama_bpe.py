"""A second small policy for the tests: a ~1 M-parameter Llama with a byte-level BPE tokenizer, a chat
template and a generation config, built locally (no hub) and deterministically.

What it differs in from the tiny Qwen2 (``async_rlhf.tiny.model``), on purpose:

    architecture   Llama (untied lm_head, 4 layers)     Qwen2 (tied, 2 layers)
    tokenizer      byte-level BPE trained by tokenizers  one token per character
                   on the addition task's text (~400)    (51)
    chat template  <s><|user|>...<|end|><|assistant|>    none
    stop tokens    generation_config.json eos_token_id   the tokenizer's eos
                   = [<|end|>, </s>] (a list)

so a run on it goes through ``--model DIR`` the way a user's own model does: its own tokenizer class, its
special tokens, its chat template (``prompts.chat_template``), stop tokens from its generation config.

    python -m async_rlhf.tiny llama-bpe --cache runs/cache     # prints the directory
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

VERSION = 1
"""Bump when the recipe changes: it names the cache directory."""
BOS, EOS, PAD, END = "<s>", "</s>", "<pad>", "<|end|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (PAD, BOS, EOS, END, *(f"<|{r}|>" for r in ROLES))
"""Ids 0.. in this order (added before the BPE vocabulary)."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""``<s><|user|>What is 12+30?<|end|><|assistant|>``; a turn ends with ``<|end|>`` (a stop token)."""
SETTINGS = {"version": VERSION, "vocab_size": 400, "hidden_size": 128, "intermediate_size": 512, "layers": 4,
            "heads": 4, "kv_heads": 2, "max_positions": 256, "seed": 0}

logger = logging.getLogger(__name__)


def corpus() -> list[str]:
    """The text the BPE is trained on: the addition task's problems and answers, as prompts and in words."""
    lines = []
    for a in range(100):
        for b in range(100):
            lines += [f"{a:02d}+{b:02d}=", f"{a + b:03d}", f"What is {a}+{b}? The answer is {a + b}."]
    return lines


def build_tokenizer(vocab_size: int) -> object:
    """Byte-level BPE trained on :func:`corpus` (deterministic), wrapped with its special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[END, *(f"<|{r}|>" for r in ROLES)],
                                   clean_up_tokenization_spaces=False, padding_side="left",
                                   model_max_length=SETTINGS["max_positions"], chat_template=CHAT_TEMPLATE)


def build_llama_bpe(out_dir: Path, settings: dict[str, int] | None = None) -> Path:
    """Build the model into ``out_dir`` (random init from ``settings["seed"]``): weights, config.json,
    tokenizer files, chat_template.jinja, generation_config.json."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    s = {**SETTINGS, **(settings or {})}
    tok = build_tokenizer(s["vocab_size"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in (PAD, BOS, EOS, END)}
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], max_position_embeddings=s["max_positions"],
                      tie_word_embeddings=False, initializer_range=0.02, rms_norm_eps=1e-5,
                      bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s["seed"])
        model = LlamaForCausalLM(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS], eos_token_id=[ids[END], ids[EOS]],
                                               pad_token_id=ids[PAD])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    n_params = sum(p.numel() for p in model.parameters())
    (out_dir / "llama_bpe_info.json").write_text(json.dumps({"settings": s, "parameters": n_params,
                                                             "vocab_size": len(tok)}, indent=2) + "\n")
    logger.info("built a Llama (%d parameters) with a byte-level BPE (vocab %d) in %s", n_params, len(tok), out_dir)
    return out_dir


def prepare_llama_bpe(cache_root: Path) -> Path:
    """The model of :data:`SETTINGS` under ``cache_root/llama-bpe-<hash>/`` (the tiny model's cache root), built
    once: in a temporary directory renamed into place, under a file lock (concurrent callers build once)."""
    from async_rlhf.tiny.cache import file_lock

    digest = hashlib.sha256(json.dumps(SETTINGS, sort_keys=True).encode()).hexdigest()[:12]
    cache_root = Path(cache_root)
    final = cache_root / f"llama-bpe-{digest}"
    if (final / "llama_bpe_info.json").is_file():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_root / f".llama-bpe-{digest}.lock"):
        if (final / "llama_bpe_info.json").is_file():
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".llama-bpe-{digest}-", dir=cache_root))
        try:
            build_llama_bpe(staging / "model")
            if final.exists():  # an incomplete directory of an older crash
                shutil.rmtree(final)
            os.rename(staging / "model", final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final
