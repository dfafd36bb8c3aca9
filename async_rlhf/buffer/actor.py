"""The buffer service as a Ray actor (the sockets live on a thread inside it)."""

from __future__ import annotations

from typing import Any

from async_rlhf.buffer.service import BufferLogic, BufferService
from async_rlhf.buffer.store import make_store
from async_rlhf.config import Config


class BufferActor:
    def __init__(self, cfg: Config) -> None:
        logic = BufferLogic(make_store(cfg.buffer.store, url=cfg.buffer.redis_url),
                            groups_per_version=cfg.train.batch_size * cfg.train.push_every,
                            max_staleness=cfg.train.max_staleness)
        self.service = BufferService(logic, cfg.buffer.host, cfg.buffer.port,
                                     cfg.buffer.max_message_mb << 20).start()

    def address(self) -> str:
        return self.service.address

    def stats(self, ledger: bool = False) -> dict[str, Any]:
        return self.service.call(self.service.logic.stats, ledger)

    def drop_held(self, reason: str) -> int:
        return self.service.call(self.service.logic.drop_held, reason)

    def stop(self) -> None:
        self.service.stop()
