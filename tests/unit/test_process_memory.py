"""Peak resident memory of a process and its children (async_rlhf/process_memory.py), read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from async_rlhf.process_memory import (
    descendants,
    machine_used_mb,
    meminfo_used_mb,
    peak_rss_mb,
    pss_mb,
    pss_split_mb,
    rollup_kb,
    status_int,
)

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


ROLLUP = ("55d0c0a00000-7ffd1f3fe000 ---p 00000000 00:00 0                          [rollup]\nRss:  300 kB\n"
          "Pss:  120 kB\nPss_Dirty:  80 kB\nPss_Anon:  70 kB\nPss_File:  50 kB\nPss_Shmem:  0 kB\n")


def test_pss_and_machine_used_are_read_from_proc() -> None:
    assert (rollup_kb(ROLLUP), rollup_kb(ROLLUP, "Pss_Anon"), rollup_kb(ROLLUP, "Pss_File")) == (120, 70, 50)
    assert rollup_kb("", "Pss") == 0
    assert meminfo_used_mb("MemTotal:  1000000 kB\nMemFree:  100 kB\nMemAvailable:  400000 kB\n") == 600000 * 1024 / 1e6
    assert 0 < machine_used_mb() < meminfo_used_mb(Path("/proc/meminfo").read_text()) + 1e4


def test_pages_a_forked_child_shares_count_half_in_each_pss() -> None:
    """A child forked from a process holding 80 MB it never writes: each holds them resident (RSS), each's PSS has
    half of them, and the child's own PSS grows by the whole when it writes them (copied on write)."""
    child = subprocess.Popen([sys.executable, "-c", "import os, sys, time\nx = bytearray(80_000_000)\n"
                              "x[::4096] = b'1' * len(x[::4096])\npid = os.fork()\n"
                              "if pid == 0:\n    print(os.getpid(), flush=True); sys.stdin.readline()\n"
                              "    x[::4096] = b'2' * len(x[::4096]); print('w', flush=True); time.sleep(30)\n"
                              "else:\n    time.sleep(30)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    forked = 0
    try:
        forked = int(child.stdout.readline())
        parent, kid = pss_split_mb(child.pid), pss_split_mb(forked)
        assert 38 <= parent["anon"] <= 55 and 38 <= kid["anon"] <= 55, (parent, kid)  # 40 MB each, + the rest
        assert status_int(Path(f"/proc/{forked}/status").read_text(), "VmRSS") * 1024 / 1e6 >= 80
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "w"
        assert pss_mb(forked) >= 80 and pss_split_mb(child.pid)["anon"] >= 80
    finally:
        child.kill()
        child.wait()
        if forked:
            os.kill(forked, signal.SIGKILL)
    assert pss_mb(child.pid) == 0.0 and pss_split_mb(child.pid) == {"pss": 0.0, "anon": 0.0, "file": 0.0,
                                                                     "shmem": 0.0}
