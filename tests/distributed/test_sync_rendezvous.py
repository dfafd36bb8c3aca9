"""The NCCL push group's set-up is bounded (sync/rendezvous.py): a member that never joins is named within the
deadline instead of leaving every other rank in ncclCommInitRank for good. On CPU: a real TCPStore and vLLM's
real StatelessProcessGroup; only the NCCL communicator itself is a stand-in (it blocks until every rank called
it, as ncclCommInitRank does)."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from async_rlhf.sync.group import free_port
from async_rlhf.sync.rendezvous import RendezvousTimeout, arrival_barrier, call_by
from async_rlhf.sync.transport import NcclTransport

NAMES = ["the sender", "gen0", "gen1"]


def store_pair():
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    return host, lambda: dist.TCPStore("127.0.0.1", port, None, False, wait_for_workers=False)


def run_ranks(ranks, fn) -> dict[int, object]:
    """``fn(rank)`` on one thread per rank; per rank its result or the exception it raised."""
    out: dict[int, object] = {}

    def one(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in ranks]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return out


def test_the_barrier_names_the_member_that_never_arrived() -> None:
    host, client = store_pair()
    got = run_ranks([0, 1], lambda r: arrival_barrier(host if r == 0 else client(), r, 3, time.monotonic() + 0.5,
                                                      NAMES))
    for r in (0, 1):
        assert isinstance(got[r], RendezvousTimeout), got[r]
        assert got[r].ranks == [2] and "gen1 (rank 2) never joined" in str(got[r])


def test_the_barrier_passes_once_every_rank_arrived() -> None:
    host, client = store_pair()
    got = run_ranks([0, 1, 2], lambda r: arrival_barrier(host if r == 0 else client(), r, 3, time.monotonic() + 20))
    assert got == {0: None, 1: None, 2: None}


def test_call_by_returns_raises_or_gives_up_at_the_deadline() -> None:
    assert call_by(lambda: 7, time.monotonic() + 5, "a call") == 7
    with pytest.raises(ValueError, match="bad"):
        call_by(lambda: (_ for _ in ()).throw(ValueError("bad")), time.monotonic() + 5, "a call")
    never = threading.Event()
    with pytest.raises(RendezvousTimeout, match="the NCCL communicator of rank 1.*did not finish by its deadline"):
        call_by(never.wait, time.monotonic() + 0.2, "the NCCL communicator of rank 1")
    never.set()


class StandInNccl(NcclTransport):
    """The NCCL transport with vLLM's real StatelessProcessGroup; the communicator is a stand-in that shares a
    unique id through it and then blocks until ``world`` ranks built one (ncclCommInitRank's behaviour)."""

    def __init__(self, joined: threading.Barrier) -> None:
        super().__init__("cuda:0")  # a device name only: nothing is allocated
        self.joined = joined

    def _communicator(self, store, rank, world):
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup(rank=rank, world_size=world, store=store)
        uid = pg.broadcast_obj(f"uid-{id(self.joined)}" if rank == 0 else None, src=0)
        self.joined.wait()  # raises BrokenBarrierError if aborted
        return uid


def test_nccl_open_names_a_member_that_never_joins_and_forms_when_all_do() -> None:
    host, client = store_pair()
    joined = threading.Barrier(3)
    stores = {0: host, 1: client(), 2: client()}

    def open_rank(r: int):
        return StandInNccl(joined).open(dist.PrefixStore("epoch0", stores[r]), r, 3, 0.5, NAMES)

    got = run_ranks([0, 1], open_rank)  # gen1 never comes
    for r in (0, 1):
        assert isinstance(got[r], RendezvousTimeout) and got[r].ranks == [2], got[r]
        assert "gen1 (rank 2)" in str(got[r])

    joined = threading.Barrier(3)
    got = run_ranks([0, 1, 2], lambda r: StandInNccl(joined).open(dist.PrefixStore("epoch1", stores[r]), r, 3,
                                                                  20.0, NAMES))
    assert len({got[r] for r in range(3)}) == 1 and str(got[0]).startswith("uid-"), got


def test_nccl_open_gives_up_when_a_member_dies_after_arriving() -> None:
    host, client = store_pair()
    joined = threading.Barrier(3)  # rank 2 arrives but never builds its communicator
    client().set("epoch0/arrived/2", "1")
    got = run_ranks([0, 1], lambda r: StandInNccl(joined).open(dist.PrefixStore("epoch0", host if r == 0 else client()),
                                                               r, 3, 0.5, NAMES))
    joined.abort()  # release the stand-ins left blocked
    for r in (0, 1):
        assert isinstance(got[r], RendezvousTimeout) and "did not finish by its deadline" in str(got[r]), got[r]
