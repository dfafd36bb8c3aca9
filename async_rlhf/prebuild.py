"""Build, at install time, everything a run would otherwise compile or derive during its start-up.

    python -m async_rlhf.prebuild          (``make setup`` runs it; so does the gpu extra's install)

What a first run used to build inside its start-up, on the cores the roles were starting on:

    DeepSpeed's shm_comm op   C++ JIT-built with ninja/gcc the first time a learner rank initialises
                              DeepSpeed on CPU, into $TORCH_EXTENSIONS_DIR/deepspeed_shm_comm (default
                              ~/.cache/torch_extensions/py311_cpu/...): 1 min on a quiet 2-core machine, 4 min
                              beside starting vLLM engines, long enough to miss the rendezvous deadline
    vLLM's model info         vLLM inspects a model class in a fresh Python subprocess (a full vllm import)
                              once per architecture and caches it in $VLLM_CACHE_ROOT/modelinfos
    matplotlib's font list    built on first import into $MPLCONFIGDIR (plots at the end of a run)
    the tiny policy           with ``--tiny-policy DIR``: what a run given no model starts from (the demo's),
                              the tiny Qwen2 and its SFT warm start, cached in DIR (the launcher's runs/cache
                              when run from the same directory): ~50 s on 2 cores, inside a first run's start
                              (and the tiny tool policy of ``agent.task=calculator``, async_rlhf/tiny/tool_sft.py:
                              ~60 s more)

Triton writes nothing on CPU (vLLM disables it without its CPU backend), and vLLM's eager engine compiles
nothing (generator.enforce_eager=auto is on for the CPU engine, and the generator forces the torch.compile its
sampler still asked for to run eagerly: ``engine_args.eager_compile_stance``). A learner rank still finding an op
unbuilt builds it, and says so on the start-up progress line (phase ``building op shm_comm``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""The tiny models' architectures (async_rlhf/tiny): their vLLM model info is derived ahead."""


def shm_op_builder() -> Any | None:
    """DeepSpeed's shared-memory communication op builder for this accelerator, or None where DeepSpeed
    would not load one (the same test as ``deepspeed.comm.torch.build_shm_op``)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def op_dir(name: str) -> Path:
    """Where torch's JIT puts extension ``name`` ($TORCH_EXTENSIONS_DIR/name, else the per-user cache)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def op_is_built(builder: Any) -> bool:
    """Whether loading the op needs no compiler: installed prebuilt, or its JIT library is there and newer
    than its sources (torch's ninja build would do nothing)."""
    from deepspeed.git_version_info import installed_ops

    if installed_ops.get(builder.NAME, False):
        return True
    lib = op_dir(builder.NAME) / f"{builder.NAME}.so"
    if not lib.is_file():
        return False
    sources = [Path(builder.deepspeed_src_path(s)) for s in builder.sources()]
    newest = max((s.stat().st_mtime for s in sources if s.exists()), default=0.0)
    return lib.stat().st_mtime >= newest


def load_ops(report: Callable[[str, str], None] | None = None) -> dict[str, bool]:
    """Load (building if needed) every op DeepSpeed's communication backend will load, before it does, so the
    build is a phase of its own: ``report(phase, detail)`` is told ``("op build", "shm_comm")`` when a compiler
    is about to run, ``("op load", "shm_comm")`` otherwise. Returns ``{op name: built now}``."""
    builder = shm_op_builder()
    if builder is None:
        return {}
    built = op_is_built(builder)
    if report is not None:
        report("op load" if built else "op build", "shm_comm")
    t0 = time.perf_counter()
    module = builder.load(verbose=False)  # DeepSpeed's later build_shm_op() finds it loaded (its _loaded_ops)
    quiet_shm_op(module)
    logging.getLogger(__name__).info("DeepSpeed %s %s in %.1f s", builder.NAME, "loaded (built earlier)" if built
                                     else "built and loaded", time.perf_counter() - t0)
    return {builder.NAME: not built}


