"""Which roles start forked from the node's preloaded server (run.fork_workers; startup/forkserver.py), and the
server's name: per node, per import-time thread settings and preload list. The processes themselves are tested in
tests/integration/test_forkserver.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from async_rlhf.config import Config
from async_rlhf.driver.provision import start_early_fork_servers
from async_rlhf.driver.role_env import role_runtime_env
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


def test_a_server_is_per_interpreter_venv_and_preloaded_package_versions(tmp_path, monkeypatch) -> None:
    """Issue 44, defect 9: a server outlives the job that started it (it ends with its raylet), so a later job
    from another venv, another interpreter or after a package upgrade must get a server of its own."""
    def install(site: Path, version: str) -> None:
        (site / "fakepkg").mkdir(parents=True, exist_ok=True)
        (site / "fakepkg" / "__init__.py").write_text(f"VERSION = {version!r}\n")
        for old in site.glob("fakepkg-*.dist-info"):
            old.rmdir()
        (site / f"fakepkg-{version}.dist-info").mkdir()

    site = tmp_path / "venv_a" / "site-packages"
    install(site, "1.0")
    env = {"OMP_NUM_THREADS": "1", forkserver.PRELOAD_ENV: "fakepkg,fakepkg.sub?"}
    monkeypatch.setattr(sys, "path", [str(site), *sys.path])
    first = forkserver.server_name("n1", env)
    assert first == forkserver.server_name("n1", dict(env)), "the same job asks for the same server"

    install(site, "2.0")  # upgraded in place, between two jobs on one Ray
    upgraded = forkserver.server_name("n1", env)
    other = tmp_path / "venv_b" / "site-packages"  # the same version in another venv's folder
    install(other, "2.0")
    monkeypatch.setattr(sys, "path", [str(other), *sys.path[1:]])
    elsewhere = forkserver.server_name("n1", env)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv_c"))
    other_prefix = forkserver.server_name("n1", env)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv_c" / "bin" / "python"))
    other_interpreter = forkserver.server_name("n1", env)
    assert len({first, upgraded, elsewhere, other_prefix, other_interpreter}) == 5
    assert "fakepkg-2.0.dist-info" in forkserver.runtime_stamp(env)


def test_the_runtime_stamp_names_the_interpreter_venv_checkout_and_preloads(tmp_path) -> None:
    env = {forkserver.PRELOAD_ENV: "colorsys,no_such_module_here?"}
    stamp = forkserver.runtime_stamp(env)
    lines = stamp.splitlines()
    assert lines[0] == os.path.realpath(sys.executable) and sys.prefix in lines
    assert str(Path(forkserver.__file__).resolve().parents[1]) in lines, "this checkout's async_rlhf"
    assert any(line.startswith("colorsys: ") for line in lines) and "no_such_module_here: not found" in lines
    assert forkserver.server_name("n", env) == forkserver.server_name("n", env, stamp)
    assert forkserver.runtime_stamp(env, executable="/x/python", prefix="/x", path=[]) != stamp
    # what the default preload list stands for, looked up without importing any of it
    default = forkserver.runtime_stamp({})
    assert {line.split(":")[0] for line in default.splitlines()[4:]} == {"torch", "transformers", "vllm",
                                                                         "deepspeed"}


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
