"""The tiny policy: tokenizer round-trips, model loading, the addition task, greedy decoding, SFT cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from async_rlhf.config import TaskConfig
from async_rlhf.env.arithmetic import AdditionTask, Problem
from async_rlhf.tiny.cache import cached_policy, policy_dir
from async_rlhf.tiny.model import build_tiny_model, tiny_config
from async_rlhf.tiny.sft import generate_batch, greedy_accuracy, prepare_tiny_policy, read_tiny_info
from async_rlhf.tiny.tokenizer import CHARACTERS, build_tokenizer, load_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def built_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_unit") / "model", seed=0)


# --- tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_ids_of_special_tokens_and_characters() -> None:
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok.encode(CHARACTERS, add_special_tokens=False)
    assert ids == list(range(3, 3 + len(CHARACTERS)))
    assert len(tok) == 3 + len(CHARACTERS) + 1  # <unk> last


@pytest.mark.parametrize("loader", ["auto", "load_tokenizer"])
def test_tokenizer_round_trip_from_disk(built_dir: Path, loader: str) -> None:
    from transformers import AutoTokenizer

    ref = build_tokenizer()
    tok = AutoTokenizer.from_pretrained(str(built_dir)) if loader == "auto" else load_tokenizer(built_dir)
    texts = ["12 + 3", CHARACTERS, "  a  b ", "07+45=52", "what is 3 * 4? 12.", ""]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert len(ids) == len(text)  # one token per character, spaces included
        assert tok.decode(ids) == text
        assert tok.decode(ids, clean_up_tokenization_spaces=False) == text
    ids = tok.encode("46", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == "46"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.padding_side == "left"


def test_tokenizer_config_pins_class(built_dir: Path) -> None:
    cfg = json.loads((built_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["clean_up_tokenization_spaces"] is False


# --- model ----------------------------------------------------------------------------------------


def test_model_loads_with_tied_embeddings(built_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(built_dir))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n = sum(p.numel() for p in model.parameters())
    assert 300_000 <= n <= 600_000
    tok = load_tokenizer(built_dir)
    assert model.config.vocab_size == len(tok)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (0, 1, 2)
    assert (built_dir / "generation_config.json").exists()


def test_build_is_deterministic(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = load_file(str(build_tiny_model(tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(build_tiny_model(tmp_path / "b", seed=3) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- task -----------------------------------------------------------------------------------------


def test_heldout_never_in_train_stream() -> None:
    task = AdditionTask(digits=2, heldout_size=200, seed=0)
    held = {(p.a, p.b) for p in task.heldout()}
    assert len(held) == 200
    stream = task.train_problems(seed=0)
    seen = [next(stream) for _ in range(5000)]
    assert not held & {(p.a, p.b) for p in seen}
    assert all(not task.is_heldout(p) for p in seen)


def test_task_is_deterministic() -> None:
    a, b = AdditionTask(seed=0), AdditionTask(seed=0)
    assert a.heldout() == b.heldout()
    assert AdditionTask(seed=1).heldout() != a.heldout()
    s1, s2 = a.train_problems(seed=5), b.train_problems(seed=5)
    assert [next(s1) for _ in range(50)] == [next(s2) for _ in range(50)]
    s3 = a.train_problems(seed=6)
    assert [next(s3) for _ in range(50)] != [next(a.train_problems(seed=5)) for _ in range(50)]


def test_problem_format_and_length_budget() -> None:
    for digits in (1, 2, 3):
        task = AdditionTask(digits=digits, heldout_size=20)
        tok = build_tokenizer()
        for p in task.heldout():
            assert int(p.answer) == p.a + p.b and len(p.answer) == digits + 1
            assert task.completion_target(p) == p.answer
            n_prompt = len(tok.encode(p.prompt, add_special_tokens=False))
            assert n_prompt + 6 <= 64
            assert len(p.answer) + 1 <= 6  # answer + eos fits the demo's 6-token budget
    assert AdditionTask(digits=2).make(7, 45) == Problem(7, 45, "07+45=", "052")
    assert AdditionTask(digits=2).make(99, 99).answer == "198"


def test_reward() -> None:
    task = AdditionTask(digits=2)
    p = task.make(7, 45)
    for good in ("052", "052</s>", " 052", "052</s><pad><pad>", "052+1", "052 is it"):
        assert task.reward(p, good) == 1.0, good
    for bad in ("053", "0520", "52", "0052", "05", "", "</s>", "abc", "05 2", "-052", "fifty-two"):
        assert task.reward(p, bad) == 0.0, bad


def test_carry_free_answer() -> None:
    task = AdditionTask(digits=2)
    assert task.carry_free_answer(task.make(12, 34)) == "046" and not task.has_carry(task.make(12, 34))
    assert task.carry_free_answer(task.make(7, 45)) == "042" and task.has_carry(task.make(7, 45))
    assert task.carry_free_answer(task.make(99, 99)) == "088"
    assert task.carry_free_answer(task.make(50, 50)) == "000"
    no_carry = sum(not task.has_carry(task.make(a, b)) for a in range(100) for b in range(100))
    assert no_carry == 55 * 55  # units and tens digit pairs that sum below 10
    assert AdditionTask(digits=3).carry_free_answer(AdditionTask(digits=3).make(999, 1)) == "0990"


def test_heldout_size_is_checked() -> None:
    with pytest.raises(ValueError):
        AdditionTask(digits=1, heldout_size=80)


# --- greedy decoding ------------------------------------------------------------------------------


class _Oracle(torch.nn.Module):
    """Emits the correct answer then eos, reading only the unmasked tokens (a forced-correct policy)."""

    def __init__(self, tok, wrong: bool = False) -> None:
        super().__init__()
        self.tok, self.wrong = tok, wrong
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        vocab = len(self.tok)
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], vocab)
        for i, row in enumerate(input_ids):
            real = row[attention_mask[i].bool()] if attention_mask is not None else row
            text = self.tok.decode(real.tolist())
            prompt, _, done = text.partition("=")
            sa, sb = prompt.split("+")
            target = f"{int(sa) + int(sb) + (1 if self.wrong else 0):0{len(sa) + 1}d}"
            nxt = target[len(done)] if len(done) < len(target) else None
            tid = self.tok.eos_token_id if nxt is None else self.tok.convert_tokens_to_ids(nxt)
            logits[i, -1, tid] = 10.0
        return SimpleNamespace(logits=logits)


def test_greedy_accuracy_of_forced_policies() -> None:
    tok = build_tokenizer()
    # Mixed prompt lengths, so left padding happens inside every batch.
    problems = [p for d in (1, 2, 3) for p in AdditionTask(digits=d, heldout_size=20).heldout()]
    problems += [AdditionTask(digits=3).make(999, 1), Problem(5, 7, "5+7=", "12")]
    problems += [Problem(0, 0, "0+0=", "00")]
    assert greedy_accuracy(_Oracle(tok), tok, problems, batch_size=16) == 1.0
    assert greedy_accuracy(_Oracle(tok, wrong=True), tok, problems, batch_size=16) == 0.0


def _peaked_model(seed: int = 0):
    """A random tiny Qwen2 with large weights, so argmax ties (and thus flaky comparisons) are unlikely."""
    from transformers import Qwen2ForCausalLM

    tok = build_tokenizer()
    cfg = tiny_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    cfg.initializer_range = 0.3
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval(), tok


@torch.no_grad()
def _greedy_unpadded(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(max_new):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
        ids.append(nxt)
    return out


def test_batched_left_padded_decode_matches_unpadded() -> None:
    model, tok = _peaked_model()
    texts = ["1+2=", "12+34=", "123+456=", "7+89=", "0+0=", "99+1=", " a b c ="]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    batched = generate_batch(model, prompts, 6, tok.pad_token_id, tok.eos_token_id)
    for p, got in zip(prompts, batched):
        assert got == _greedy_unpadded(model, p, 6, tok.eos_token_id)


# --- SFT cache ------------------------------------------------------------------------------------


def test_prepare_tiny_policy_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    cfg = TaskConfig(digits=2, heldout_size=50, sft_steps=3)
    path = prepare_tiny_policy(tmp_path, cfg, seed=0)
    assert path.parent == tmp_path and path.name.startswith("tiny-")
    info = read_tiny_info(path)
    assert info["settings"]["sft_steps"] == 3 and 0.0 <= info["heldout_greedy_accuracy"] <= 1.0
    AutoModelForCausalLM.from_pretrained(str(path))
    assert load_tokenizer(path).decode(load_tokenizer(path).encode("1 + 2")) == "1 + 2"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    import async_rlhf.tiny.sft as sft

    real_build = sft.build_tiny_model
    builds: list[Path] = []
    monkeypatch.setattr(sft, "build_tiny_model", lambda d, **kw: builds.append(d) or real_build(d, **kw))
    assert prepare_tiny_policy(tmp_path, cfg, seed=0) == path
    assert builds == [], "a cached policy was built again"
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert cached_policy(tmp_path, cfg, seed=0) == path == policy_dir(tmp_path, cfg, seed=0)
    assert cached_policy(tmp_path, TaskConfig(digits=2, heldout_size=50, sft_steps=4), seed=0) is None
    other = prepare_tiny_policy(tmp_path, TaskConfig(digits=2, heldout_size=50, sft_steps=4), seed=0)
    assert len(builds) == 1, "other settings must build their own policy"
    assert other != path
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted(
        [path.name, other.name]
    )


def test_cli_build_and_sft(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from async_rlhf.tiny.__main__ import main

    assert main(["build", "--out", str(tmp_path / "base"), "--seed", "1"]) == 0
    base, sft = str(tmp_path / "base"), str(tmp_path / "sft")
    assert main(["sft", "--base", base, "--out", sft, "--steps", "2"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "base"), str(tmp_path / "sft")]
    stats = json.loads((tmp_path / "sft" / "sft_stats.json").read_text())
    assert 0.0 <= stats["heldout_greedy_accuracy"] <= 1.0


def test_a_cached_policy_is_found_without_importing_torch_or_transformers(tmp_path: Path) -> None:
    """The launcher resolves the demo's policy before it starts Ray: a cache hit must not pay the builder's
    imports (8 CPU-s on 2 cores)."""
    cfg = TaskConfig(digits=2, heldout_size=50, sft_steps=3)
    built = policy_dir(tmp_path, cfg, seed=0)
    built.mkdir()
    (built / "tiny_info.json").write_text("{}")
    code = ("import sys; from pathlib import Path; from async_rlhf.config import load_config; "
            "from async_rlhf.policy_source import resolve_model; "
            "cfg = load_config(None, ['task.digits=2', 'task.heldout_size=50', 'task.sft_steps=3']); "
            f"print(resolve_model(cfg, Path({str(tmp_path)!r}))); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(built), "[]"], out.stdout
