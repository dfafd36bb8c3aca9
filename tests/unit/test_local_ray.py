"""The Ray a run starts for itself prestarts no idle workers, unless the user says otherwise (ray.init is replaced
by a recorder here: the subject is the environment its processes would inherit)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from async_rlhf.driver.local_ray import NO_PRESTART_ENV, start_local_ray

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []

    def init(**kwargs):
        calls.append({"kwargs": kwargs, "env": {k: os.environ.get(k) for k in NO_PRESTART_ENV}})

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=init))
    for key in NO_PRESTART_ENV:  # what start_local_ray sets is undone after the test (setenv records the original)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return calls


def test_the_local_ray_starts_without_prestarted_workers(fake_ray: list[dict]) -> None:
    start_local_ray(6, {"TOKENIZERS_PARALLELISM": "false"})
    (call,) = fake_ray
    assert call["env"] == NO_PRESTART_ENV  # set before ray.init starts the raylet, which reads them
    assert call["kwargs"]["address"] == "local" and call["kwargs"]["num_cpus"] == 6
    assert call["kwargs"]["runtime_env"] == {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}


def test_a_users_setting_wins(fake_ray: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    start_local_ray(2, {})
    assert fake_ray[0]["env"]["RAY_prestart_worker_first_driver"] == "1"
    assert fake_ray[0]["env"]["RAY_enable_worker_prestart"] == "0"
