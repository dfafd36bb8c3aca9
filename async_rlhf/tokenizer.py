"""A model directory's own tokenizer and stop tokens: the one place every role loads them from.

    load_tokenizer(dir)    its special tokens, max length, padding side and chat template, as saved
    stop_token_ids(dir)    generation_config.json's eos_token_id (an id or a list) + the tokenizer's eos
    copy_tokenizer_files   what an exported model directory must carry to load the same way (tokenizer
                           files, chat template, generation config)

Loading: a directory whose tokenizer_config.json names ``PreTrainedTokenizerFast`` (or transformers 5's
``TokenizersBackend``) next to a tokenizer.json is loaded as exactly that. ``AutoTokenizer`` would build the
class that config.json's model type maps to instead (for qwen2, a byte-level BPE ``Qwen2Tokenizer``, whatever
tokenizer_class says), which garbles a character or word-level tokenizer saved with such a model. Anything
else goes through ``AutoTokenizer``. Nothing is forced: the tiny model's settings (``<unk>``, a max length of
64) come from its own saved files, not from this loader.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""tokenizer_class values of a tokenizer that is exactly its tokenizer.json."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")
"""Files an exported directory copies verbatim (transformers 5 saves the chat template in its own file)."""
GENERATION_CONFIG = "generation_config.json"


def load_tokenizer(model_dir: str | Path) -> Any:
    """The directory's own tokenizer (see the module docstring); a missing pad token becomes the eos token
    (padding is masked everywhere here, so which id pads does not matter)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(model_dir)
    cfg_file = path / "tokenizer_config.json"
    meta = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if (path / "tokenizer.json").is_file() and meta.get("tokenizer_class") in FAST_CLASSES:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """``eos_token_id`` of generation_config.json (one id or a list; absent: [])."""
    file = Path(model_dir) / GENERATION_CONFIG
    if not file.is_file():
        return []
    value = json.loads(file.read_text()).get("eos_token_id")
    if value is None:
        return []
    ids = [value] if isinstance(value, int) else list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
    return ids


def stop_token_ids(model_dir: str | Path, tokenizer: Any) -> list[int]:
    """Tokens that end a completion: the generation config's eos ids, then the tokenizer's eos (in that order,
    no repeats). vLLM samples with them (``stop_token_ids``) and the transformers evaluation stops on them."""
    out: list[int] = []
    for i in [*generation_eos_ids(model_dir), tokenizer.eos_token_id]:
        if i is not None and int(i) not in out:
            out.append(int(i))
    if not out:
        raise ValueError(f"{model_dir}: neither generation_config.json nor the tokenizer names an eos token; "
                         "set eos_token_id in generation_config.json")
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path, generation_config: bool = True) -> list[str]:
    """Copy the tokenizer files, the chat template and (``generation_config``) generation_config.json from
    ``src`` to ``dst`` verbatim, so ``dst`` loads and generates exactly as ``src`` did; returns the names copied.
    A generation_config.json ``save_pretrained`` wrote in ``dst`` is replaced by the original."""
    src, dst = Path(src), Path(dst)
    names = [*TOKENIZER_FILES, *((GENERATION_CONFIG,) if generation_config else ())]
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
