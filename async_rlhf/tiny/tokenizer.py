"""Character-level tokenizer of the tiny policy, saved so that ``AutoTokenizer`` (and vLLM) load it unchanged.

One token per character, spaces included: a ``WordLevel`` model behind a pre-tokenizer that isolates every
character. The vocabulary is stored in GPT-2 byte-level form (a space is the vocab entry ``"Ġ"``; every
other character of the alphabet is printable ASCII and maps to itself), with a ``ByteLevel`` step after the
split and a ``ByteLevel`` decoder. Why: with ``model_type: qwen2`` in config.json, transformers 5.x's
``AutoTokenizer`` ignores ``tokenizer_class`` in tokenizer_config.json (qwen2 is on its list of models whose
hub tokenizer class is "known incorrect") and builds ``Qwen2Tokenizer`` (byte-level BPE) from our vocab. A
plain ``" "`` entry would then be unreachable and every space silently dropped; in byte-level form Qwen2's
pipeline gives exactly the same ids and text, so transformers, vLLM and :func:`load_tokenizer` all agree.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)
"""Ids 0, 1, 2 in this order."""
CHARACTERS: str = "0123456789+-*=?<> ,.:" + "abcdefghijklmnopqrstuvwxyz"
"""Ids 3.. in this order; ``<unk>`` comes last so that a stray character never silently becomes padding."""
MODEL_MAX_LENGTH = 64
_BYTE_LEVEL_SPACE = "Ġ"


def _vocab_piece(char: str) -> str:
    """The byte-level form of one alphabet character (only the space differs)."""
    return _BYTE_LEVEL_SPACE if char == " " else char


def build_vocab() -> dict[str, int]:
    """Token -> id: the special tokens, every character (byte-level form), then ``<unk>``."""
    vocab: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *(_vocab_piece(c) for c in CHARACTERS), UNK):
        vocab[token] = len(vocab)
    return vocab


def _wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=MODEL_MAX_LENGTH,
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh character-level tokenizer; encoding adds no bos/eos (prompts are plain text)."""
    core = Tokenizer(models.WordLevel(vocab=build_vocab(), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # "." in the Rust regex: any one character but newline.
            pre_tokenizers.Split(pattern=Regex("."), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # Concatenates pieces with no separator and maps "Ġ" back to " ": "12 + 3" round-trips exactly.
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([PAD, BOS, EOS, UNK])
    return _wrap(core)


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Save tokenizer.json + tokenizer_config.json (left padding, no space clean-up, class pinned)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    # Honoured for model types transformers does not override; qwen2 is overridden (see module docstring).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["clean_up_tokenization_spaces"] = False
    cfg["padding_side"] = "left"
    cfg["model_max_length"] = MODEL_MAX_LENGTH
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerFast:
    """Load a tiny-model directory's tokenizer straight from tokenizer.json, whatever config.json says."""
    core = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return _wrap(core)
