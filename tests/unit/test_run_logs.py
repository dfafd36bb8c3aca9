"""Where output goes (async_rlhf/run_logs.py), in child processes: a role's fd 1 and 2 land in its log (C-level writes
and a child process's output included), verbose also where they went; the launcher's console keeps its own lines
and our loggers' warnings, and driver.log gets the rest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_child(code: str, tmp_path: Path, verbose: bool = False,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    prelude = f"""
        import sys, types
        sys.path.insert(0, {str(ROOT)!r})
        cfg = types.SimpleNamespace(run=types.SimpleNamespace(dir={str(tmp_path / 'run')!r}, verbose={verbose}))
    """
    child_env = {k: v for k, v in os.environ.items() if k != "ASYNC_RLHF_VERBOSE"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**child_env, **(env or {})})


ROLE = """
    import os, subprocess
    from async_rlhf.run_logs import to_role_log
    print("before", flush=True)
    path = to_role_log(cfg, "generator-3")
    print("python stdout", flush=True)
    print("python stderr", file=sys.stderr, flush=True)
    os.write(2, b"fd 2 write\\n")
    subprocess.run(["echo", "child process"])
    print(path)
"""


def test_a_role_writes_everything_to_its_log_and_nothing_to_where_it_was(tmp_path: Path) -> None:
    res = run_child(ROLE, tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "before\n" and res.stderr == ""
    log = (tmp_path / "run" / "logs" / "generator-3.log").read_text()
    assert log.startswith("== ") and "generator-3 (pid " in log.splitlines()[0]
    for line in ("python stdout", "python stderr", "fd 2 write", "child process", str(tmp_path / "run" / "logs")):
        assert line in log, log


def test_verbose_keeps_the_output_where_it_went_and_writes_the_log(tmp_path: Path) -> None:
    for env in ({"ASYNC_RLHF_VERBOSE": "1"}, None):
        res = run_child(ROLE, tmp_path, verbose=env is None, env=env)  # the variable or the key
        assert res.returncode == 0, res.stderr
        shown = res.stdout + res.stderr
        for line in ("python stdout", "python stderr", "fd 2 write", "child process"):
            assert line in shown, shown
    log = (tmp_path / "run" / "logs" / "generator-3.log").read_text()
    assert log.count("fd 2 write") == 2 and log.count("== ") == 2, log  # appended by the second start


DRIVER = """
    import logging, os, warnings
    from async_rlhf.run_logs import console_stderr, quiet_driver
    logging.basicConfig(level=logging.WARNING)
    quiet_driver(cfg)
    print("progress line", flush=True)
    logging.getLogger("async_rlhf.driver.cluster").warning("our warning")
    logging.getLogger("ray").warning("a library's notice")
    warnings.warn("a FutureWarning", FutureWarning)
    print("a progress bar", file=sys.stderr, flush=True)
    os.write(1, b"fd 1 write\\n")
    exec("print('a library print')", {"__name__": "somelib"})
    bound = logging.getLogger("DeepSpeed")  # a library's handler bound to sys.stdout after the switch
    bound.addHandler(logging.StreamHandler(sys.stdout))
    bound.propagate = False
    bound.warning("Setting accelerator to CPU")
    print("error: ours", file=console_stderr(), flush=True)
    import builtins  # Ray's driver replaces print by tqdm_ray's safe_print once it shows a worker's error
    wrapper = {"__name__": "ray.experimental.tqdm_ray", "_print": builtins.print}
    exec("def safe_print(*args, **kwargs):\\n    _print(*args, **kwargs)", wrapper)
    builtins.print = wrapper["safe_print"]
    print("after a worker died", flush=True)
    exec("print('a library print through the wrapper')", {"__name__": "somelib"})
    # wandb.init (run.report_to=wandb) patches sys.stdout.write, even with console capture off
    capture = {"__name__": "wandb.sdk.lib.console_capture", "sys": sys}
    exec("_write = sys.stdout.write\\ndef write_with_callbacks(s):\\n    return _write(s)\\n"
         "sys.stdout.write = write_with_callbacks", capture)
    print("after a tracker patched stdout", flush=True)
    exec("print('a library print through the patched stdout')", {"__name__": "somelib"})
"""


def test_the_launcher_console_keeps_only_our_lines(tmp_path: Path) -> None:
    res = run_child(DRIVER, tmp_path)
    assert res.returncode == 0, res.stderr
    logs = tmp_path / "run" / "logs"
    assert res.stdout.splitlines() == [f"logs: {logs} (each role's output; run.verbose=true or "
                                       "ASYNC_RLHF_VERBOSE=1 shows it here)", "progress line",
                                       "after a worker died", "after a tracker patched stdout"]
    assert res.stderr.splitlines()[0].endswith("WARNING async_rlhf.driver.cluster: our warning")
    assert res.stderr.splitlines()[1:] == ["error: ours"]
    driver = (logs / "driver.log").read_text()
    for line in ("our warning", "a library's notice", "a FutureWarning", "a progress bar", "fd 1 write",
                 "a library print", "Setting accelerator to CPU", "a library print through the wrapper",
                 "a library print through the patched stdout"):
        assert line in driver, driver
    assert "progress line" not in driver and "error: ours" not in driver


def test_a_verbose_launcher_keeps_its_streams(tmp_path: Path) -> None:
    res = run_child(DRIVER, tmp_path, env={"ASYNC_RLHF_VERBOSE": "1"})
    assert res.returncode == 0, res.stderr
    shown = res.stdout + res.stderr
    for line in ("progress line", "our warning", "a library's notice", "a FutureWarning", "fd 1 write"):
        assert line in shown, shown
    assert not (tmp_path / "run" / "logs" / "driver.log").exists()
