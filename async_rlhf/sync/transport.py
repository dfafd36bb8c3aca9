"""How the push group moves bytes: one small interface, chosen by ``sync.backend`` (:func:`make_transport`).

    Sender / Receiver (protocol: epochs, headers, acks, blame)      -- backend-free
        |  open(store, rank, world)   broadcast(group, bytes)   allreduce(group, int64[1])   wait(work, ...)
        v  every tensor checked: on ``transport.device`` or refused before the backend sees it
    GlooTransport   CPU tensors, torch's ProcessGroupGloo, sliced waits (tested here)
    NcclTransport   CUDA tensors, vLLM's StatelessProcessGroup + PyNcclCommunicator on a stream of its own
                    (never run here: no GPU). A receiver keeps each version in pinned host memory and streams
                    every chunk through one bounded CUDA buffer (``bounce_bytes``): no second copy of the model
                    on a generator's GPU; vLLM's loaders copy each tensor to the GPU at the swap.

Contract for a dead or hung member (``survives_member_loss``):

- gloo: the push fails within ``sync.timeout_s`` naming the member; the sender drops it, opens a new epoch
  without it and pushes again (the run goes on).
- nccl: the push fails within ``sync.timeout_s`` naming the member and the run stops with that error. Setting
  up a group is bounded too: a member that never joins is named within ``sync.timeout_s`` (sync/rendezvous.py)
  instead of leaving every other rank in ncclCommInitRank for good. A
  collective whose peer is gone is a kernel that never ends on the GPU; the only way out is to abort the
  communicator (done when the group is retired), after which that GPU's state is not trusted to go on.
  Waits poll a CUDA event (``Event.query``) instead of calling NCCL waits with short timeouts: a timed-out
  NCCL wait aborts the communicator under recent PyTorch.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from async_rlhf.sync import group as G

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class WrongDevice(ValueError):
    """A tensor on another device than the transport's was about to reach the backend."""


class Transport(ABC):
    """One process's end of the push group's data plane (the store and protocol are the caller's)."""

    name: ClassVar[str]
    survives_member_loss: ClassVar[bool]
    """True: after a failed push the sender rebuilds the group without the culprit; False: the run stops."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    # -- buffers: every tensor the protocol allocates comes from here, on the transport's device ---------
    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def int64s(self, values: list[int]) -> torch.Tensor:
        t = G.int64s(values)
        return t if self.device.type == "cpu" else t.to(self.device)

    def read_int(self, t: torch.Tensor) -> int:
        """The first element of a one-element int64 tensor whose op was waited for (CUDA: a copy to host)."""
        return int(t[0])

    def accepts(self, t: torch.Tensor) -> bool:
        """Whether ``t`` may be handed to the backend as it is (else the sender stages it into a slot)."""
        return t.device == self.device

    def check(self, t: torch.Tensor, what: str) -> None:
        if not self.accepts(t):
            raise WrongDevice(f"{what}: a tensor on {t.device} for the {self.name} push group on {self.device} "
                              "(a bug: every buffer of the push must come from the transport)")

    # -- the group ----------------------------------------------------------------------------------------
    def broadcast(self, group: Any, tensor: torch.Tensor, root: int = 0) -> Any:
        self.check(tensor, "broadcast")
        return self._broadcast(group, tensor, root)

    def allreduce(self, group: Any, tensor: torch.Tensor) -> Any:
        self.check(tensor, "allreduce")
        return self._allreduce(group, tensor)

    @abstractmethod
    def open(self, store: Any, rank: int, world: int, timeout_s: float, names: Sequence[str] | None = None) -> Any:
        """The group of one epoch on ``store`` (already prefixed per epoch); rendezvous bounded by ``timeout_s``
        (``names[r]``: who rank r is, for the error naming a rank that never came)."""

    @abstractmethod
    def _broadcast(self, group: Any, tensor: torch.Tensor, root: int) -> Any: ...

    @abstractmethod
    def _allreduce(self, group: Any, tensor: torch.Tensor) -> Any: ...

    @abstractmethod
    def wait(self, work: Any, deadline: float, what: str, abort: Callable[[], str | None] | None = None,
             slice_s: float = 0.2) -> None:
        """Wait for ``work`` until ``deadline``, asking ``abort()`` every ``slice_s`` whether to give up;
        raises :class:`~async_rlhf.sync.group.SyncTimeout`, ``Aborted`` or ``SyncError``."""

    @abstractmethod
    def retire(self, group: Any, pending: list[Any]) -> None:
        """Forget a group (its ops in ``pending`` may never end)."""


class GlooTransport(Transport):
    """Today's CPU path, unchanged: torch's gloo group, sliced waits, groups with abandoned ops kept alive."""

    name = "gloo"
    survives_member_loss = True

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__(device)

    def open(self, store: Any, rank: int, world: int, timeout_s: float, names: Sequence[str] | None = None) -> Any:
        import torch.distributed as dist

        return dist.ProcessGroupGloo(store, rank, world, G.seconds(timeout_s))

    def _broadcast(self, group: Any, tensor: torch.Tensor, root: int) -> Any:
        return G.post_broadcast(group, tensor, root)

    def _allreduce(self, group: Any, tensor: torch.Tensor) -> Any:
        return group.allreduce([tensor])

    def wait(self, work: Any, deadline: float, what: str, abort: Callable[[], str | None] | None = None,
             slice_s: float = 0.2) -> None:
        G.wait_work(work, deadline, what, abort, slice_s)

    def retire(self, group: Any, pending: list[Any]) -> None:
        G.retire(group, pending)


class _CudaWork:
    """An op enqueued on the transport's stream; done when the event recorded after it has fired."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return bool(self.event.query())


