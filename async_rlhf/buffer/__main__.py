"""Run the buffer service on its own: ``python -m async_rlhf.buffer [--config FILE] [key=value ...]``.

    python -m async_rlhf.buffer buffer.store=redis buffer.redis_url=redis://:pw@host:6379/0 buffer.port=5555
    python -m async_rlhf.buffer keygen          # prints a CURVE keypair (z85) for buffer.curve_* keys

It prints ``READY <address>`` once it serves, then runs until SIGTERM or SIGINT. Killed with SIGKILL and
started again on the same Redis store, it carries on from the state Redis holds (see redis_store.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from async_rlhf.buffer.build import build_service
from async_rlhf.buffer.curve import keypair
from async_rlhf.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m async_rlhf.buffer", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config file (the buffer.* and train.* sections are used)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. buffer.store=redis, or 'keygen'")
    args = parser.parse_args(argv)
    if args.overrides == ["keygen"]:
        public, secret = keypair()
        print(f"public {public}\nsecret {secret}")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    service = build_service(cfg).start()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"READY {service.address}", flush=True)
    done.wait()
    service.stop()
    service.logic.store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
