"""What the driver's parts need from one another, as protocols: the fleet control, the progress loop and the
buffer watch take these, not the concrete :class:`~async_rlhf.driver.cluster.Cluster` or
:class:`~async_rlhf.buffer.client.BufferClient`, so each is testable with a small stand-in.

Ray actor handles stay ``Any``: their methods are called through ``.remote``, which no protocol describes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from async_rlhf.config import Config


class RoleCluster(Protocol):
    """The running roles (:class:`~async_rlhf.driver.cluster.Cluster`)."""

    cfg: Config
    buffer: Any
    buffer_address: str
    generators: list[Any]
    learners: list[Any]

    def new_generator(self, gen_id: int) -> Any: ...
    def join_late(self, member_id: str, handle: Any) -> None: ...
    def generator_died(self, member_id: str) -> None: ...
    def pin_buffer(self) -> None: ...


class BufferStats(Protocol):
    """The driver's own buffer client (:class:`~async_rlhf.buffer.client.BufferClient`): counters, and giving
    back admission slots of groups a dead generator will never put."""

    def stats(self, ledger: bool = False, timeout_s: float | None = None,
              ledger_of: Mapping[int, tuple[int, Iterable[int]]] | None = None) -> dict[str, Any]: ...
    def release(self, n: int) -> None: ...
    def release_holder(self, holder: str) -> int: ...


class FleetControl(Protocol):
    """What the control endpoint may ask of the fleet (:class:`~async_rlhf.driver.fleet.Fleet`)."""

    def request_scale(self, generators: int) -> None: ...
    def request_stop(self) -> None: ...
    def max_generators(self) -> int: ...
    def status(self) -> dict[str, Any]: ...
    def pids(self, timeout_s: float = 5.0) -> dict[str, Any]: ...