def bounce_plan(nbytes: int, bounce_bytes: int) -> list[tuple[int, int]]:
    """The NCCL broadcasts of one chunk of ``nbytes``: parts of at most ``bounce_bytes``. Every rank splits the
    same way whatever its buffer's device (collectives must match one to one), so a rank that receives into
    host memory through a bounded CUDA buffer and one that sends from CUDA memory issue the same calls."""
    if bounce_bytes <= 0:
        raise ValueError("bounce_bytes must be positive")
    return [(a, min(a + bounce_bytes, nbytes)) for a in range(0, nbytes, bounce_bytes)]


class NcclTransport(Transport):
    """CUDA path: vLLM's RLHF weight-update wrapper (StatelessProcessGroup + PyNcclCommunicator), as in
    vLLM's own RLHF examples. Ops run on a stream of their own so that a receive never queues behind (or
    stalls) the engine's kernels. With ``host_arena`` (receivers) buffers are pinned host memory and the
    backend only ever sees the bounded CUDA bounce buffer. Never run here."""

    name = "nccl"
    survives_member_loss = False
    POLL_S = 0.0005
    BOUNCE_BYTES = 64 << 20

    def __init__(self, device: torch.device | str | None = None, host_arena: bool = False,
                 bounce_bytes: int = BOUNCE_BYTES) -> None:
        if device is None:
            if not torch.cuda.is_available():
                raise RuntimeError("sync.backend=nccl needs a CUDA device and none is visible here: use "
                                   "sync.backend=gloo on CPU")
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self.host_arena, self.bounce_bytes = host_arena, bounce_bytes
        self._stream: Any = None
        self._bounce: torch.Tensor | None = None

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.host_arena:  # pinned: the copies out of the bounce buffer run asynchronously on our stream
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return super().empty(nbytes)

    def accepts(self, t: torch.Tensor) -> bool:
        return t.device == self.device or (self.host_arena and t.device.type == "cpu")

    def bounce(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the one CUDA buffer that host-memory chunks pass through."""
        if self._bounce is None:
            self._bounce = torch.empty(self.bounce_bytes, dtype=torch.uint8, device=self.device)
        return self._bounce[:nbytes]

    @property
    def stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def open(self, store: Any, rank: int, world: int, timeout_s: float, names: Sequence[str] | None = None) -> Any:
        """Every rank arrives within ``timeout_s`` (else the missing ones are named), then the communicator is
        built under the same deadline (sync/rendezvous.py): ncclCommInitRank itself would wait forever."""
        from async_rlhf.sync.rendezvous import arrival_barrier, call_by

        deadline = time.monotonic() + timeout_s
        arrival_barrier(store, rank, world, deadline, names)
        return call_by(lambda: self._communicator(store, rank, world), deadline,
                       f"the NCCL communicator of rank {rank} of {world}")

    def _communicator(self, store: Any, rank: int, world: int) -> Any:
        """vLLM's StatelessProcessGroup on the epoch's store and its PyNcclCommunicator on this device."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup(rank=rank, world_size=world, store=store)
        comm = PyNcclCommunicator(pg, device=self.device)
        if comm.disabled:
            raise RuntimeError("vLLM's PyNcclCommunicator is disabled (no NCCL library, or VLLM_DISABLE_PYNCCL)")
        return comm

    def _enqueue(self, op: Callable[[], Any]) -> _CudaWork:
        # the op reads what the current stream wrote (a packed slot): order it after that, on our stream
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        op()
        event = torch.cuda.Event()
        event.record(self.stream)
        return _CudaWork(event)

    def _broadcast(self, group: Any, tensor: torch.Tensor, root: int) -> Any:
        def op() -> None:
            with torch.cuda.stream(self.stream):  # the copies too: ordered with the broadcasts, off the engine's
                for a, b in bounce_plan(tensor.numel(), self.bounce_bytes):
                    part = tensor[a:b]
                    if part.device == self.device:
                        group.broadcast(part, src=root, stream=self.stream)
                        continue
                    buf = self.bounce(b - a)  # host memory: through the bounded CUDA buffer
                    if group.rank == root:
                        buf.copy_(part, non_blocking=True)
                    group.broadcast(buf, src=root, stream=self.stream)
                    if group.rank != root:
                        part.copy_(buf, non_blocking=True)

        return self._enqueue(op)

    def _allreduce(self, group: Any, tensor: torch.Tensor) -> Any:
        return self._enqueue(lambda: group.all_reduce(tensor, out_tensor=tensor, stream=self.stream))

    def wait(self, work: Any, deadline: float, what: str, abort: Callable[[], str | None] | None = None,
             slice_s: float = 0.2) -> None:
        wait_polled(work.is_completed, deadline, what, abort, slice_s, self.POLL_S)

    def retire(self, group: Any, pending: list[Any]) -> None:
        """Destroy the communicator (ncclCommAbort, which also ends a collective stuck on a dead peer): a
        rebuilt group never leaves the old one's GPU memory behind."""
        if group is not None:
            try:
                group.destroy()
            except Exception as exc:  # the process is going down with a broken GPU context, say
                log.warning("could not destroy a retired NCCL communicator: %s", exc)


def wait_polled(done: Callable[[], bool], deadline: float, what: str, abort: Callable[[], str | None] | None,
                slice_s: float, poll_s: float) -> None:
    """Poll ``done()`` until it is true or ``deadline``; every ``slice_s`` ask ``abort()`` whether to give up.
    Nothing here calls a backend wait with a timeout (an NCCL wait that times out aborts its communicator)."""
    next_check = time.monotonic() + slice_s
    while not done():
        now = time.monotonic()
        if now >= deadline:
            raise G.SyncTimeout(f"timed out waiting for {what}")
        if abort is not None and now >= next_check:
            next_check = now + slice_s
            reason = abort()
            if reason:
                raise G.Aborted(f"{what} abandoned: {reason}")
        time.sleep(poll_s)


def make_transport(backend: str, device: torch.device | str | None = None, host_arena: bool = False) -> Transport:
    """The transport for ``sync.backend``; ``device`` defaults to CPU for gloo and the current CUDA device for
    nccl. ``host_arena`` (receivers): keep received versions in host memory (gloo always does)."""
    if backend == "gloo":
        return GlooTransport(device or "cpu")
    if backend == "nccl":
        return NcclTransport(device, host_arena=host_arena)
    raise ValueError(f"sync.backend={backend!r} is not a weight transport: use gloo (CPU) or nccl (GPU)")
