"""Core lists as the config writes them (``0-3,6``, ``all``, ``auto``): parsed and checked here, below the
config that validates them and the driver's CPU plan (:mod:`async_rlhf.driver.cpu_plan`) that uses them."""

from __future__ import annotations

AUTO = "auto"
ALL = "all"


class CpuSpecError(ValueError):
    """A core list that cannot be used on this host; the message names the problem and the fix."""


def parse_cores(spec: str, available: tuple[int, ...], key: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6); ``all`` -> every available core. Every core must be available."""
    spec = spec.strip()
    if spec == ALL:
        return available
    cores: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise CpuSpecError(f"{key}={spec!r}: {part!r} is not a core id or range; write e.g. 0-3,6, "
                               f"'{AUTO}' or '{ALL}'") from None
        if first < 0 or last < first:
            raise CpuSpecError(f"{key}={spec!r}: range {part!r} is empty or negative; write low-high, e.g. 0-3")
        cores.update(range(first, last + 1))
    missing = sorted(cores - set(available))
    if missing:
        raise CpuSpecError(f"{key}={spec!r} names core(s) {missing} this process may not use; available here: "
                           f"{list(available)} (set {key} within them, or '{AUTO}')")
    return tuple(sorted(cores))


def check_spec(spec: str, key: str) -> None:
    """Syntax check at config load (the host's cores are checked when the plan is made)."""
    if spec.strip() not in (AUTO, ALL):
        parse_cores(spec, tuple(range(1 << 16)), key)
