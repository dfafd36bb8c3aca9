"""``run.report_to`` (issue 47, part 3): the metrics reach wandb (offline) and MLflow (a file store) under the names
TensorBoard has, each read back from what the real package wrote; a tracker that cannot start or log warns once
and is left out while metrics.jsonl keeps every record; a bad value is refused naming it and the accepted ones.
Nothing is written outside tmp_path (wandb's and MLflow's directories and caches point there) and no network."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from async_rlhf.config import Config, ConfigError, load_config, parse_report_to
from async_rlhf.driver.metrics import MetricsWriter
from async_rlhf.driver.trackers import MlflowTracker, WandbTracker

pytestmark = pytest.mark.unit

PASSWORD = "s3cr3t-Pa55"


@pytest.fixture
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """wandb offline and silent, its caches and settings, MLflow's and HOME under tmp_path; no tracking server."""
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_API_KEY", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # so that undo removes what the tracker sets
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    home = tmp_path / "home"
    for var, sub in (("HOME", "home"), ("XDG_CACHE_HOME", "home/.cache"), ("XDG_CONFIG_HOME", "home/.config"),
                     ("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "wandb_cache"),
                     ("WANDB_CONFIG_DIR", "wandb_config"), ("WANDB_DATA_DIR", "wandb_data"),
                     ("WANDB_ARTIFACT_DIR", "wandb_artifacts")):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(tmp_path / sub))
    assert home.is_dir()
    run_dir = tmp_path / "runs" / "demo"
    run_dir.mkdir(parents=True)
    return run_dir


def resolved_config(run_dir: Path) -> dict[str, Any]:
    """What the driver hands the trackers: config.json's content (a Redis password masked)."""
    cfg = Config()
    cfg.run.dir = str(run_dir)
    cfg.buffer.redis_url = f"redis://:{PASSWORD}@10.0.0.5:6379/0"
    return json.loads(cfg.to_json())


def records() -> list[tuple[dict[str, Any], int]]:
    """Three learner steps, then a held-out evaluation of version 2 written after step 3 (as the driver does)."""
    out: list[tuple[dict[str, Any], int]] = []
    for step in (1, 2, 3):
        out.append(({"step": step, "version": step, "rollout/reward_mean": 0.25 * step, "staleness/mean": 1.0,
                     "staleness/hist": {"0": 3, "1": 5}, "train/flag": True, "kind": "train"}, step))
    out.append(({"kind": "eval", "version": 2, "eval/heldout_accuracy": 0.5}, 2))
    return out


def write_all(writer: MetricsWriter) -> None:
    for record, step in records():
        writer.write(record, step)
    writer.close()


def jsonl(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline run's ``.wandb`` file (wandb's LevelDB-style log of protobuf records: a 7-byte
    header, then 32 KiB blocks of chunks, each with a 7-byte header: crc32c, length, type; full=1, last=4)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    pos, block, data = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block  # the block's padding
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        data += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(data)
            data = b""
            yield rec


def item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)  # wandb keeps some keys as a path of their parts


