"""Secrets stay out of run.dir/config.json and out of error messages, and a resume gets them back from the command
line or the environment, or is refused saying where to give them (issue 44, defect 10)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from async_rlhf.config import Config, ConfigError, load_config
from async_rlhf.config.secrets import SECRET_ENV, fill_secrets, mask_url, public_dict

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "s3cr3t-Pa55"
SERVER_SECRET = "S" * 40
CLIENT_SECRET = "C" * 40
REDIS = f"redis://:{PASSWORD}@10.0.0.5:6379/0"


def secret_overrides() -> list[str]:
    return ["buffer.store=redis", f"buffer.redis_url={REDIS}", "prompts.source=redis",
            f"prompts.redis_url=redis://user:{PASSWORD}@10.0.0.6:6380/1", "buffer.curve=true",
            f"buffer.curve_secret_key={SERVER_SECRET}", "buffer.curve_public_key=" + "P" * 40,
            "buffer.curve_client_keys=" + "Q" * 40, f"buffer.curve_client_secret_key={CLIENT_SECRET}",
            "buffer.curve_client_public_key=" + "Q" * 40]


def written_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in SECRET_ENV.values():
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(None, secret_overrides())
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())  # what driver/runner.py writes into run.dir
    return path


def test_config_json_holds_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = written_config(tmp_path, monkeypatch).read_text()
    for secret in (PASSWORD, SERVER_SECRET, CLIENT_SECRET):
        assert secret not in text
    data = json.loads(text)
    assert data["buffer"]["redis_url"] == "redis://:***@10.0.0.5:6379/0"
    assert data["prompts"]["redis_url"] == "redis://user:***@10.0.0.6:6380/1"
    assert "curve_secret_key" not in data["buffer"] and "curve_client_secret_key" not in data["buffer"]
    assert data["buffer"]["curve_public_key"] == "P" * 40  # public keys are no secret


def test_mask_url_forms() -> None:
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert mask_url(f"rediss://:{PASSWORD}@h:1/2") == "rediss://:***@h:1/2"
    assert PASSWORD not in mask_url(f"redis://h:1/0?password={PASSWORD}&db=3")
    assert "db=3" in mask_url(f"redis://h:1/0?password={PASSWORD}&db=3")
    assert mask_url(f"https://bot:{PASSWORD}@scorer.example/score") == "https://bot:***@scorer.example/score"
    assert public_dict({"run": {"dir": "x"}}) == {"run": {"dir": "x"}}


def test_a_resume_without_the_password_is_refused_naming_where_to_give_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = written_config(tmp_path, monkeypatch)
    with pytest.raises(ConfigError) as err:
        load_config(path, [f"buffer.curve_secret_key={SERVER_SECRET}",
                           f"buffer.curve_client_secret_key={CLIENT_SECRET}"])
    msg = str(err.value)
    assert "buffer.redis_url" in msg and SECRET_ENV["buffer.redis_url"] in msg and PASSWORD not in msg
    with pytest.raises(ConfigError) as err:  # the CURVE secret keys: left out, asked for
        load_config(path, [f"buffer.redis_url={REDIS}"])
    assert SECRET_ENV["buffer.curve_secret_key"] in str(err.value)


def test_a_resume_gets_the_secrets_from_the_environment_or_the_command_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = written_config(tmp_path, monkeypatch)
    monkeypatch.setenv(SECRET_ENV["buffer.redis_url"], PASSWORD)
    monkeypatch.setenv(SECRET_ENV["prompts.redis_url"], PASSWORD)
    monkeypatch.setenv(SECRET_ENV["buffer.curve_secret_key"], SERVER_SECRET)
    monkeypatch.setenv(SECRET_ENV["buffer.curve_client_secret_key"], CLIENT_SECRET)
    cfg = load_config(path)
    assert cfg.buffer.redis_url == REDIS
    assert cfg.prompts.redis_url == f"redis://user:{PASSWORD}@10.0.0.6:6380/1"
    assert (cfg.buffer.curve_secret_key, cfg.buffer.curve_client_secret_key) == (SERVER_SECRET, CLIENT_SECRET)
    # the command line wins over the environment
    cfg = load_config(path, ["buffer.redis_url=redis://:other@10.0.0.5:6379/0"])
    assert cfg.buffer.redis_url == "redis://:other@10.0.0.5:6379/0"
    # a password with characters a URL escapes comes back intact
    cfg = Config()
    cfg.buffer.redis_url = "redis://:***@10.0.0.5:6379/0"
    fill_secrets(cfg, {SECRET_ENV["buffer.redis_url"]: "p@ss:w/rd"})
    assert unquote(urlsplit(cfg.buffer.redis_url).password or "") == "p@ss:w/rd"
    assert urlsplit(cfg.buffer.redis_url).hostname == "10.0.0.5"


def test_a_masked_url_the_run_does_not_use_is_no_error() -> None:
    cfg = load_config(None, ["buffer.redis_url=redis://:***@10.0.0.5:6379/0"])  # store=memory
    assert cfg.buffer.store == "memory"


def test_the_launcher_resumes_from_config_json_with_the_password_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-000005"
    for part in ("deepspeed", "policy"):
        (ckpt / part).mkdir(parents=True)
    (ckpt / "checkpoint.json").write_text(json.dumps({"format": 1, "step": 5, "version": 5, "data": {}}))
    for var in SECRET_ENV.values():
        monkeypatch.delenv(var, raising=False)
    cfg = load_config(None, ["buffer.store=redis", f"buffer.redis_url={REDIS}", f"run.dir={run}"])
    (run / "config.json").write_text(cfg.to_json())
    spec = importlib.util.spec_from_file_location("launch_cluster_for_test", ROOT / "launch" / "cluster.py")
    assert spec is not None and spec.loader is not None
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    args = launcher.parse_args(["--resume", str(run), "train.steps=10"])
    with pytest.raises(ConfigError) as err:
        launcher.build_config(args)
    assert SECRET_ENV["buffer.redis_url"] in str(err.value) and PASSWORD not in str(err.value)
    monkeypatch.setenv(SECRET_ENV["buffer.redis_url"], PASSWORD)
    args = launcher.parse_args(["--resume", str(run), "train.steps=10"])
    assert launcher.build_config(args).buffer.redis_url == REDIS


def test_no_config_error_echoes_a_password() -> None:
    for overrides in (["buffer.store=redis", f"buffer.redis_url=http://:{PASSWORD}@10.0.0.5:6379/0"],
                      ["rewards.sources=http", f"rewards.http_url=ftp://bot:{PASSWORD}@scorer/score"]):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert PASSWORD not in str(err.value), str(err.value)


def test_http_scorer_errors_never_name_the_password() -> None:
    from async_rlhf.rewards.base import RewardError
    from async_rlhf.rewards.http import JsonPoster, check_url

    with pytest.raises(RewardError) as err:
        check_url("ftp://user:hunter2@scorer.internal/score")
    assert "hunter2" not in str(err.value) and "***" in str(err.value)
    assert "hunter2" not in JsonPoster("https://user:hunter2@scorer.internal/score", 5.0).shown
