"""Every wait of the push protocol is bounded, and membership edge cases, in one process: a real TCPStore
and real gloo groups, receivers on threads (fast; the multi-process cases are in test_weight_push_group)."""

import faulthandler
import threading
import time

import pytest
import torch
from conftest import joins_noticed, poll_joiners

from async_rlhf.sync import protocol as P
from async_rlhf.sync.group import SyncTimeout, free_port
from async_rlhf.sync.layout import TensorSpec, plan_buckets
from async_rlhf.sync.receiver import Excluded, ReceiveError, Receiver
from async_rlhf.sync.sender import PushError, Sender

pytestmark = pytest.mark.distributed

HOST = "127.0.0.1"
SPECS = [TensorSpec("w", (8, 4), "float32"), TensorSpec("b", (4,), "float32"), TensorSpec("n", (6,), "bfloat16")]
BUCKETS = plan_buckets(SPECS, 64)


def params(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8, 4), float(version)), "b": torch.arange(4.0) + version,
            "n": torch.full((6,), version / 2).to(torch.bfloat16)}


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def in_thread(fn, results: list) -> threading.Thread:
    """Run ``fn`` on a thread; its result or exception is appended to ``results``."""
    def target():
        try:
            results.append(fn())
        except Exception as exc:  # reported to the test thread
            results.append(exc)
    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th


def bounded(fn, limit_s: float):
    t0 = time.monotonic()
    try:
        return fn()
    finally:
        assert time.monotonic() - t0 < limit_s, f"took {time.monotonic() - t0:.1f}s, bound {limit_s}s"


def test_connecting_to_a_missing_store_is_bounded():
    with pytest.raises(SyncTimeout, match="could not reach"):
        bounded(lambda: Receiver(BUCKETS, "gen0", HOST, free_port(), timeout_s=1.0), 8.0)


def test_form_names_members_that_never_ask_to_join():
    sender = Sender(BUCKETS, HOST, free_port(), timeout_s=1.0)
    with pytest.raises(PushError) as info:
        bounded(lambda: sender.form(["gen0", "gen1"], timeout_s=1.0), 3.0)
    assert info.value.missing == ["gen0", "gen1"]


def test_join_and_receive_time_out_without_a_sender_acting():
    sender = Sender(BUCKETS, HOST, free_port(), timeout_s=1.0)
    rx = Receiver(BUCKETS, "gen0", HOST, sender.port, timeout_s=1.0)
    with pytest.raises(SyncTimeout, match="admission of gen0"):
        bounded(lambda: rx.join(timeout_s=1.0), 3.0)
    assert sender.store.queue_len(P.JOIN_QUEUE) == 1  # the request stays queued: a later push admits it


def test_a_waiting_receiver_fills_no_log(capfd):
    """An idle member asks the store every slice without a timed c10d wait: each one that timed out logged two
    warning lines (500 lines in a 4-step demo)."""
    sender = Sender(BUCKETS, HOST, free_port(), timeout_s=1.5)
    rx = Receiver(BUCKETS, "gen0", HOST, sender.port, timeout_s=1.5)
    with pytest.raises(SyncTimeout, match="admission of gen0"):
        bounded(lambda: rx.join(timeout_s=1.5), 4.0)
    err = capfd.readouterr().err
    assert "waitForInput" not in err and "timed out after" not in err, err[-2000:]


def test_admitted_member_that_never_gets_ready_is_named_and_can_be_dropped():
    sender = Sender(BUCKETS, HOST, free_port(), timeout_s=1.0)
    sender.store.queue_push(P.JOIN_QUEUE, P.encode_join(P.Member("ghost", "x")))  # asks, then vanishes
    deadline = time.monotonic() + 5.0
    while not joins_noticed(sender):  # the sender's watcher sees the request by itself, off the push's path
        assert time.monotonic() < deadline, "the sender never noticed the join request"
        time.sleep(0.01)
    with pytest.raises(PushError) as info:
        bounded(lambda: sender.push(params(1), 1), 3.0)
    assert info.value.missing == ["ghost"] and "did not enter the rebuilt group" in str(info.value)
    sender.drop(info.value.failed_members)
    metrics = sender.push(params(1), 1)  # nobody left: the version is still recorded
    assert sender.members == [] and metrics["sync/members"] == 0 and sender.version == 1


def test_dropped_member_is_told_it_was_excluded_and_can_join_again():
    sender = Sender(BUCKETS, HOST, free_port(), timeout_s=10.0)
    rx = Receiver(BUCKETS, "gen0", HOST, sender.port, timeout_s=10.0)
    model = {s.name: torch.zeros(s.shape, dtype=torch.float32 if s.dtype == "float32" else torch.bfloat16)
             for s in SPECS}
    results: list = []

    def load(it):
        for n, t in it:
            model[n].copy_(t)

    def run(fn):
        return in_thread(fn, results)

    th = run(rx.join)
    sender.form(["gen0"], timeout_s=10.0)
    th.join(10)
    assert results.pop() == 0

    th = run(lambda: rx.receive(load).version)
    sender.push(params(1), 1)
    th.join(10)
    assert results.pop() == 1 and torch.equal(model["w"], params(1)["w"])

    sender.drop(["gen0"])
    sender.push(params(2), 2)  # a version boundary without gen0: epoch 1 is empty
    assert sender.members == [] and sender.epoch == 1
    with pytest.raises(Excluded, match="gen0 was dropped"):
        rx.receive(load, timeout_s=5.0)

    th = run(lambda: rx.receive(load, timeout_s=10.0))  # joins again, gets the next version
    deadline = time.monotonic() + 10
    while not poll_joiners(sender):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sender.push(params(3), 3)
    th.join(10)
    got = results.pop()
    assert (got.version, got.epoch) == (3, 2) and torch.equal(model["n"], params(3)["n"])
    assert got.metrics["sync/pause_s"] >= got.metrics["sync/transfer_s"] >= got.metrics["sync/ack_s"] >= 0
    rx.close()
    sender.close()


def test_a_receiver_holding_another_layout_refuses_the_push_and_is_named():
    sender = Sender(BUCKETS, HOST, free_port(), timeout_s=10.0, slice_s=0.05)
    other = plan_buckets(SPECS[:2], 64)
    rx = Receiver(other, "gen0", HOST, sender.port, timeout_s=10.0)
    results: list = []
    th = in_thread(rx.join, results)
    sender.form(["gen0"], timeout_s=10.0)
    th.join(10)
    th = in_thread(lambda: rx.receive(lambda it: list(it)), results)
    with pytest.raises(PushError) as info:
        bounded(lambda: sender.push(params(1), 1), 3.0)
    th.join(10)
    assert info.value.errors.keys() == {"gen0"} and "layout mismatch" in info.value.errors["gen0"]
    assert isinstance(results[-1], ReceiveError) and "layout mismatch" in str(results[-1])
    rx.close()
    sender.close()
