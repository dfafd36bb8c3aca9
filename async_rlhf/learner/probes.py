"""Measurements of the fleet a learner rank takes part in after training (``driver/fleet_figures.py``,
``bench/scale*.py``): a raw broadcast of the push's bytes and the data-parallel all-reduce of a step's gradients.

Apart from ``actor.py`` because they are benchmarks, not training: nothing in a run's steps calls them. They are
:class:`~async_rlhf.learner.actor.LearnerActor`'s methods (remote-callable like the others) through this mixin,
and read its engine, device and push state.
"""

from __future__ import annotations

import time
from typing import Any

from async_rlhf.config import Config


class FleetProbes:
    """The fleet measurements of :class:`~async_rlhf.learner.actor.LearnerActor` (its base class)."""

    cfg: Config
    engine: Any
    placer: Any
    _pusher: Any
    _buckets: Any

    def raw_broadcast(self, world: int, tag: str, reps: int) -> dict[str, Any]:
        """Rank 0, after training: ``reps`` raw broadcasts of the push's bytes, on the push's store and transport,
        to the ``world - 1`` generator workers that call ``raw_receive`` with ``tag`` (async_rlhf/sync/raw.py)."""
        from async_rlhf.sync.raw import raw_send

        sender = self._pusher.sender
        nbytes = sum(b.nbytes for b in self._buckets)
        return {"bytes": nbytes, "seconds": raw_send(sender.store, sender.transport, nbytes, world, tag, reps,
                                                     self.cfg.sync.timeout_s)}

    def allreduce_seconds(self, reps: int) -> dict[str, Any]:
        """Every rank at once, after training: ``reps`` all-reduces (sum; one warm-up first, each after a barrier)
        over the learner ranks' group of a tensor with as many elements as the trainable parameters, in their dtype:
        what a data-parallel step reduces (ZeRO-0/1 all-reduce every gradient; ZeRO-2/3 reduce-scatter as many)."""
        import torch
        import torch.distributed as dist

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        numel = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)  # ZeRO-3: the full size
        grads = torch.ones(numel, dtype=params[0].dtype, device=self.placer.device)
        seconds = []
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(grads)
            if grads.is_cuda:
                torch.cuda.synchronize(grads.device)
            seconds.append(time.perf_counter() - t0)
        return {"elements": numel, "bytes": numel * grads.element_size(), "seconds": seconds[1:]}
