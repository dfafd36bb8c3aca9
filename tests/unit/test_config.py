"""Configuration: defaults, YAML + overrides precedence, and every refusal naming its cause."""

import json
import os

import pytest

from async_rlhf.config import Config, ConfigError, check_model_dir, load_config, validate


def test_defaults_validate():
    cfg = load_config()
    assert cfg == Config()
    assert validate(Config()) == Config()
    assert cfg.train.steps == 100 and cfg.generators == 2 and cfg.learners == 1


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "generators: 3\n"
        "train:\n"
        "  steps: 50\n"
        "  batch_size: 8\n"
        "  lr: 0.001\n"
        "  objective:\n"
        "    kind: ppo\n"
        "    eps_high: 0.3\n"
        "generator:\n"
        "  temperature: 0.7\n"
    )
    cfg = load_config(path, ["train.steps=200", "train.objective.kind=tis_seq", "model.path=/m/x"])
    # overrides win over the file
    assert cfg.train.steps == 200
    assert cfg.train.objective.kind == "tis_seq"
    # the file wins over the defaults where not overridden
    assert cfg.generators == 3
    assert cfg.train.batch_size == 8
    assert cfg.train.lr == pytest.approx(0.001)
    assert cfg.train.objective.eps_high == pytest.approx(0.3)
    assert cfg.generator.temperature == pytest.approx(0.7)
    assert cfg.model.path == "/m/x"
    # untouched keys keep their defaults
    assert cfg.train.group_size == Config().train.group_size
    assert cfg.train.objective.eps_low == Config().train.objective.eps_low
    assert cfg.sync.bucket_mb == Config().sync.bucket_mb


