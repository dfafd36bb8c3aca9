"""The Ray a run starts for itself prestarts no idle workers, unless the user says otherwise (ray.init is replaced
by a recorder here: the subject is the environment its processes would inherit)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from async_rlhf.driver import local_ray
from async_rlhf.driver.local_ray import LOCAL_RAY_ENV, start_local_ray

pytestmark = pytest.mark.unit


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    calls: list[dict] = []

    def init(**kwargs):
        calls.append({"kwargs": kwargs, "env": {k: os.environ.get(k) for k in LOCAL_RAY_ENV}})

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=init))
    for key in LOCAL_RAY_ENV:  # what start_local_ray sets is undone after the test (setenv records the original)
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return calls


def test_the_local_ray_starts_without_prestarted_workers(fake_ray: list[dict]) -> None:
    start_local_ray(6, {"TOKENIZERS_PARALLELISM": "false"})
    (call,) = fake_ray
    assert call["env"] == LOCAL_RAY_ENV  # set before ray.init starts the raylet, which reads them
    assert call["kwargs"]["address"] == "local" and call["kwargs"]["num_cpus"] == 6
    assert call["kwargs"]["runtime_env"] == {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}


def test_a_users_setting_wins(fake_ray: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    start_local_ray(2, {})
    assert fake_ray[0]["env"]["RAY_prestart_worker_first_driver"] == "1"
    assert fake_ray[0]["env"]["RAY_enable_worker_prestart"] == "0"


def timing_out_ray(monkeypatch: pytest.MonkeyPatch, failures: int, error: str) -> list[int]:
    """A ray whose init raises ``error`` ``failures`` times, then starts; a failed start's processes are recorded
    as stopped instead of looked for."""
    calls: list[int] = []

    def init(**kwargs):
        calls.append(len(calls))
        if len(calls) <= failures:
            raise Exception(error)

    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=init))
    monkeypatch.setattr(local_ray, "child_pids", lambda: set())
    monkeypatch.setattr(local_ray, "stop_children_since", lambda before: [101, 102])
    return calls


TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
             "startup or the GCS has become overloaded.")  # ray 2.60's words


def test_a_start_that_timed_out_is_stopped_and_tried_again(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    calls = timing_out_ray(monkeypatch, 2, TIMED_OUT)
    with caplog.at_level("WARNING", logger="async_rlhf.driver.local_ray"):
        start_local_ray(2, {})
    assert calls == [0, 1, 2]
    assert [r.getMessage().split("(start ")[-1] for r in caplog.records] == ["2 of 3)", "3 of 3)"]
    assert all("stopped its 2 processes" in r.getMessage() for r in caplog.records)


def test_every_start_timing_out_names_the_load_and_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = timing_out_ray(monkeypatch, 5, TIMED_OUT)
    with pytest.raises(RuntimeError, match=r"3 starts each timed out .*load average .* --address"):
        start_local_ray(2, {}, attempts=3)
    assert len(calls) == 3


def test_any_other_failure_is_raised_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = timing_out_ray(monkeypatch, 5, "Permission denied: /tmp/ray")
    with pytest.raises(Exception, match="Permission denied"):
        start_local_ray(2, {})
    assert calls == [0]


def test_only_rays_own_processes_are_stopped_after_a_failed_start() -> None:
    site = "/work/.venv/lib/python3.11/site-packages"
    for cmdline in ([f"{site}/ray/core/src/ray/gcs/gcs_server", "--gcs_server_port=0"],
                    [f"{site}/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/ray/s/sockets/raylet"],
                    ["/usr/bin/python3", f"{site}/ray/_private/log_monitor.py", "--session-dir=/tmp/ray/s"],
                    ["/usr/bin/python3", "-u", f"{site}/ray/dashboard/agent.py", "--node-ip-address=10.0.0.1"],
                    ["ray::DashboardAgent"], ["ray::RuntimeEnvAgent"]):  # retitled (as seen in a real start)
        assert local_ray.is_ray_process(cmdline), cmdline
    for cmdline in (["/usr/bin/python3", "-m", "async_rlhf.prebuild"], ["ninja", "-v"], ["/usr/bin/rayleigh"]):
        assert not local_ray.is_ray_process(cmdline), cmdline
