"""Offline data: file reading and checks, encoding, padding and packing, the task's data builder, CLI errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from async_rlhf.env.arithmetic import AdditionTask
from async_rlhf.offline import dpo, infer, kto, reward_model, sft
from async_rlhf.offline.batching import pack_batch, pack_rows, pad_batch
from async_rlhf.offline.common import check_model_dir, load_tokenizer, run_main
from async_rlhf.offline.data import DataError, Encoded, encode, encode_sft, load_rows
from async_rlhf.offline.make_data import make_data, plausible_wrong
from async_rlhf.offline.scoring import completion_logps, mismatched


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_rows_reads_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+2=", "chosen": "03", "rejected": "04"}, {"prompt": "5+5=", "chosen": "10", "rejected": "00"}]
    assert load_rows(_jsonl(tmp_path / "p.jsonl", rows), "pairs") == rows
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert load_rows(tmp_path / "p.parquet", "pairs") == rows


def test_load_rows_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl", "sft")
    (tmp_path / "rows.csv").write_text("prompt,completion\n")
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        load_rows(tmp_path / "rows.csv", "sft")
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(DataError, match=r"columns \['answer', 'question'\]; the sft format needs "
                                        r"\{\"prompt\", \"completion\"\} or \{\"messages\"\}"):
        load_rows(wrong, "sft")
    bad_label = _jsonl(tmp_path / "kto.jsonl", [{"prompt": "a", "completion": "b", "label": "yes"}])
    with pytest.raises(DataError, match="row 0: column 'label' must be true or false"):
        load_rows(bad_label, "kto")
    (tmp_path / "garbage.jsonl").write_text('{"prompt": "1+1=", "completion"\n')
    with pytest.raises(DataError, match="cannot be read as JSON"):
        load_rows(tmp_path / "garbage.jsonl", "sft")


def test_encode_appends_eos_and_cuts_to_max_length(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    enc = encode(tok, "12+34=", "046", max_length=64)
    assert enc is not None and enc.n_prompt == 6
    assert tok.decode(enc.ids[:6]) == "12+34=" and tok.decode(enc.ids[6:9]) == "046"
    assert enc.ids[-1] == tok.eos_token_id and len(enc.ids) == 10
    assert encode(tok, "12+34=", "046", max_length=8).ids == enc.ids[:8]
    assert encode(tok, "12+34=", "046", max_length=6) is None  # the prompt alone fills it
    assert encode(tok, "12+34=", "046", 64, eos=False).ids == enc.ids[:-1]
    rows = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "02"}]}]
    (msg,) = encode_sft(tok, rows, 64)  # no chat template: the messages are concatenated
    assert tok.decode(msg.ids[:msg.n_prompt]) == "1+1=" and tok.decode(msg.ids[msg.n_prompt:-1]) == "02"


def test_pad_batch_loss_mask_marks_completion_targets() -> None:
    batch = pad_batch([Encoded([5, 6, 7, 8], 2), Encoded([9, 10, 11], 1)], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    # targets are ids[:, 1:]: row 0 targets [6, 7, 8], completion = ids 7, 8; row 1 targets [10, 11, pad]
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]


def test_pack_rows_first_fit_decreasing() -> None:
    examples = [Encoded([1] * n, 1) for n in (5, 3, 4, 2)]
    # decreasing: 5 -> row 0 (room 3); 4 -> row 1 (room 4); 3 -> row 0 (room 0); 2 -> row 1 (room 2)
    assert pack_rows(examples, 8) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="exceeds the packing length"):
        pack_rows(examples, 4)


def test_packed_forward_equals_separate_forwards(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    a, b = Encoded([5, 6, 7, 8], 2), Encoded([9, 10, 11], 1)
    batch = pack_batch([a, b], max_length=8, pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # target of position 3 (token 8 -> 9) crosses into example b: never trained
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]]
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[0]
        alone_a = model(input_ids=torch.tensor([a.ids])).logits[0]
        alone_b = model(input_ids=torch.tensor([b.ids])).logits[0]
    assert torch.allclose(packed[:4], alone_a, atol=1e-5)
    assert torch.allclose(packed[4:], alone_b, atol=1e-5)


def test_completion_logps_sums_completion_tokens(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    ex = [Encoded([5, 6, 7, 8], 2), Encoded([9, 10, 11], 1)]
    with torch.no_grad():
        got = completion_logps(model, ex, pad_id=0)
        logp = torch.log_softmax(model(input_ids=torch.tensor([ex[0].ids])).logits[0], -1)
    # example 0: log p(7 | 5 6) + log p(8 | 5 6 7)
    assert got[0].item() == pytest.approx((logp[1, 7] + logp[2, 8]).item(), abs=1e-5)
    assert mismatched(ex) == [Encoded([5, 6, 10, 11], 2), Encoded([9, 7, 8], 1)]


def test_plausible_wrong_answers_are_wrong_and_same_width() -> None:
    task = AdditionTask(digits=2, heldout_size=0)
    rng = random.Random(0)
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            p = task.make(a, b)
            wrong = plausible_wrong(task, p, rng)
            assert wrong != p.answer and len(wrong) == 3 and wrong.isdigit()
    p = task.make(58, 67)  # 125; forgotten carries give 015 (both), 115 (units), 025 (tens)
    assert {plausible_wrong(task, p, rng) for _ in range(200)} >= {"015", "115", "025"}


def test_make_data_writes_every_file_and_keeps_heldout_apart(tmp_path: Path) -> None:
    paths = make_data(tmp_path, train=300, heldout=20)
    rows = {name: load_rows(path, fmt) for name, path, fmt in [
        ("sft", paths["sft"], "sft"), ("pairs", paths["pairs"], "pairs"), ("kto", paths["kto"], "kto"),
        ("held", paths["pairs_heldout"], "pairs"), ("prompts", paths["prompts"], "prompts")]}
    assert len(rows["sft"]) == len(rows["pairs"]) == len(rows["kto"]) == 300 and len(rows["held"]) == 20
    task = AdditionTask()
    for r in rows["pairs"]:
        a, b = r["prompt"][:-1].split("+")
        assert r["chosen"] == f"{int(a) + int(b):03d}" and r["rejected"] != r["chosen"]
    assert sum(r["label"] for r in rows["kto"]) == 150
    held = {r["prompt"] for r in rows["prompts"]}
    assert held == {p.prompt for p in task.heldout()[:20]}
    assert not held & {r["prompt"] for r in rows["sft"]}


@pytest.mark.parametrize("module", [sft, reward_model, dpo, kto])
def test_cli_errors_are_one_line_exit_2(module, tmp_path: Path, tiny_model_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    assert run_main(module.main, ["--data", str(tmp_path / "none.jsonl"), "--model", str(tiny_model_dir),
                                  "--out", out]) == 2
    assert capsys.readouterr().err.strip() == f"error: --data {tmp_path / 'none.jsonl'}: no such file"
    assert run_main(module.main, ["--data", str(tmp_path / "none.jsonl"), "--model", str(tmp_path),
                                  "--out", out]) == 2
    assert "has no config.json: it is not a Hugging Face model directory" in capsys.readouterr().err
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"text": "hello"}])
    assert run_main(module.main, ["--data", str(wrong), "--model", str(tiny_model_dir), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has columns ['text']; the " in err and '"prompt"' in err
    assert not Path(out).exists()


def test_reward_model_accepts_pairs_alias_and_infer_checks_arguments(
        tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main(reward_model.main, ["--pairs", str(tmp_path / "p.jsonl"), "--model", str(tiny_model_dir),
                                        "--out", str(tmp_path / "rm")]) == 2
    assert "--data" in capsys.readouterr().err  # the alias reaches the same check
    assert run_main(infer.main, ["--model", str(tiny_model_dir), "--prompts", str(tmp_path / "p.jsonl"),
                                 "--out", str(tmp_path / "o.txt")]) == 2
    assert "name it *.jsonl" in capsys.readouterr().err
    with pytest.raises(DataError, match="not of the form 'aa\\+bb='"):
        infer.addition_rewards([{"prompt": "hello"}], [["1"]])
    assert infer.addition_rewards([{"prompt": "07+45="}], [["052", "52", " 052</s>"]]) == [[1.0, 0.0, 1.0]]
    check_model_dir(str(tiny_model_dir))
