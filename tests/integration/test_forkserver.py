"""The fork server Ray workers start through (async_rlhf/startup/forkserver.py), as real processes.

Most tests stand in a process named ``raylet`` (a link to this Python) for Ray's raylet and a small script for
Ray's ``default_worker.py``, with a cheap preload list, so that every path (fork, exit codes, signals, a killed
wrapper, the raylet's end, a server that does not answer, no raylet at all) runs in a second or two; the last
one starts real Ray actors through it with the real preload list. Every run of a generator or learner rank in
the integration and cluster tiers goes through it too (``run.fork_workers`` is on by default).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from async_rlhf.startup import forkserver

WORKER = textwrap.dedent('''
    import gc, json, os, sys, time
    out = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv, "cwd": os.getcwd(),
           "x": os.environ.get("X"), "preloaded": "colorsys" in sys.modules, "path": sys.path,
           "frozen": gc.get_freeze_count()}
    with open(os.environ["OUT"], "w") as f:
        json.dump(out, f)
    if "sleep" in sys.argv:
        time.sleep(120)
    sys.exit(int(os.environ.get("CODE", "0")))
''')

RAYLET = textwrap.dedent('''
    import subprocess, sys
    import os
    wrapper = subprocess.Popen([os.environ["REAL_PYTHON"], "-m", "async_rlhf.startup.forkserver", *sys.argv[1:]])
    print(wrapper.pid, flush=True)
    print(wrapper.wait(), flush=True)
    sys.stdin.read()  # lives until the test closes its stdin
''')


class FakeRaylet:
    """A process named ``raylet`` that starts one wrapper for ``worker.py`` and reports its pid and exit code."""

    def __init__(self, tmp: Path, node: str, env: dict[str, str], *args: str) -> None:
        exe = tmp / "bin" / "raylet"
        if not exe.exists():
            exe.parent.mkdir(exist_ok=True)
            exe.symlink_to(Path(sys.executable).parent / "python")  # the venv's python, named raylet
            (tmp / "worker.py").write_text(WORKER)
            (tmp / "raylet_main.py").write_text(RAYLET)
            (tmp / "s" / "logs").mkdir(parents=True)  # the session's logs: the server's log goes there
        self.out = tmp / f"out-{uuid.uuid4().hex[:6]}.json"
        full_env = {**os.environ, "ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys", "OUT": str(self.out),
                    "REAL_PYTHON": sys.executable, **env}
        self.proc = subprocess.Popen(
            [str(exe), str(tmp / "raylet_main.py"), str(tmp / "worker.py"), f"--node-id={node}",
             f"--temp-dir={tmp}", "--session-name=s", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full_env, cwd=tmp)
        self.wrapper = int(self.proc.stdout.readline())

    def worker(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return json.loads(self.out.read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
        raise AssertionError("the worker script never ran")

    def wrapper_code(self, timeout: float = 30.0) -> int:
        line = _readline(self.proc, timeout)
        return int(line)

    def end(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    assert sel.select(timeout), "no line in time"
    return proc.stdout.readline()


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.fixture()
def node() -> str:
    return uuid.uuid4().hex


@pytest.fixture()
def raylets():
    """FakeRaylet(...) for a test; each one's raylet (and so its server) ended after it, failed or not."""
    made: list[FakeRaylet] = []

    def make(*args, **kwargs) -> FakeRaylet:
        made.append(FakeRaylet(*args, **kwargs))
        return made[-1]

    yield make
    for fake in reversed(made):
        if fake.proc.poll() is None:
            fake.proc.kill()
            fake.proc.wait(timeout=10)


