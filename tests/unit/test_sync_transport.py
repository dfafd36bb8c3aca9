"""The weight transport interface: the factory, bad configuration, device checks before the backend, the
polled wait used on CUDA (no backend wait with a timeout)."""

import time

import pytest
import torch

from async_rlhf.config import ConfigError, load_config
from async_rlhf.sync.group import Aborted, SyncTimeout
from async_rlhf.sync.transport import (
    GlooTransport,
    NcclTransport,
    Transport,
    WrongDevice,
    make_transport,
    wait_polled,
)


class Recording(Transport):
    """A stand-in backend on ``device`` that records the device of every tensor it is handed."""

    name = "recording"
    survives_member_loss = True

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self.seen: list[tuple[str, torch.device]] = []

    def open(self, store, rank, world, timeout_s, names=None):
        return object()

    def _broadcast(self, group, tensor, root):
        self.seen.append(("broadcast", tensor.device))

    def _allreduce(self, group, tensor):
        self.seen.append(("allreduce", tensor.device))

    def wait(self, work, deadline, what, abort=None, slice_s=0.2):
        pass

    def retire(self, group, pending):
        pass


def test_factory_picks_the_backend_and_refuses_unknown_ones() -> None:
    t = make_transport("gloo")
    assert isinstance(t, GlooTransport) and t.device == torch.device("cpu") and t.survives_member_loss
    assert t.empty(16).device.type == "cpu" and t.int64s([3]).dtype == torch.int64
    with pytest.raises(ValueError, match="sync.backend='mpi'.*gloo \\(CPU\\) or nccl \\(GPU\\)"):
        make_transport("mpi")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where no CUDA device exists")
def test_nccl_without_cuda_is_refused_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match="needs a CUDA device.*sync.backend=gloo"):
        make_transport("nccl")
    assert not NcclTransport.survives_member_loss  # its contract: a failed push stops the run


def test_bad_backend_in_config_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="sync.backend"):
        load_config(None, ["sync.backend=mpi"])


def test_a_tensor_on_another_device_never_reaches_the_backend() -> None:
    t = Recording("meta")
    with pytest.raises(WrongDevice, match="on cpu for the recording push group on meta"):
        t.broadcast(None, torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(WrongDevice):
        t.allreduce(None, torch.zeros(1, dtype=torch.int64))
    assert t.seen == []
    t.broadcast(None, t.empty(4))
    t.allreduce(None, t.int64s([1]))
    assert t.seen == [("broadcast", torch.device("meta")), ("allreduce", torch.device("meta"))]


def test_polled_wait_completes_times_out_and_aborts() -> None:
    done_at = time.monotonic() + 0.05
    wait_polled(lambda: time.monotonic() >= done_at, time.monotonic() + 5, "op", None, 0.01, 0.001)
    with pytest.raises(SyncTimeout, match="op"):
        wait_polled(lambda: False, time.monotonic() + 0.05, "op", None, 0.01, 0.001)
    with pytest.raises(Aborted, match="member gen1 died"):
        wait_polled(lambda: False, time.monotonic() + 5, "op", lambda: "member gen1 died", 0.01, 0.001)


def test_push_timeouts_scale_with_bytes_and_receivers() -> None:
    from async_rlhf.config import push_min_gbps
    from async_rlhf.sync.group import push_timeout_s

    assert push_timeout_s(30.0, 2e9, 16, 0.0) == 30.0  # the CPU default: timeout_s alone, as always
    assert push_timeout_s(30.0, 2e9, 16, 1.0) == pytest.approx(30.0 + 32.0)
    assert push_timeout_s(30.0, 4e9, 16, 1.0) - 30.0 == pytest.approx(2 * (push_timeout_s(30.0, 2e9, 16, 1.0) - 30.0))
    assert push_timeout_s(30.0, 2e9, 8, 1.0) < push_timeout_s(30.0, 2e9, 16, 1.0)
    assert push_timeout_s(30.0, 2e9, 0, 1.0) == push_timeout_s(30.0, 2e9, 1, 1.0)  # a push always has a receiver
    with pytest.raises(ValueError):
        push_timeout_s(30.0, 2e9, 16, -1.0)
    assert push_min_gbps(load_config()) == 0.0
    assert push_min_gbps(load_config(None, ["resources.learner_gpus=1", "resources.generator_gpus=1"])) == 1.0
    assert push_min_gbps(load_config(None, ["sync.min_gbps=5"])) == 5.0


def test_nccl_receivers_stream_through_a_bounded_buffer_with_the_same_calls_as_the_sender() -> None:
    from async_rlhf.sync.transport import bounce_plan

    plan = bounce_plan(10 * 64 + 5, 64)
    assert len(plan) == 11 and plan[0] == (0, 64) and plan[-1] == (640, 645)
    assert all(b - a <= 64 for a, b in plan) and [a for a, _ in plan[1:]] == [b for _, b in plan[:-1]]
    assert bounce_plan(0, 64) == [] and bounce_plan(64, 64) == [(0, 64)]
    with pytest.raises(ValueError):
        bounce_plan(10, 0)
    rx = NcclTransport("cuda:0", host_arena=True)  # a device object only: nothing touches CUDA here
    tx = NcclTransport("cuda:0")
    host = torch.zeros(4, dtype=torch.uint8)
    assert rx.accepts(host) and not tx.accepts(host)  # host memory only where it goes through the bounce buffer
    assert not rx.accepts(torch.zeros(4, dtype=torch.uint8, device="meta"))