def quiet_shm_op(module: Any) -> None:
    """Have DeepSpeed's communication backend take the op :func:`load_ops` loaded without its own line: its
    ``build_shm_op`` prints "DeepSpeed ... built successfully" on every load, a cached one included (what was
    built and when is said by :func:`load_ops` and the start-up phase it reports)."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # (``import ... as`` would bind deepspeed.comm's torch)
    if callable(getattr(ds_torch, "build_shm_op", None)):
        ds_torch.build_shm_op = lambda: module


def warm_vllm_model_info(architectures: tuple[str, ...] = ARCHITECTURES) -> list[str]:
    """Derive vLLM's cached model info of these architectures now (each a subprocess importing vLLM);
    returns those it derived or found cached."""
    from vllm.model_executor.models.registry import ModelRegistry

    done = []
    for arch in architectures:
        model = ModelRegistry.models.get(arch)
        if model is not None:
            model.inspect_model_cls()
            done.append(arch)
    return done


def warm_matplotlib() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401  builds the font list cache on first import


NO_VLLM = 3
"""The ``--vllm-model-info`` child's exit code when vLLM is not installed."""


def model_info_line(code: int, out: str, err: str) -> str:
    """The line :func:`main` prints for the model info the child derived (exit ``code``, its output ``out`` and
    ``err``), or why it derived none."""
    if code == 0:
        archs = json.loads(out.strip().splitlines()[-1])
        where = os.environ.get("VLLM_CACHE_ROOT") or "~/.cache/vllm"
        return f"prebuild: vLLM model info of {', '.join(archs)} in {where}"
    if code == NO_VLLM:  # an install without vLLM (never a CPU or GPU extra)
        return "prebuild: vLLM is not installed; no model info derived"
    # vLLM's registry is not a public API: a first run derives it instead
    last = (err.strip().splitlines() or ["(no output)"])[-1]
    return (f"prebuild: warning: vLLM's model info not derived ({last}); the first run derives it during its "
            "start-up")


@contextlib.contextmanager
def model_info_beside() -> Iterator[Callable[[], str]]:
    """:func:`warm_vllm_model_info` in a child process (``--vllm-model-info``) while the block builds the op: both
    take 20-25 s on 2 cores, the compile leaves a core idle at times and vLLM's inspection is one process per
    architecture. A child, not a thread: the two never share an import. Yields a call that waits for the child
    and returns its :func:`model_info_line`. Its output goes to files (a pipe nobody reads during the compile
    would stall a child that logs more than the pipe holds); it is killed if the block raises."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "async_rlhf.prebuild", "--vllm-model-info"], stdout=out,
                                 stderr=err, text=True)

        def line() -> str:
            code = child.wait()
            out.seek(0)
            err.seek(0)
            return model_info_line(code, out.read(), err.read())

        try:
            yield line
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def build_tiny_policy(cache_root: Path) -> str:
    """The policy a run given no model starts from, built into ``cache_root`` as the launcher would (nothing
    when it is there already); the line prebuild prints of it."""
    from async_rlhf.config import Config
    from async_rlhf.policy_source import resolve_model

    t0 = time.perf_counter()
    path = resolve_model(Config(), cache_root)
    return f"prebuild: the tiny policy a run given no model starts from in {path} ({time.perf_counter() - t0:.0f} s)"


def build_tool_policy(cache_root: Path) -> str:
    """The tiny tool policy of ``agent.task=calculator`` (async_rlhf/tiny/tool_sft.py), built into ``cache_root``
    as the launcher would; the line prebuild prints of it."""
    from async_rlhf.config import Config
    from async_rlhf.policy_source import resolve_model

    cfg = Config()
    cfg.task.name, cfg.agent.task = "agent", "calculator"
    t0 = time.perf_counter()
    path = resolve_model(cfg, cache_root)
    return f"prebuild: the tiny tool policy of agent.task=calculator in {path} ({time.perf_counter() - t0:.0f} s)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--vllm-model-info"]:
        try:
            print(json.dumps(warm_vllm_model_info()))
        except ImportError:
            return NO_VLLM
        return 0
    tiny_root = None
    if argv[:1] == ["--tiny-policy"] and len(argv) == 2:
        tiny_root = Path(argv[1])
    elif argv:
        print(f"usage: python -m async_rlhf.prebuild [--tiny-policy DIR] (got {' '.join(argv)})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with model_info_beside() as model_info:
        builder = shm_op_builder()
        if builder is None:
            print("prebuild: DeepSpeed loads no shared-memory op on this accelerator")
        else:
            fresh = load_ops()[builder.NAME]
            print(f"prebuild: DeepSpeed {builder.NAME} {'built' if fresh else 'already built'} in "
                  f"{op_dir(builder.NAME)}")
        print(model_info())
    warm_matplotlib()
    if tiny_root is not None:
        print(build_tiny_policy(tiny_root), flush=True)
        print(build_tool_policy(tiny_root), flush=True)
    print(f"prebuild: done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
