"""The buffer service as a Ray actor (the sockets live on a thread inside it)."""

from __future__ import annotations

from typing import Any

from async_rlhf.buffer.build import build_service
from async_rlhf.config import Config


class BufferActor:
    def __init__(self, cfg: Config) -> None:
        from async_rlhf.run_logs import to_role_log

        to_role_log(cfg, "buffer")
        self.service = build_service(cfg).start()

    def address(self) -> str:
        return self.service.address

    def stats(self, ledger: bool = False, ledger_of: dict[int, tuple[int, list[int]]] | None = None) -> dict[str, Any]:
        """See ``BufferLogic.stats`` (``ledger_of``: the driver's open ledger, ``PromptLedger.windows``)."""
        windows = None if ledger_of is None else {int(g): (int(p), frozenset(s)) for g, (p, s) in ledger_of.items()}
        return self.service.call(self.service.logic.stats, ledger, windows)

    def drop_held(self, reason: str) -> int:
        return self.service.call(self.service.logic.drop_held, reason)

    def declare_dead(self, consumer: str) -> int:
        return self.service.call(self.service.logic.declare_dead, consumer)

    def restore_admission(self, version: int, consumed: int) -> dict[str, Any]:
        """A resumed run's admission state (see ``BufferLogic.restore_admission``)."""
        return self.service.call(self.service.logic.restore_admission, version, consumed)

    def stop(self) -> None:
        self.service.stop()
        self.service.logic.store.close()
