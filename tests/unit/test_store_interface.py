"""The buffer's store boundary: one protocol, two stores, a factory in build.py, no import cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from async_rlhf.buffer.build import make_store
from async_rlhf.buffer.store import MemoryStore, Store

UNIT_DIR = Path(__file__).parent
SERVER_MARKS = ("import ray", "from ray", "import vllm", "from vllm", "RedisServer", "BufferService", "import zmq",
                "init_distributed", "init_process_group", "TCPStore", "host_store(")


def protocol_members() -> set[str]:
    methods = {n for n, v in vars(Store).items() if callable(v) and (not n.startswith("_") or n == "__len__")}
    return methods | set(Store.__annotations__)


def test_both_stores_provide_every_member_of_the_protocol() -> None:
    from async_rlhf.buffer.redis_store import RedisStore

    members = protocol_members()
    assert {"put_many", "deliver", "ack", "drop", "held", "durable"} <= members
    assert isinstance(MemoryStore(), Store)
    for cls in (MemoryStore, RedisStore):
        missing = sorted(m for m in members if m not in {"durable", "name"} and not callable(getattr(cls, m, None)))
        assert not missing, f"{cls.__name__} lacks {missing}"
    assert (MemoryStore.durable, RedisStore.durable) == (False, True)


def test_the_factory_picks_the_store_and_names_the_fix_for_an_unknown_one() -> None:
    assert isinstance(make_store("memory"), MemoryStore)
    with pytest.raises(ValueError, match="use buffer.store=memory or buffer.store=redis"):
        make_store("sqlite")


def test_the_store_module_does_not_import_the_redis_store() -> None:
    code = ("import sys; import async_rlhf.buffer.store; "
            "print(sorted(m for m in sys.modules if m == 'redis' or m.endswith('redis_store')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unit_tests_start_no_server_process_group_or_engine() -> None:
    offenders = {p.name: [m for m in SERVER_MARKS if m in p.read_text()] for p in UNIT_DIR.glob("test_*.py")
                 if p.name != Path(__file__).name}
    assert {k: v for k, v in offenders.items() if v} == {}, "move these to tests/integration or tests/distributed"
