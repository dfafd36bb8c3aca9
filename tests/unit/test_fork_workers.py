"""Which roles start forked from the node's preloaded server (run.fork_workers; startup/forkserver.py), and the
server's name: per node, per import-time thread settings and preload list. The processes themselves are tested in
tests/integration/test_forkserver.py."""

from __future__ import annotations

import sys

import pytest

from async_rlhf.config import Config
from async_rlhf.driver.cluster import role_runtime_env, start_early_fork_servers
from async_rlhf.startup import forkserver


def test_cpu_roles_start_through_the_fork_server_with_their_variables() -> None:
    env = role_runtime_env(Config(), {"OMP_NUM_THREADS": "1"})
    assert env == {"env_vars": {"OMP_NUM_THREADS": "1"},
                   "py_executable": f"{sys.executable} -m async_rlhf.startup.forkserver"}


def test_no_fork_when_turned_off_or_when_a_role_asks_for_gpus() -> None:
    off = Config()
    off.run.fork_workers = False
    gpu_gen, gpu_learner = Config(), Config()
    gpu_gen.resources.generator_gpus = 1.0
    gpu_learner.resources.learner_gpus = 0.5
    for cfg in (off, gpu_gen, gpu_learner):
        assert role_runtime_env(cfg, {"A": "b"}) == {"env_vars": {"A": "b"}}


def test_one_server_per_node_thread_settings_and_preload_list() -> None:
    name = forkserver.server_name("n1", {"OMP_NUM_THREADS": "1", "UNRELATED": "x"})
    assert name.startswith("\0") and len(name) <= 107, "an abstract socket name of at most 107 bytes"
    assert name == forkserver.server_name("n1", {"OMP_NUM_THREADS": "1", "UNRELATED": "y"})
    others = [forkserver.server_name("n2", {"OMP_NUM_THREADS": "1"}),
              forkserver.server_name("n1", {"OMP_NUM_THREADS": "2"}),
              forkserver.server_name("n1", {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}),
              forkserver.server_name("n1", {"OMP_NUM_THREADS": "1", forkserver.PRELOAD_ENV: "torch"})]
    assert len({name, *others}) == 5


def test_worker_arguments_are_read_in_both_spellings() -> None:
    argv = ["default_worker.py", "--node-id=abc", "--temp-dir", "/tmp/ray", "--session-name="]
    assert forkserver._arg(argv, "--node-id") == "abc"
    assert forkserver._arg(argv, "--temp-dir") == "/tmp/ray"
    assert forkserver._arg(argv, "--session-name") == ""
    assert forkserver._arg(argv, "--worker-id") is None


def test_servers_start_before_ray_only_for_a_ray_of_the_drivers_own(monkeypatch) -> None:
    """Joining a Ray (an address, ``ray job submit``'s RAY_ADDRESS) or not forking: nothing started early (the
    started case is tests/integration/test_forkserver.py's)."""
    off = Config()
    off.run.fork_workers = False
    assert start_early_fork_servers(Config(), "10.0.0.5:6379") is None
    assert start_early_fork_servers(off) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert start_early_fork_servers(Config()) is None


def test_the_request_wait_is_read_from_the_environment_and_a_bad_one_named() -> None:
    assert forkserver.request_s({}) == forkserver.REQUEST_S
    assert forkserver.request_s({forkserver.REQUEST_S_ENV: "2.5"}) == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match=rf"ASYNC_RLHF_FORKSERVER_REQUEST_S='{bad}' is not a positive number"):
            forkserver.request_s({forkserver.REQUEST_S_ENV: bad})
