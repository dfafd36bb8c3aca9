"""The TP workers of one engine load the same version, by construction (generator/worker_ext.py): the engine
first holds every worker's staged versions (``hold_staged``), then asks each for the agreed one
(``apply_update(version=...)``). Two worker extensions of one engine on a real gloo push group, each with its
real fetch thread and two receive slots, in a child process (its fetch threads never end: it leaves with
``os._exit``); the engine's model is a stand-in that records what it loads."""

from __future__ import annotations

import os
import threading
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from conftest import stop_process
from test_weight_push_preposted import HOST, SPECS, params, wait_until

from async_rlhf.generator.worker_ext import WeightSyncWorker, agreed_version
from async_rlhf.sync.layout import layout_to_wire, plan_buckets
from async_rlhf.sync.protocol import tp_member_ids
from async_rlhf.sync.sender import Sender

pytestmark = pytest.mark.distributed


class Runner:
    """Stands in for vLLM's model runner: records the value of ``w`` in every load."""

    def __init__(self) -> None:
        self.loaded: list[float] = []

    def reload_weights(self, weights_iterator) -> None:
        self.loaded.append(float(dict(weights_iterator)["w"][0, 0]))

    def get_model(self):
        return torch.nn.Module()


class Worker(WeightSyncWorker):
    def __init__(self, rank: int) -> None:
        self.rank, self.parallel_config = rank, SimpleNamespace(tensor_parallel_size=2)
        self.model_runner = Runner()


def swap(workers: list[Worker], held: list[int | None] | None = None) -> list[int]:
    """What the generator does for a TP engine: hold on every worker, then load the agreed version on each."""
    held = held if held is not None else [w.hold_staged() for w in workers]
    version = agreed_version(held)
    return [int(w.apply_update(version=version, timeout_s=10.0)["version"]) for w in workers]


def scenario(out) -> None:
    try:
        out.put(("ok", swaps()))
    except Exception:
        out.put(("crash", traceback.format_exc()))
    finally:
        out.close()
        out.join_thread()
        os._exit(0)


def test_tp_workers_load_one_agreed_version_even_when_a_push_lands_mid_swap() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=scenario, args=(out,))
    proc.start()
    try:
        kind, got = out.get(timeout=120)
    finally:
        stop_process(proc)
    assert kind == "ok", got
    # both hold version 1, then version 2 lands before they load: both load 1 (2 stays staged, intact);
    # worker 0 holds before version 3 lands, worker 1 after: both load 3; released, both receive version 4
    assert got["swaps"] == [[1, 1], [3, 3], [4, 4]]
    assert got["loaded"] == [[1.0, 3.0, 4.0], [1.0, 3.0, 4.0]]


def swaps() -> dict[str, list]:
    """The swaps of the scenario above, as an engine with two TP workers makes them."""
    got: list[list[int]] = []
    buckets = plan_buckets(SPECS, 64)
    sender = Sender(buckets, HOST, 0, timeout_s=10.0)
    workers = [Worker(0), Worker(1)]
    try:
        for w in workers:
            w.init_receiver(HOST, sender.port, "gen0", layout_to_wire(buckets), "gloo", 10.0, 2)
        joins = [threading.Thread(target=w.join_push_group, args=(10.0,), daemon=True) for w in workers]
        for th in joins:
            th.start()
        sender.form(tp_member_ids("gen0", 2), timeout_s=10.0)
        for th in joins:
            th.join(10)
        for w in workers:
            w.start_fetching(10.0)
        sender.push(params(1), 1)
        wait_until(lambda: [w.staged_version() for w in workers] == [1, 1], "version 1 staged on both workers")

        held = [w.hold_staged() for w in workers]
        sender.push(params(2), 2)
        wait_until(lambda: all(2 in w._kept for w in workers), "version 2 staged during the hold")
        got.append(swap(workers, held))

        wait_until(lambda: [w.staged_version() for w in workers] == [2, 2], "version 2 still staged")
        first = workers[0].hold_staged()  # at once: worker 0's fetch thread may not have woken from the last hold
        sender.push(params(3), 3)
        wait_until(lambda: 3 in workers[0]._kept and workers[1].staged_version() == 3, "version 3 staged")
        got.append(swap(workers, [first, workers[1].hold_staged()]))

        sender.push(params(4), 4)
        wait_until(lambda: [w.staged_version() for w in workers] == [4, 4], "version 4 after the swaps")
        got.append(swap(workers))
        return {"swaps": got, "loaded": [w.model_runner.loaded for w in workers]}
    finally:
        sender.close()


def test_the_agreed_version_is_the_newest_held_or_none() -> None:
    assert agreed_version([3, 4]) == 4
    assert agreed_version([3, None]) is None and agreed_version([3, -1]) is None and agreed_version([]) is None


def test_a_hold_without_an_agreed_version_is_released_and_names_the_failure() -> None:
    """When a worker's fetch failed, the engine loads nothing: the hold ends, the fetch loop may go on, and the
    failure is reported once (as a load would have reported it)."""
    import threading

    from async_rlhf.sync.group import SyncError

    worker = WeightSyncWorker()
    worker._fetched = threading.Condition()
    worker._held, worker._holds, worker._kept = True, 1, {3: object()}
    worker._fetch_error = SyncError("push of version 4 aborted")
    assert worker.release_hold() == "SyncError: push of version 4 aborted"
    assert not worker._held and worker._kept == {} and worker._fetch_error is None
    assert worker.release_hold() is None  # nothing failed since
