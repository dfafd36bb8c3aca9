"""Learner rank 0's end of the weight push, off the training thread.

    training thread                         push thread (one)
    ---------------                         -----------------
    optimizer step -> weights are v + 1
    start(params, v + 1) ----------------->  sender.push(params, v + 1): broadcast to every generator (their
    next step: wait_data, forward/backward    receives are already posted), one allreduce of acknowledgements;
    wait() before the optimizer step <-----  a dead member is dropped and the push repeated without it;
      (the only time the learner waits       then tell the buffer v + 1 is held everywhere (admission opens
       on the fleet: time/push_wait_s)        one more batch)

The parameters are read in place, so the training thread must not write them (the optimizer step) before
:meth:`WeightPusher.wait` returns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from async_rlhf.config import Config

log = logging.getLogger(__name__)


@contextlib.contextmanager
def full_params(engine: Any, zero_stage: int):
    """Full parameters of a DeepSpeed engine by Hugging Face name, all at once (gathered under ZeRO-3: the whole
    model on every rank, so the learner never does this; it gathers window by window, learner/zero3.py; tests
    compare with it); collective on every rank."""
    import deepspeed

    module = engine.module
    ctx = (deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
           if zero_stage == 3 else contextlib.nullcontext())
    with ctx:
        yield dict(module.named_parameters())


def push_layout(params: dict[str, Any], bucket_cap: int, zero_stage: int) -> list:
    """The buckets of the weight push for these parameters (full, or ZeRO-3's partitioned ones: their full
    shape), at most ``bucket_cap`` bytes each.

    Under ZeRO-0 the parameters are also moved into one buffer in push order (``flatten_params``) so that
    every push sends straight from it, in every dtype: the optimizers DeepSpeed builds there (torch's for
    fp32, its unfused fp16/bf16 one, whose fp32 master copies are written back with ``p.data.copy_``) hold
    the Parameter objects, not their storage. ZeRO-1/2 keep parameters as slices of their own flat buffers,
    which the sender uses as they are; ZeRO-3 gathers fresh tensors for each push, sent as they lie when
    they are back to back in push order (DeepSpeed gathers into one buffer), else packed. The sender checks
    at every push where the tensors are, so a wrong guess here costs a copy, never wrong weights.
    """
    from async_rlhf.sync.layout import DTYPE_BYTES, TensorSpec, auto_bucket_bytes, plan_buckets
    from async_rlhf.sync.tensors import dtype_name, flatten_params

    specs = [TensorSpec(n, tuple(getattr(p, "ds_shape", p.shape)), dtype_name(p)) for n, p in params.items()]
    total = sum(s.numel * DTYPE_BYTES[s.dtype] for s in specs)
    buckets = plan_buckets(specs, auto_bucket_bytes(total, lo=min(4 << 20, bucket_cap), hi=bucket_cap))
    if zero_stage == 0:
        flatten_params(params, buckets)
    return buckets


class WeightPusher:
    def __init__(self, cfg: Config, buckets: list, host: str, port: int, buffer_address: str) -> None:
        from async_rlhf.config import push_min_gbps
        from async_rlhf.sync.sender import Sender

        self.cfg, self.buffer_address = cfg, buffer_address
        self.sender = Sender(buckets, host, port, cfg.sync.backend, cfg.sync.timeout_s, min_gbps=push_min_gbps(cfg))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weight-push")
        self._future: Future | None = None
        self._client: Any = None  # the push thread's own buffer client (a ZeroMQ socket is one thread's)

    def members_died(self, member_ids: list[str]) -> None:
        """Seen dead by the driver: a push in flight aborts at once and the next one leaves them out."""
        self.sender.fail_members(member_ids)

    def push(self, params: Mapping[str, Any], version: int, stream: Any = None) -> dict[str, float]:
        """Send ``version`` to every live generator, then publish it to the buffer; returns the push's metrics.
        A dead or hung member is named, dropped, and the push repeated on the rebuilt group.

        ``stream`` (ZeRO-3, a :class:`~async_rlhf.learner.zero3.WindowedGather`): the parameters are gathered
        window by window during each attempt, and every attempt ends with ``stream.end_pass`` (the other learner
        ranks gather along and learn whether another attempt follows)."""
        from async_rlhf.learner.zero3 import AGAIN, DONE, FAILED
        from async_rlhf.sync.sender import PushError

        dropped: list[str] = []
        attempts = len(self.sender.members) + 2
        for attempt in range(attempts):
            outcome = FAILED
            try:
                metrics = self.sender.push(params, version, stream)
                outcome = DONE
                break
            except PushError as err:
                if not self.sender.transport.survives_member_loss:  # see sync/transport.py: the run stops
                    raise RuntimeError(f"{err}; sync.backend={self.sender.transport.name} does not rebuild the "
                                       "push group without a failed member: the run stops here") from err
                log.error("%s: rebuilding the push group without %s", err, err.failed_members)
                self.sender.drop(err.failed_members)
                dropped += err.failed_members
                outcome = AGAIN if attempt < attempts - 1 else FAILED
            finally:
                if stream is not None:
                    stream.end_pass(outcome)
        else:
            raise RuntimeError(f"the weight push of version {version} kept failing; see the errors above")
        self._publish(version)
        return {**metrics, "sync/dropped": float(len(dropped))}

    def _publish(self, version: int) -> None:
        from async_rlhf.buffer.build import make_client
        from async_rlhf.buffer.client import with_retry

        if self._client is None:
            self._client = make_client(self.cfg, self.buffer_address, consumer="learner-push")
        patience = self.cfg.buffer.redis_retry_s + self.cfg.buffer.request_timeout_s
        with_retry(lambda: self._client.set_version(version), "set_version", patience)

    def start(self, params: Mapping[str, Any], version: int) -> None:
        """:meth:`push` on the push thread; returns at once (call :meth:`wait` before writing ``params``)."""
        if self._future is not None:
            raise RuntimeError("a push is still in flight: wait() for it first")
        self._future = self._pool.submit(self.push, params, version)

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def wait(self) -> dict[str, float]:
        """Block until the push in flight is done; its metrics (raises what it raised)."""
        future, self._future = self._future, None
        return future.result() if future is not None else {}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
