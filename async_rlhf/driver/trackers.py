"""Where a run's curves go besides ``run.dir/metrics.jsonl`` (``run.report_to``; issue 47, part 3).

    tensorboard  run.dir/tensorboard/ (torch's SummaryWriter)
    wandb        offline into run.dir/wandb/offline-run-*/ unless WANDB_MODE is set (then as it says; upload an
                 offline run with ``wandb sync``); project WANDB_PROJECT or async_rlhf, the run named after run.dir,
                 its config what run.dir/config.json holds (no secrets)
    mlflow       a file store in run.dir/mlruns/ unless MLFLOW_TRACKING_URI is set; experiment MLFLOW_EXPERIMENT_NAME
                 or async_rlhf, the run named after run.dir, its params config.json's keys flattened (``train.steps``)

Each is given a record's scalars (its keys with a ``/`` and a number: the names TensorBoard always had) at the
record's step (a learner step; a held-out evaluation's policy version). wandb plots them against a ``step`` metric
of its own (``define_metric``), so an evaluation written after later steps still lands at its version.

A tracker never stops a run: one that cannot be imported, started, written or closed prints one ``warning:`` line
(the tracker, the error, the fix) and is left out from then on while the others go on; metrics.jsonl has every
record regardless. The packages are imported inside the classes, only when asked for.

MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE=true``: the mlflow tracker sets it (unless it is set)
when it writes its own run.dir/mlruns, and ``mlflow ui`` needs it too.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PROJECT = "async_rlhf"
"""The wandb project (without WANDB_PROJECT) and the MLflow experiment (without MLFLOW_EXPERIMENT_NAME)."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The values of a metrics record that the trackers plot: keys with a ``/`` and a number (never a bool)."""
    return {k: float(v) for k, v in record.items()
            if "/" in k and isinstance(v, numbers.Number) and not isinstance(v, bool)}


def warning_line(name: str, what: str, exc: BaseException, fix: str,
                 outcome: str = "is left out for the rest of this run") -> str:
    """The one console line of a tracker that failed: which, what it was doing, the error, what to do."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:2])  # pydantic's: what, then why
    text = re.sub(r"(://[^\s/@:]*:)[^\s/@]+@", r"\1***@", text)  # a URL's password (MLflow names its URI)
    detail = f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
    return (f"warning: run.report_to={name}: {what} ({detail}); {name} {outcome} (metrics.jsonl has every "
            f"record). Fix: {fix}, or leave {name} out of run.report_to")


class Tracker:
    """One experiment tracker: started by its constructor, given scalars by :meth:`log`, ended by :meth:`close`."""

    name = ""
    package = ""
    """What ``pip install`` brings when the import fails."""

    def log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @classmethod
    def fix(cls, exc: BaseException) -> str:
        """What to do about ``exc`` (the import's: install the package)."""
        if isinstance(exc, ImportError):
            return f"pip install {cls.package}"
        return cls.settings_hint()

    @classmethod
    def settings_hint(cls) -> str:
        return "check that run.dir is writable"


class TensorBoardTracker(Tracker):
    name = package = "tensorboard"

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    name = package = "wandb"
    STEP = "step"
    """wandb's x-axis for every metric: the step the record was written at (wandb's own ``_step`` counts calls)."""

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT, dir=str(run_dir), name=run_dir.resolve().name,
            config=config, mode=None if os.environ.get("WANDB_MODE") else "offline", reinit="create_new",
            settings=wandb.Settings(console="off"))  # the launcher's console and run.dir/logs stay as they are
        self._run.define_metric(self.STEP)
        self._run.define_metric("*", step_metric=self.STEP)

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log({**values, self.STEP: step})

    def close(self) -> None:
        self._run.finish()

    @classmethod
    def settings_hint(cls) -> str:
        mode = os.environ.get("WANDB_MODE")
        return (f"check WANDB_MODE={mode} and your wandb login (unset WANDB_MODE: offline, no network)" if mode
                else super().settings_hint())


class MlflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow-skinny (or mlflow, which also has mlflow ui)"

    def __init__(self, run_dir: Path, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = "file:" + str((run_dir / "mlruns").resolve())
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
        self.uri = uri
        self._client = client = MlflowClient(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(name)
            except Exception:  # another run made it meanwhile
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        self.run_id = client.create_run(experiment_id, run_name=run_dir.resolve().name).info.run_id
        self._key_len = MAX_ENTITY_KEY_LENGTH
        params = [Param(key[:MAX_ENTITY_KEY_LENGTH], value[:MAX_PARAM_VAL_LENGTH])
                  for key, value in flat_params(config).items()]
        try:
            for chunk in chunks(params, MAX_PARAMS_TAGS_PER_BATCH):
                client.log_batch(self.run_id, params=chunk)
        except Exception:
            with contextlib.suppress(Exception):  # the error to report is the one above
                client.set_terminated(self.run_id, "FAILED")
            raise

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(key, self._key_len), value, now, step) for key, value in values.items()]
        for chunk in chunks(metrics, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")

    @classmethod
    def settings_hint(cls) -> str:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            return super().settings_hint()
        from async_rlhf.config.secrets import mask_url

        return f"check MLFLOW_TRACKING_URI={mask_url(uri)}"


def metric_name(key: str, limit: int = 250) -> str:
    """``key`` as an MLflow metric name: characters MLflow refuses (all but letters, digits, ``_ - . : /`` and
    space) become ``_``; the names the run writes have none."""
    return re.sub(r"[^\w\-.: /]", "_", key)[:limit]


def flat_params(config: dict[str, Any]) -> dict[str, str]:
    """config.json's content as MLflow params: dotted keys (``train.objective.kind``), values as text (lists and
    other non-scalars as JSON)."""
    from async_rlhf.config.loading import flatten

    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(config).items()}


def chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MlflowTracker}
"""What each name of ``run.report_to`` starts (``none`` starts nothing)."""


def start_trackers(names: Iterable[str], run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The trackers of ``names`` that could be started; a warning line for each that could not."""
    started: list[Tracker] = []
    for name in names:
        kind = TRACKERS[name]
        try:
            started.append(kind(run_dir, config))
        except Exception as exc:  # a tracker never stops the run
            print(warning_line(name, "cannot start", exc, kind.fix(exc)), flush=True)
    return started
