"""Where every rendezvous listens: discovered on the node that listens, never assumed.

One host (the default when the Ray cluster has one node) keeps everything on loopback. Across nodes
(``run.network=node``, or ``auto`` with more than one alive Ray node) every address is found where it is
used and handed out by the driver::

    driver                      probe task in learner rank 0's bundle -> (its node IP, a port free there)
      |  DeepSpeed MASTER_ADDR:MASTER_PORT = that pair      (every learner rank dials it)
      |  weight-push TCPStore              = rank 0's node IP, another port free there (generators dial it)
      |  buffer ROUTER                     = binds its own node's IP with CURVE keys made for this run and
      |                                      reports exactly that address (never 0.0.0.0)
      |  control endpoint                  = the driver's loopback (``scale``/``stop`` from the driver's node)

Actors learn the mode from ``NETWORK_ENV`` in their Ray runtime env, and the per-run CURVE keys from
``CURVE_ENV`` (set by the driver through Ray, never written to config.json, a log or the metrics). gloo
binds the interface that holds the node's IP (``GLOO_SOCKET_IFNAME``, unless the user set it): its own
default is the address the host name resolves to, which other nodes may not reach.

Ray is imported inside functions only.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

NETWORK_ENV = "ASYNC_RLHF_NETWORK"
"""``node`` in every actor of a run whose roles span nodes; unset (loopback) otherwise."""
CURVE_ENV = "ASYNC_RLHF_BUFFER_KEYS"
"""JSON of the run's CURVE keys (server and client pairs), for the buffer and its clients."""
LOOPBACK_HOST = "127.0.0.1"


def use_node_addresses(mode: str, alive_nodes: int) -> bool:
    """``run.network``: ``loopback`` never, ``node`` always, ``auto`` when the cluster has several nodes."""
    if mode == "auto":
        return alive_nodes > 1
    return mode == "node"


def node_mode() -> bool:
    """This process belongs to a run whose roles span nodes."""
    return os.environ.get(NETWORK_ENV) == "node"


def node_ip() -> str:
    """The IP address Ray knows this node by (the address other nodes reach it at)."""
    import ray

    return str(ray.util.get_node_ip_address())


def listen_host() -> str:
    """The address a role on this node binds and hands out: its node's IP across nodes, else loopback."""
    return node_ip() if node_mode() else LOOPBACK_HOST


def free_port(host: str = LOOPBACK_HOST) -> int:
    """A TCP port free on ``host`` now (the caller binds it soon after; a race is possible, not likely)."""
    return free_ports(host, 1)[0]


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now (all bound at once, then released)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


SHARED_TOKEN = ".shared-storage-check"
"""A file the driver writes in the run directory: every node that writes there must read it back."""


def probe_node(run_dir: str = "", token: str = "", paths: tuple[str, ...] = (), ports: int = 1) -> dict[str, Any]:
    """Run in a placement bundle on a node before the roles there start: the node's IP, the host a role would
    listen on, ``ports`` distinct ports free there (one per bundle it answers for), its cores, whether it sees the
    run directory the driver sees (the token file holds ``token``) and which of ``paths`` it cannot read."""
    from pathlib import Path

    host = listen_host()
    seen = ""
    if run_dir:
        try:
            seen = (Path(run_dir) / SHARED_TOKEN).read_text()
        except OSError:
            seen = ""
    return {"host": host, "ports": free_ports(host, ports), "node": node_ip(),
            "cores": sorted(os.sched_getaffinity(0)), "sees_run_dir": not run_dir or seen == token,
            "missing": [p for p in paths if not os.path.exists(p)]}


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` on this host (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def bind_gloo_to_node() -> str | None:
    """Across nodes, make gloo listen on the interface of this node's IP (unless GLOO_SOCKET_IFNAME is set);
    returns the interface. gloo reads the variable when a process group is created."""
    if not node_mode() or os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ.get("GLOO_SOCKET_IFNAME")
    name = interface_of(node_ip())
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


# -- per-run CURVE keys for the buffer -------------------------------------------------------------------
def run_keys_env(keys: dict[str, str]) -> dict[str, str]:
    return {CURVE_ENV: json.dumps(keys)}


def run_keys() -> dict[str, str] | None:
    """This run's CURVE keys, if the driver made some (``CURVE_ENV``)."""
    raw = os.environ.get(CURVE_ENV)
    return json.loads(raw) if raw else None
