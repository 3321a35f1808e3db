"""One side of a Mooncake Transfer Engine (TCP transport) transfer, for bench/mooncake_peer.py.

Runs under the interpreter that has ``mooncake-transfer-engine-non-cuda`` installed (its own
venv: the wheel pins its own dependencies, and xdc must not import it). It speaks JSON lines on
stdout so the orchestrator, which measures CPU from outside, knows when the timed window opens
and closes:

- ``target``: initialises an engine with the P2P handshake (no metadata server), allocates
  the destination buffer, prints ``{"pid", "port", "ptr"}`` and serves until stdin closes.
- ``initiator``: writes ``--blocks`` blocks of ``--block-mib`` per
  ``batch_transfer_sync_write`` call (Mooncake sends a batch's blocks over that many TCP
  connections at once) into the target's buffer, round robin over it, for ``--seconds``;
  prints ``{"event": "start"}`` after one warm-up batch, then ``{"event": "end", ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

MIB = 1 << 20


def _say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _engine(host: str) -> Any:
    from mooncake.engine import TransferEngine  # only in the Mooncake venv

    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"mooncake: initialize({host}) failed: {rc}")
    return engine


def target(args: argparse.Namespace) -> int:
    engine = _engine(args.host)
    ptr = engine.allocate_managed_buffer(args.buffer_mib * MIB)
    if not ptr:
        raise SystemExit("mooncake: could not allocate the target buffer")
    _say({"pid": os.getpid(), "port": engine.get_rpc_port(), "ptr": ptr})
    sys.stdin.read()  # until the orchestrator closes our stdin
    return 0


def initiator(args: argparse.Namespace) -> int:
    engine = _engine(args.host)
    size = args.buffer_mib * MIB
    block = args.block_mib * MIB
    slots = size // block
    if slots < args.blocks:
        raise SystemExit("mooncake: buffer smaller than one batch")
    local = engine.allocate_managed_buffer(size)
    if not local:
        raise SystemExit("mooncake: could not allocate the source buffer")
    remote = args.ptr
    k = 0

    def batch() -> int:
        nonlocal k
        offs = [((k + i) % slots) * block for i in range(args.blocks)]
        k += args.blocks
        rc = engine.batch_transfer_sync_write(
            args.session, [local + o for o in offs], [remote + o for o in offs], [block] * len(offs)
        )
        if rc != 0:
            raise SystemExit(f"mooncake: batch_transfer_sync_write failed: {rc}")
        return int(block) * len(offs)

    batch()  # connections and handshake outside the timed window
    _say({"event": "start", "pid": os.getpid()})
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < args.seconds:
        sent += batch()
    _say({"event": "end", "bytes": sent, "seconds": time.monotonic() - t0})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=("target", "initiator"))
    ap.add_argument("--host", required=True, help="this side's address")
    ap.add_argument("--buffer-mib", type=int, default=256)
    ap.add_argument("--session", help="initiator: the target's host:port")
    ap.add_argument("--ptr", type=int, help="initiator: the target buffer's address")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per batch (= connections)")
    ap.add_argument("--block-mib", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    return target(args) if args.role == "target" else initiator(args)


if __name__ == "__main__":
    sys.exit(main())