@pytest.mark.isolated
def test_a_worker_is_forked_with_its_environment_cwd_argv_and_exit_code(tmp_path, node, raylets):
    first = raylets(tmp_path, node, {"X": "one", "CODE": "3"}, "--flag", "a b")
    seen = first.worker()
    assert first.wrapper_code() == 3, "the wrapper ends with its worker's code"
    assert seen["preloaded"] and seen["pid"] != first.wrapper, "forked from the server, not run in the wrapper"
    assert seen["frozen"] > 1000, "the server froze its imports' objects before it forked (freeze_heap)"
    assert "--serve" in _cmdline(seen["ppid"])
    assert seen["x"] == "one" and seen["cwd"] == str(tmp_path)
    assert seen["argv"] == [str(tmp_path / "worker.py"), f"--node-id={node}", f"--temp-dir={tmp_path}",
                            "--session-name=s", "--flag", "a b"]
    assert "imported colorsys" in (tmp_path / "s" / "logs" / "forkserver.log").read_text()


@pytest.mark.isolated
def test_the_server_is_shared_per_node_and_per_thread_settings_and_ends_with_its_raylet(tmp_path, node, raylets):
    a = raylets(tmp_path, node, {"X": "a"})
    server = a.worker()["ppid"]
    assert a.wrapper_code() == 0
    b = raylets(tmp_path, node, {"X": "b"})  # another raylet process on the same node id: same name
    assert b.worker()["ppid"] == server and b.wrapper_code() == 0
    c = raylets(tmp_path, node, {"OMP_NUM_THREADS": "3"})
    assert c.worker()["ppid"] != server, "other import-time thread settings: a server of their own"
    assert c.wrapper_code() == 0
    c.end()
    b.end()
    a.end()  # the raylet the server watches (the first one's)
    assert _gone(server), "the server outlived its raylet"


@pytest.mark.isolated
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_wrapper_reaches_the_worker_and_ends_both_the_same_way(tmp_path, node, sig, raylets):
    fake = raylets(tmp_path, node, {}, "sleep")
    child = fake.worker()["pid"]
    os.kill(fake.wrapper, sig)
    assert fake.wrapper_code() == -sig
    assert _gone(child)


@pytest.mark.isolated
def test_a_killed_wrapper_takes_its_worker_with_it(tmp_path, node, raylets):
    fake = raylets(tmp_path, node, {}, "sleep")
    child = fake.worker()["pid"]
    os.kill(fake.wrapper, signal.SIGKILL)
    assert fake.wrapper_code() == -signal.SIGKILL
    assert _gone(child, 5.0), "the worker outlived its wrapper"


@pytest.mark.isolated
def test_a_worker_killed_by_pid_ends_its_wrapper_with_the_same_signal(tmp_path, node, raylets):
    fake = raylets(tmp_path, node, {}, "sleep")  # as the raylet kills a worker: by the pid it registered
    os.kill(fake.worker()["pid"], signal.SIGKILL)
    assert fake.wrapper_code() == -signal.SIGKILL


@pytest.mark.isolated
def test_a_server_that_does_not_answer_leaves_the_worker_to_start_the_plain_way(tmp_path, node, raylets):
    env = {"ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys", "CODE": "4"}
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    squatter.bind(forkserver.server_name(node, {**os.environ, **env}))
    squatter.listen(4)
    fake = raylets(tmp_path, node, env)
    conn, _ = squatter.accept()
    conn.close()  # as a server that died before answering
    seen = fake.worker()
    assert seen["pid"] == fake.wrapper and not seen["preloaded"], "not exec'd in place of the wrapper"
    assert fake.wrapper_code() == 4
    squatter.close()


@pytest.mark.isolated
def test_a_wrapper_that_connects_and_never_asks_does_not_stall_the_server(tmp_path, node, raylets):
    request_s = 3.0  # the server's wait for a request, set by the environment it starts with (10 s by default)
    first = raylets(tmp_path, node, {forkserver.REQUEST_S_ENV: str(request_s)})
    server = first.worker()["ppid"]
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.connect(forkserver.server_name(node, {**os.environ, "ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys"}))
    t0 = time.monotonic()
    second = raylets(tmp_path, node, {"CODE": "6"})  # queued behind the silent one
    assert second.worker(timeout=request_s + 20)["ppid"] == server
    assert second.wrapper_code() == 6 and time.monotonic() - t0 >= request_s - 1
    silent.close()