def test_override_types_are_converted():
    cfg = load_config(None, ["train.lr=1", "buffer.request_timeout_s=2", "train.max_staleness=0",
                             "model.path=123"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.buffer.request_timeout_s == 2.0 and isinstance(cfg.buffer.request_timeout_s, float)
    assert cfg.train.max_staleness == 0
    assert cfg.model.path == "123"


@pytest.mark.parametrize("override,key", [
    ("bogus=1", "bogus"),
    ("train.bogus=1", "train.bogus"),
    ("train.objective.bogus=1", "train.objective.bogus"),
    ("nosection.steps=1", "nosection"),
])
def test_unknown_override_key_is_named(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, [override])


@pytest.mark.parametrize("text,key", [
    ("colour: red\n", "colour"),
    ("train:\n  stepz: 3\n", "train.stepz"),
    ("train:\n  objective:\n    kindd: ppo\n", "train.objective.kindd"),
])
def test_unknown_yaml_key_is_named(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"'{key}'") as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("override", ["train.steps=abc", "train.steps=1.5", "train.lr=fast",
                                      "generators=[1, 2]"])
def test_wrong_type_is_refused(override):
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["train.steps=true", "generators=yes", "train.lr=false"])
def test_boolean_for_a_number_is_refused(override):
    # YAML reads true/yes/false as booleans; int(True) == 1 would silently make a 1-step run
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_section_set_to_a_scalar_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train"):
        load_config(None, ["train=5"])
    path = tmp_path / "s.yaml"
    path.write_text("train: 5\n")
    with pytest.raises(ConfigError, match="train"):
        load_config(path)


def test_sub_key_of_a_scalar_is_refused():
    with pytest.raises(ConfigError, match="generators"):
        load_config(None, ["generators.count=2"])


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.steps"])


@pytest.mark.parametrize("override,key", [
    ("generators=0", "generators"),
    ("learners=-1", "learners"),
    ("train.steps=0", "train.steps"),
    ("sync.bucket_mb=0", "sync.bucket_mb"),
    ("learner.zero3_gather_mb=0", "learner.zero3_gather_mb"),
    ("train.max_staleness=-1", "train.max_staleness"),
])
def test_non_positive_sizes_are_refused(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_unreadable_config_path(tmp_path):
    missing = tmp_path / "nope" / "run.yaml"
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(missing)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)  # a directory


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_config_without_read_permission(tmp_path):
    path = tmp_path / "locked.yaml"
    path.write_text("generators: 1\n")
    path.chmod(0)
    try:
        with pytest.raises(ConfigError, match="cannot read config file"):
            load_config(path)
    finally:
        path.chmod(0o600)


@pytest.mark.parametrize("text", ["train: [unclosed\n", "train:\n  steps: 1\n bad indent: {\n", "a: b: c\n"])
def test_invalid_yaml(tmp_path, text):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_empty_yaml_is_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == Config()


@pytest.mark.parametrize("override,key", [
    ("train.advantage=ppo", "train.advantage"),
    ("train.objective.kind=sac", "train.objective.kind"),
    ("buffer.store=sqlite", "buffer.store"),
    ("model.dtype=int8", "model.dtype"),
    ("generator.update_mode=never", "generator.update_mode"),
])
def test_choice_outside_its_list(override, key):
    with pytest.raises(ConfigError, match=key) as info:
        load_config(None, [override])
    assert override.partition("=")[2] in str(info.value)


def test_batch_size_must_be_a_multiple_of_learners():
    with pytest.raises(ConfigError, match="multiple"):
        load_config(None, ["learners=3", "train.batch_size=16"])
    cfg = load_config(None, ["learners=4", "train.batch_size=16"])
    assert cfg.learners == 4


def test_other_range_checks():
    for override in ("train.group_size=1", "learner.zero_stage=4", "train.objective.eps_low=1.5",
                     "train.objective.is_cap=1.0", "generator.temperature=0"):
        with pytest.raises(ConfigError):
            load_config(None, [override])
    # group_size 1 is fine for an estimator that does not compare samples
    assert load_config(None, ["train.group_size=1", "train.advantage=reinforce_pp"]).train.group_size == 1


def test_to_json_round_trips_values():
    cfg = load_config(None, ["train.steps=7"])
    data = json.loads(cfg.to_json())
    assert data["train"]["steps"] == 7
    assert data["train"]["objective"]["kind"] == "decoupled_ppo"


# -- check_model_dir ---------------------------------------------------------------------------------
def test_model_dir_missing(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_dir(str(tmp_path / "absent"))


def test_model_dir_is_a_file(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"\x00")
    with pytest.raises(ConfigError, match="is a file"):
        check_model_dir(str(f))


def test_model_dir_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        check_model_dir(str(tmp_path))


def test_model_dir_with_unreadable_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        check_model_dir(str(tmp_path))


@pytest.mark.parametrize("archs", [["BertForSequenceClassification"], ["LlamaForSequenceClassification"],
                                   [], None])
def test_model_dir_that_is_not_a_causal_lm(tmp_path, archs):
    meta = {"model_type": "llama"}
    if archs is not None:
        meta["architectures"] = archs
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="not a causal language model"):
        check_model_dir(str(tmp_path))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"])
def test_causal_lm_dir_passes(tmp_path, arch):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    assert check_model_dir(str(tmp_path)) is None


@pytest.mark.parametrize("override, words", [
    ("buffer.port=99999", "buffer.port must be a TCP port, 0-65535"),
    ("buffer.port=-1", "buffer.port must be a TCP port"),
    ("sync.timeout_s=0", "sync.timeout_s must be above 0"),
    ("rewards.timeout_s=-5", "rewards.timeout_s must be above 0"),
    ("train.lr=0", "train.lr must be above 0"),
    ("buffer.max_message_mb=0", "buffer.max_message_mb must be at least 1"),
    ("train.weight_decay=-0.1", "train.weight_decay must be 0 or more"),
])
def test_out_of_range_values_are_refused_with_the_key_and_the_range(override: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, [override])


def test_port_bounds_are_accepted() -> None:
    assert load_config(None, ["buffer.port=0"]).buffer.port == 0
    assert load_config(None, ["buffer.port=65535"]).buffer.port == 65535
