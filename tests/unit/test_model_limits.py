"""A ``--model`` of the user's own takes its window and completion length from its own config, at config time
(async_rlhf/config/model_limits.py; issue 44, "Defaults that fit the model"): ``model.max_model_len=64`` and
``generator.max_new_tokens=6`` are the tiny model's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from async_rlhf.config import ConfigError, load_config, model_limits_line

ROOT = Path(__file__).resolve().parents[2]


def model_dir(root: Path, config: dict | None = None, generation: dict | None = None, name: str = "model") -> Path:
    """A model directory as far as the configuration reads it: config.json (and generation_config.json)."""
    d = root / name
    d.mkdir()
    meta = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 300,
            "max_position_embeddings": 2048}
    (d / "config.json").write_text(json.dumps({**meta, **(config or {})}))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def test_a_users_model_left_at_the_defaults_takes_its_own_window_and_completion_length(tmp_path: Path) -> None:
    d = model_dir(tmp_path, generation={"eos_token_id": 2, "max_new_tokens": 512})
    cfg = load_config(None, [f"model.path={d}"])
    assert (cfg.model.max_model_len, cfg.generator.max_new_tokens) == (2048, 512)


def test_values_the_user_set_are_kept_even_where_they_equal_the_defaults(tmp_path: Path) -> None:
    d = model_dir(tmp_path, generation={"max_new_tokens": 512})
    cfg = load_config(None, [f"model.path={d}", "model.max_model_len=300", "generator.max_new_tokens=40"])
    assert (cfg.model.max_model_len, cfg.generator.max_new_tokens) == (300, 40)
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model:\n  max_model_len: 64\ngenerator:\n  max_new_tokens: 6\n")
    cfg = load_config(yaml_file, [f"model.path={d}"])
    assert (cfg.model.max_model_len, cfg.generator.max_new_tokens) == (64, 6)
    # a resumed run reads its own config.json back: every key is set there, the model is not asked again
    resolved = load_config(None, [f"model.path={d}"])
    (d / "generation_config.json").write_text(json.dumps({"max_new_tokens": 99}))
    (tmp_path / "config.json").write_text(resolved.to_json())
    again = load_config(tmp_path / "config.json", [])
    assert (again.model.max_model_len, again.generator.max_new_tokens) == (2048, 512)


def test_a_model_that_gives_no_completion_length_is_refused_naming_both_keys(tmp_path: Path) -> None:
    d = model_dir(tmp_path, generation={"eos_token_id": 2})
    with pytest.raises(ConfigError) as exc:
        load_config(None, [f"model.path={d}"])
    text = str(exc.value)
    assert "generator.max_new_tokens" in text and "model.max_model_len" in text and str(d) in text
    assert "\n" not in text
    assert load_config(None, [f"model.path={d}", "generator.max_new_tokens=32"]).model.max_model_len == 2048
    bare = model_dir(tmp_path, config={"max_position_embeddings": None}, name="no_window")  # nor a window
    with pytest.raises(ConfigError, match=r"model.max_model_len \(.*config.json states no .*generator.max_new_tok"):
        load_config(None, [f"model.path={bare}"])


def test_the_window_is_the_smallest_the_config_states_or_its_text_configs(tmp_path: Path) -> None:
    d = model_dir(tmp_path, config={"max_position_embeddings": 8192, "seq_length": 4096},
                  generation={"max_new_tokens": 100})
    assert load_config(None, [f"model.path={d}"]).model.max_model_len == 4096
    nested = model_dir(tmp_path, config={"max_position_embeddings": None, "text_config": {"n_positions": 1024}},
                       generation={"max_new_tokens": 100}, name="nested")
    assert load_config(None, [f"model.path={nested}"]).model.max_model_len == 1024


def test_the_tiny_model_keeps_its_defaults_with_or_without_model_path(tmp_path: Path, tiny_model_dir: Path) -> None:
    plain = load_config(None, [])
    assert (plain.model.max_model_len, plain.generator.max_new_tokens) == (64, 6)
    built = load_config(None, [f"model.path={tiny_model_dir}"])  # its generation config states its 6 tokens
    assert (built.model.max_model_len, built.generator.max_new_tokens) == (64, 6)
    cached = model_dir(tmp_path, config={"max_position_embeddings": 64}, name="tiny-abc")  # an older cache build
    (cached / "tiny_info.json").write_text("{}")
    old = load_config(None, [f"model.path={cached}"])
    assert (old.model.max_model_len, old.generator.max_new_tokens) == (64, 6)
    assert "the tiny model" in model_limits_line(plain)


def test_the_dry_run_prints_what_they_resolved_to(tmp_path: Path) -> None:
    d = model_dir(tmp_path, generation={"max_new_tokens": 512})
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "cluster.py"), "--dry-run", "--model", str(d)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("model: "))
    assert "model.max_model_len=2048" in line and "generator.max_new_tokens=512" in line, line
    assert "config.json: a window of 2048" in line and "max_new_tokens 512" in line, line
    refused = subprocess.run([sys.executable, str(ROOT / "launch" / "cluster.py"), "--dry-run", "--model",
                              str(model_dir(tmp_path, name="no_generation_config"))],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --model ")
    assert "generator.max_new_tokens" in refused.stderr and "model.max_model_len" in refused.stderr


def test_a_long_window_is_taken_up_to_the_cap_and_the_memory_refusal_names_the_token_budget(tmp_path: Path) -> None:
    """A 128k window filled in whole sized every learner row for it: a 0.5B model was refused with 86 TB per rank
    and advice about the KV cache. The default takes at most WINDOW_CAP; where activations still do not fit, the
    refusal names the learner's token budget."""
    from async_rlhf.config.model_limits import WINDOW_CAP
    from async_rlhf.driver.memory_plan import check_memory, plan_for

    d = model_dir(tmp_path, config={"max_position_embeddings": 131072, "hidden_size": 896,
                                    "num_hidden_layers": 24, "intermediate_size": 4864, "num_attention_heads": 14,
                                    "vocab_size": 151936}, generation={"max_new_tokens": 512})
    cfg = load_config(None, [f"model.path={d}"])
    assert cfg.model.max_model_len == WINDOW_CAP
    assert f"a default window is at most {WINDOW_CAP}, set model.max_model_len" in model_limits_line(cfg)
    assert load_config(None, [f"model.path={d}", "model.max_model_len=32768"]).model.max_model_len == 32768
    plan = plan_for(cfg)
    assert plan.activation_gb > 1.0
    with pytest.raises(ConfigError, match="activations are .* GB of it: bound them with "
                                          r"learner.max_tokens_per_micro_batch"):
        check_memory(plan, 8.0)
    budgeted = plan_for(load_config(None, [f"model.path={d}", "learner.max_tokens_per_micro_batch=4096"]))
    assert budgeted.activation_gb < plan.activation_gb