@pytest.mark.isolated
def test_a_worker_gets_its_own_pythonpath_not_the_one_the_server_started_with(tmp_path, node, raylets):
    base = os.environ.get("PYTHONPATH", "")
    first = raylets(tmp_path, node, {"PYTHONPATH": os.pathsep.join(filter(None, [base, str(tmp_path / "a")]))})
    assert str(tmp_path / "a") in first.worker()["path"]  # this wrapper started the server: a is in its path
    second = raylets(tmp_path, node, {"PYTHONPATH": os.pathsep.join(filter(None, [base, str(tmp_path / "b")]))})
    path = second.worker()["path"]
    assert str(tmp_path / "b") in path and str(tmp_path / "a") not in path
    assert path[0] == str(tmp_path), "the script's folder first, as in a fresh interpreter"


@pytest.mark.isolated
def test_a_prestarted_server_serves_the_first_worker(tmp_path, node, raylets):
    """What the driver of a Ray of its own does as it starts Ray (provision.prestart_fork_servers): the server is
    up before any worker asks, and a worker with the same thread settings is forked from it."""
    env = {"ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys", "OMP_NUM_THREADS": "2"}
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the raylet it watches
    try:
        started = forkserver.prestart(node, sleeper.pid, [env, dict(env), {**env, "OTHER": "x"}])
        assert len(started) == 1
        seen = raylets(tmp_path, node, env).worker()
        assert seen["ppid"] == started[0], "forked by the server prestart started"
        assert seen["preloaded"] and "--serve" in _cmdline(seen["ppid"])
        assert f" {sleeper.pid}" in _cmdline(seen["ppid"]), "the prestarted server, not one the wrapper started"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _gone(seen["ppid"]), "the prestarted server outlived the process it watched"


@pytest.mark.isolated
def test_a_server_started_before_ray_is_named_later_and_serves(tmp_path, node, raylets):
    """What a driver that starts its own Ray does first thing (cluster.start_early_fork_servers): the server
    imports before the node id exists, is named once Ray is up, and serves the wrappers of that node."""
    env = {"ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys", "OMP_NUM_THREADS": "2"}
    other = {**env, "OMP_NUM_THREADS": "3"}  # a setting no role asks for in the end
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the raylet it watches
    early = forkserver.EarlyServers([env, dict(env), other])
    try:
        assert len(early.servers) == 2
        unused = early.servers[forkserver.server_name("", {**os.environ, **other})]
        assert early.bind(node, sleeper.pid, [env, {**env, "OMP_NUM_THREADS": "4"}]) == [
            {**env, "OMP_NUM_THREADS": "4"}], "a setting no early server stands for is left to prestart"
        assert unused.wait(timeout=10) == 0, "an early server no role asked for outlived its driver's close"
        assert forkserver._listening(forkserver.server_name(node, {**os.environ, **env}))
        seen = raylets(tmp_path, node, env).worker()
        assert seen["preloaded"] and "--early" in _cmdline(seen["ppid"]), "not forked from the early server"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _gone(seen["ppid"]), "the early server outlived the raylet it was told of"


@pytest.mark.isolated
def test_an_early_server_never_named_ends_with_its_driver():
    """A driver whose Ray did not start closes the servers' stdin (or dies): they end, mid-import or not."""
    early = forkserver.EarlyServers([{"ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys"}])
    (proc,) = early.servers.values()
    early.close()
    assert proc.wait(timeout=10) == 0


@pytest.mark.isolated
def test_a_server_whose_preloads_load_ray_refuses_and_every_worker_starts_plain(tmp_path, node, raylets):
    env = {"ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys,ray._raylet"}
    for code in ("7", "8"):  # the second finds the same (refusing) server instead of starting another
        fake = raylets(tmp_path, node, {**env, "CODE": code})
        seen = fake.worker()
        assert seen["pid"] == fake.wrapper and not seen["preloaded"], "forked from a server that loaded Ray"
        assert fake.wrapper_code() == int(code)
    log = (tmp_path / "s" / "logs" / "forkserver.log").read_text()
    assert log.count("not forking") == 1, log


