"""Peak resident memory of a process and its children (async_rlhf/process_memory.py), read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from async_rlhf.process_memory import descendants, peak_rss_mb, status_int

STATUS = "Name:\tpython\nPPid:\t41\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n"


def test_status_fields_are_read_as_integers() -> None:
    assert status_int(STATUS, "VmHWM") == 204800 and status_int(STATUS, "PPid") == 41
    assert status_int(STATUS, "VmSwap") == 0 and status_int("", "VmHWM") == 0


def test_the_peak_counts_this_process_and_a_child_holding_memory() -> None:
    alone = peak_rss_mb()
    rss_now = status_int(Path("/proc/self/status").read_text(), "VmRSS") * 1024 / 1e6
    assert alone["self_mb"] >= rss_now - 0.1 > 0
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; x = bytearray(80_000_000); x[::4096] = "
                              "b'1' * len(x[::4096]); print(1, flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"  # its memory is touched
        assert child.pid in descendants(os.getpid())
        both = peak_rss_mb()
        assert both["processes"] >= 2 and both["children_mb"] >= 80
        assert both["total_mb"] == round(both["self_mb"] + both["children_mb"], 1)
        assert peak_rss_mb(child.pid)["self_mb"] >= 80
    finally:
        child.kill()
        child.wait()
    time.sleep(0.05)
    assert child.pid not in descendants(os.getpid())
