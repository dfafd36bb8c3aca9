"""bench/buffer.py's measured window, without processes: it opens after the warm-up's deliveries, stays open
until the row counted what its precision needs, and a row that delivered nothing is an error naming it."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def bench(load_bench: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    module = load_bench("buffer.py")
    for name, value in {"WARMUP_S": 0.0, "SECONDS": 0.05, "PRECISION": 0.5, "MAX_SECONDS": 0.5}.items():
        monkeypatch.setattr(module, name, value)
    return module


def test_a_row_that_delivers_nothing_is_an_error_naming_it(bench: Any) -> None:
    window = bench.Window()
    with pytest.raises(RuntimeError, match=r"^redis 256 KB buffer \(warm-up\): measured 0 events"):
        bench.open_and_close(window, "redis 256 KB buffer", 1, [])
    assert window.closed()  # the row's processes stop


def test_the_window_stays_open_until_the_row_has_its_events(bench: Any) -> None:
    window = bench.Window()
    need = bench.needed_events(bench.PRECISION, 8)  # 32 events, 8 at a time

    def deliver() -> None:  # slow: 8 every 20 ms, so 0.05 s alone would count about 20
        while not window.closed():
            window.add(8)
            time.sleep(0.02)

    feeder = threading.Thread(target=deliver)
    feeder.start()
    events, seconds = bench.open_and_close(window, "memory 16 KB buffer", 8, [])
    feeder.join()
    assert events >= need and seconds > bench.SECONDS
    assert window.opened() and window.closed()


def test_the_target_reads_the_like_with_like_ratio_from_16_kb(bench: Any) -> None:
    rows = [{"store": "memory", "payload_bytes": 1024, "relay_ratio": 0.1},
            {"store": "redis", "payload_bytes": 16384, "relay_ratio": 0.6}]
    assert bench.check_target(rows) == (True, ["met: redis 16 KB buffer / relay 0.60"])
    holds, lines = bench.check_target([*rows, {"store": "memory-16p4c", "payload_bytes": 16384, "relay_ratio": 0.4}])
    assert not holds and lines[-1] == "MISSED: memory-16p4c 16 KB buffer / relay 0.40"