@pytest.mark.isolated
def test_an_optional_preload_that_does_not_exist_is_skipped(tmp_path, node, raylets):
    """``PRELOAD`` names a vLLM module that moves between releases: where it is missing the server still forks."""
    env = {"ASYNC_RLHF_FORKSERVER_PRELOAD": "colorsys,colorsys.no_such_module?,json.no_such_module?"}
    fake = raylets(tmp_path, node, env)
    seen = fake.worker()
    assert seen["preloaded"] and seen["pid"] != fake.wrapper, "not forked from the server"
    log = (tmp_path / "s" / "logs" / "forkserver.log").read_text()
    assert log.count("not preloaded") == 2 and "imported colorsys in" in log, log


@pytest.mark.isolated
def test_without_a_raylet_parent_the_worker_starts_the_plain_way(tmp_path, node, raylets):
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "async_rlhf.startup.forkserver", str(tmp_path / "worker.py"),
                           f"--node-id={node}"], env={**os.environ, "OUT": str(out), "CODE": "5"}, timeout=60)
    seen = json.loads(out.read_text())
    assert proc.returncode == 5 and not seen["preloaded"] and seen["ppid"] == os.getpid()


def test_ray_actors_start_forked_from_the_preloaded_server(ray_address):
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def __init__(self) -> None:
            self.preloaded = all(m in sys.modules for m in ("vllm", "deepspeed", "vllm.v1.worker.cpu_model_runner"))

        def facts(self) -> dict:
            import numpy as np
            import torch

            return {"pid": os.getpid(), "ppid": os.getppid(), "preloaded": self.preloaded,
                    "threads": torch.get_num_threads(), "x": os.environ.get("X"), "draw": float(np.random.rand())}

    env = {"py_executable": forkserver.command(), "env_vars": {"OMP_NUM_THREADS": "1", "X": "y"}}
    actors = [Probe.options(runtime_env=env).remote() for _ in range(2)]
    facts = ray.get([a.facts.remote() for a in actors], timeout=300)
    assert all(f["preloaded"] and f["threads"] == 1 and f["x"] == "y" for f in facts)
    assert facts[0]["ppid"] == facts[1]["ppid"] and "--serve" in _cmdline(facts[0]["ppid"])
    assert facts[0]["draw"] != facts[1]["draw"], "numpy's global generator is reseeded in each child"
    for actor, f in zip(actors, facts):
        ray.kill(actor)
        assert _gone(f["pid"], 30.0), "ray.kill did not end the forked worker"
    assert not _gone(facts[0]["ppid"], 0.5), "the server serves the next worker of this Ray"


JOB = textwrap.dedent('''
    import json, os, sys, ray
    from async_rlhf.startup.forkserver import command
    ray.init(address=sys.argv[1])

    @ray.remote(num_cpus=0)
    class Probe:
        def ids(self):
            return os.getppid(), ray.get_runtime_context().get_job_id()

    env = {"py_executable": command(), "env_vars": {"OMP_NUM_THREADS": "1"}}
    server, job = ray.get(Probe.options(runtime_env=env).remote().ids.remote(), timeout=120)
    print(json.dumps({"server": server, "worker_job": job, "job": ray.get_runtime_context().get_job_id()}))
''')


def test_jobs_after_the_one_that_started_the_server_get_workers_of_their_own_job(ray_address, tmp_path):
    """Two drivers one after the other on the shared Ray: each one's forked worker belongs to its own job (a
    server that had loaded Ray's core library gave the second job's workers the first job's id, and the raylet
    ended them at once as workers of a finished job)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    seen = []
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script), ray_address], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    a, b = seen
    assert a["worker_job"] == a["job"] and b["worker_job"] == b["job"] and a["job"] != b["job"]
    assert a["server"] == b["server"] and "--serve" in _cmdline(a["server"]), "both forked from one server"
