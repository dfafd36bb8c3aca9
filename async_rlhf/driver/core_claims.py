"""Cores a run pinned its roles to, claimed on this host, so that a second run does not pin onto the same cores.

The auto CPU plan (cpu_plan.py) splits the cores as if the run had the host to itself. Two runs on one host (two
experiments on a workstation, the test suite's two workers) would each pin their generators to the same cores and
leave the others to learners waiting for data: two 1 + 1 jobs of 60 steps side by side on 2 cores took 101 s each
pinned, 70 s each unpinned (measured). So a run that pins claims its cores, and a run whose auto plan would pin
onto cores another live run claimed runs its roles unpinned instead (every core of the plan, default priority),
and says so (``run.pin=always`` pins anyway).

    CLAIM_DIR/<pid>-<n>.json   {"pid": ..., "cores": [...], "run_dir": ...}
        written under a temporary name, locked (flock) and renamed into place: a claim is live while its
        file is locked, i.e. while the run's driver holds it open; it ends with ``release()`` (Cluster.close)
        or with the process. A reader that can lock a claim finds it stale and removes it.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from async_rlhf.driver.cpu_plan import CpuPlan, unpinned

CLAIM_DIR_ENV = "ASYNC_RLHF_CORE_CLAIMS"
"""A directory of claims other than the default (tests; hosts without /dev/shm)."""
_serial = itertools.count()


def claim_dir() -> Path:
    default = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(os.environ.get(CLAIM_DIR_ENV) or default / "async_rlhf_core_claims")


@dataclass
class CoreClaim:
    path: Path
    fd: int
    cores: tuple[int, ...]

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)  # closing the last descriptor drops the lock
            self.fd = -1


def claim(cores: tuple[int, ...], run_dir: str = "") -> CoreClaim:
    """Claim ``cores`` for as long as this process holds the returned claim (or lives)."""
    where = claim_dir()
    if not where.is_dir():
        where.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(where, 0o1777)  # every user's runs claim here (sticky: each removes only its own)
        except OSError:
            pass
    final = where / f"{os.getpid()}-{next(_serial)}.json"
    fd, tmp = tempfile.mkstemp(dir=where, prefix=".claim-")
    os.fchmod(fd, 0o644)  # other users' runs read it
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "cores": list(cores), "run_dir": run_dir}).encode())
    os.replace(tmp, final)
    return CoreClaim(final, fd, tuple(cores))


def live_claims() -> list[dict[str, Any]]:
    """The live claims on this host (``{"pid", "cores", "run_dir"}`` each); stale claims are removed."""
    where = claim_dir()
    out: list[dict[str, Any]] = []
    for path in sorted(where.glob("*.json")) if where.is_dir() else []:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # released meanwhile, or not readable
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: a live run's
                try:
                    entry = json.loads(path.read_text())
                    out.append({**entry, "cores": tuple(entry["cores"])})
                except (OSError, ValueError, KeyError, TypeError):
                    pass  # released between the lock test and the read, or not ours
                continue
            try:
                path.unlink(missing_ok=True)  # nobody holds it: its run ended without releasing it
            except OSError:  # another user's, in the sticky directory: it stays, and counts for nothing
                pass
        finally:
            os.close(fd)
    return out


def claim_or_unpin(cfg: Any, plan: CpuPlan) -> tuple[CpuPlan, CoreClaim | None]:
    """For a plan of this host's cores: claim them, or, when the plan is the auto split, ``run.pin`` is auto and
    another live run claimed some of them, the unpinned plan instead (nothing claimed)."""
    auto = all(section.cpus.strip() == "auto" for section in (cfg.generator, cfg.learner, cfg.buffer))
    if auto and cfg.run.pin == "auto":
        others = [c for c in live_claims() if set(c["cores"]) & set(plan.available)]
        if others:
            taken = sorted({core for c in others for core in c["cores"]} & set(plan.available))
            runs = ", ".join(f"{c.get('run_dir') or '?'} (pid {c.get('pid')})" for c in others)
            return unpinned(plan, f"cores {taken} are pinned by another run on this host ({runs}; claims in "
                                  f"{claim_dir()}): this run's roles are not pinned, every core at default priority "
                                  "(two runs pinned onto the same cores leave others idle; run.pin=always pins "
                                  "anyway)"), None
    try:
        return plan, claim(plan.available, cfg.run.dir)
    except OSError as exc:  # a read-only or full claim directory: pinned as planned, just not claimed
        plan.warnings.append(f"the cores are pinned but not claimed ({exc}; set {CLAIM_DIR_ENV} to a writable "
                             "directory): another run on this host may pin onto them too")
        return plan, None
