"""CURVE authentication for the buffer's sockets: required whenever the service binds beyond loopback.

    server: secret key + public key (z85)      client: its own keypair + the server's public key
    allowed clients: a list of client public keys; a client with any other key completes no handshake,
    so it gets no answer at all (its requests time out), and the service never sees its bytes.

Keys are 40-character z85 strings (``python -m async_rlhf.buffer keygen`` prints a pair).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class CurveServerKeys:
    secret_key: str
    public_key: str
    allowed_clients: list[str] = field(default_factory=list)


@dataclass
class CurveClientKeys:
    secret_key: str
    public_key: str
    server_key: str


def keypair() -> tuple[str, str]:
    """A fresh (public, secret) pair of z85 strings."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def parse_keys(text: str) -> list[str]:
    """``"k1,k2"`` -> ``["k1", "k2"]``; every key must be 40 z85 characters."""
    keys = [k.strip() for k in text.replace("\n", ",").split(",") if k.strip()]
    for k in keys:
        if len(k) != 40:
            raise ValueError(f"a CURVE key is 40 z85 characters, got {len(k)} ({k[:8]}...)")
    return keys


class _AllowList:
    def __init__(self, allowed: list[str]) -> None:
        self.allowed = {k.encode() for k in allowed}

    def callback(self, domain: str, key: bytes) -> bool:
        ok = key in self.allowed
        if not ok:
            log.warning("buffer: refused a CURVE client with an unknown public key %s", key[:8])
        return ok


def secure_server(ctx: zmq.Context, sock: zmq.Socket, keys: CurveServerKeys) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits only ``keys.allowed_clients``; returns the running ZAP thread."""
    if not keys.secret_key or not keys.public_key:
        raise ValueError("CURVE needs buffer.curve_secret_key and buffer.curve_public_key "
                         "(python -m async_rlhf.buffer keygen prints a pair)")
    if not keys.allowed_clients:
        raise ValueError("CURVE with no allowed client keys would refuse everyone: set buffer.curve_client_keys")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AllowList(keys.allowed_clients))
    sock.curve_secretkey = keys.secret_key.encode()
    sock.curve_publickey = keys.public_key.encode()
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    sock.curve_secretkey = keys.secret_key.encode()
    sock.curve_publickey = keys.public_key.encode()
    sock.curve_serverkey = keys.server_key.encode()
