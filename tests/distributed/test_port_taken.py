"""The driver starts the learner ranks again when rank 0's rendezvous port was taken: it must recognise
that failure from what torch raises, and only that one."""

import socket

import pytest
import torch.distributed as dist

from async_rlhf.driver.start_roles import port_taken


def test_a_store_bound_to_a_taken_port_is_recognised():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(Exception) as caught:
            dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    assert port_taken(caught.value)


def test_other_failures_are_not_taken_for_a_taken_port():
    assert not port_taken(RuntimeError("connection refused by 10.0.0.2:29500"))
    assert not port_taken(TimeoutError("the rendezvous timed out"))