def test_wandb_offline_and_mlflow_file_store_get_every_metric(tracker_env: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tracker_env
    writer = MetricsWriter(run_dir, ["tensorboard", "wandb", "mlflow"], resolved_config(run_dir))
    assert [t.name for t in writer.trackers] == ["tensorboard", "wandb", "mlflow"]
    mlflow_tracker = writer.trackers[2]
    assert isinstance(mlflow_tracker, MlflowTracker)
    write_all(writer)
    assert "warning" not in capsys.readouterr().out
    assert len(jsonl(run_dir)) == 4
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))

    # MLflow: the file store in run.dir/mlruns, read back through its own client
    from mlflow.tracking import MlflowClient

    uri = "file:" + str((run_dir / "mlruns").resolve())
    assert mlflow_tracker.uri == uri
    client = MlflowClient(uri)
    run = client.get_run(mlflow_tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "demo"
    assert client.get_experiment(run.info.experiment_id).name == "async_rlhf"
    history = client.get_metric_history(mlflow_tracker.run_id, "rollout/reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(mlflow_tracker.run_id, "eval/heldout_accuracy")] \
        == [(2, 0.5)]
    assert set(run.data.metrics) == {"rollout/reward_mean", "staleness/mean", "eval/heldout_accuracy"}
    params = run.data.params
    assert params["run.dir"] == str(run_dir) and params["train.steps"] == str(Config().train.steps)
    assert PASSWORD not in json.dumps(params) and "***" in params["buffer.redis_url"]

    # wandb: an offline run in run.dir/wandb, its history read back from the .wandb file
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = offline.glob("run-*.wandb")
    rows, config = [], {}
    for rec in wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            rows.append({item_key(item): json.loads(item.value_json) for item in rec.history.item})
        elif kind == "run":  # its config as wandb.init got it (a later "config" record would update it)
            assert rec.run.display_name == "demo" and rec.run.project == "async_rlhf"
            config.update({item_key(item): json.loads(item.value_json) for item in rec.run.config.update})
        elif kind == "config":
            config.update({item_key(item): json.loads(item.value_json) for item in rec.config.update})
    logged = [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]
    assert logged == [{"step": s, "rollout/reward_mean": 0.25 * s, "staleness/mean": 1.0} for s in (1, 2, 3)] \
        + [{"step": 2, "eval/heldout_accuracy": 0.5}]
    assert config["run"]["dir"] == str(run_dir) and "***" in config["buffer"]["redis_url"]
    assert PASSWORD.encode() not in log.read_bytes()


def test_a_tracker_that_fails_to_log_warns_once_and_the_rest_go_on(tracker_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tracker_env

    def broken(self: MlflowTracker, values: dict[str, float], step: int) -> None:
        raise RuntimeError("store unreachable")

    monkeypatch.setattr(MlflowTracker, "log", broken)
    writer = MetricsWriter(run_dir, ["tensorboard", "mlflow"], resolved_config(run_dir))
    mlflow_tracker = writer.trackers[1]
    write_all(writer)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: run.report_to=mlflow: cannot log step 1 (RuntimeError: store unreachable)")
    assert "leave mlflow out of run.report_to" in lines[0] and "metrics.jsonl has every record" in lines[0]
    assert [r.get("step", r.get("version")) for r in jsonl(run_dir)] == [1, 2, 3, 2]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    from mlflow.tracking import MlflowClient

    assert MlflowClient(mlflow_tracker.uri).get_run(mlflow_tracker.run_id).info.status == "FINISHED"  # closed


def test_a_missing_package_warns_with_the_install_command(tracker_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, as without the package
    writer = MetricsWriter(tracker_env, ["wandb"], resolved_config(tracker_env))
    assert writer.trackers == []
    write_all(writer)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("warning: run.report_to=wandb: cannot start (ModuleNotFoundError") \
        or line.startswith("warning: run.report_to=wandb: cannot start (ImportError"), line
    assert "Fix: pip install wandb, or leave wandb out of run.report_to" in line
    assert len(jsonl(tracker_env)) == 4
    assert not (tracker_env / "wandb").exists()


def test_a_tracker_that_cannot_start_names_its_setting(tracker_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import wandb

    def refused(**kwargs: Any) -> None:  # wandb reads WANDB_MODE once per process: its refusal, as it words it
        raise wandb.errors.UsageError("Settings: mode: Input should be 'online', 'offline', ...")

    monkeypatch.setenv("WANDB_MODE", "bogus")
    monkeypatch.setattr(wandb, "init", refused)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"bogus://user:{PASSWORD}@host/x")
    writer = MetricsWriter(tracker_env, ["wandb", "mlflow", "tensorboard"], resolved_config(tracker_env))
    assert [t.name for t in writer.trackers] == ["tensorboard"]
    write_all(writer)
    wandb_line, mlflow_line = capsys.readouterr().out.splitlines()
    assert wandb_line.startswith("warning: run.report_to=wandb: cannot start (")
    assert "Fix: check WANDB_MODE=bogus" in wandb_line
    assert mlflow_line.startswith("warning: run.report_to=mlflow: cannot start (")
    assert "Fix: check MLFLOW_TRACKING_URI=bogus://user:***@host/x" in mlflow_line
    assert PASSWORD not in mlflow_line  # MLflow's own message names the URI: its password is masked there too
    assert len(jsonl(tracker_env)) == 4
    assert isinstance(WandbTracker.fix(ImportError("x")), str)


def test_report_to_none_writes_only_the_jsonl(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, parse_report_to("none"))
    write_all(writer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_report_to_is_parsed() -> None:
    assert parse_report_to(Config().run.report_to) == ["tensorboard"]  # the default: what runs always had
    assert parse_report_to(" TensorBoard,wandb ,wandb,mlflow") == ["tensorboard", "wandb", "mlflow"]
    assert parse_report_to("none") == []
    assert load_config(None, ["run.report_to=wandb,mlflow"]).run.report_to == "wandb,mlflow"


@pytest.mark.parametrize("value, what", [
    ("tensorboard,wandbb", "unknown tracker 'wandbb'"),
    ("comet", "unknown tracker 'comet'"),
    ("tensorboard,,wandb", "an empty entry"),
    ("", "an empty entry"),
])
def test_a_bad_report_to_is_refused_naming_it_and_the_choices(value: str, what: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run.report_to={value}"])
    message = str(err.value)
    assert message.startswith(f"run.report_to={value!r}: {what}; "), message
    assert "use a comma-separated list of tensorboard, wandb, mlflow, none" in message


def test_none_stands_alone() -> None:
    with pytest.raises(ConfigError, match=r"run.report_to='none,wandb': none means no tracker, so it stands alone"):
        load_config(None, ["run.report_to=none,wandb"])
