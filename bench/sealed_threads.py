"""Sealed records in data threads, both ends in one process: does the cipher let the threads
use the cores? (issue 30)

K loopback TCP connections; on each, one thread seals and writes 2 MiB payloads
(``SealedRecords.send_all_in_thread``, as a sender's data thread does) and one thread reads and
opens them into a 2 MiB buffer (``SealedRecords.fill_in_thread``, as a receiver's does). With
both ends in one process they share one GIL, so this shows on a 2-core machine what the
daemons, one GIL each, show only with more cores: a cipher that holds the GIL (AES-128-GCM via
``cryptography``) serialises the threads, one that releases it (AEGIS-128L via PyNaCl's cffi)
does not. Plain TCP through the same thread paths (``sockio``) is the reference.

Modes run interleaved in every repeat; reports medians of Gbit/s and process CPU s/GB.

    python bench/sealed_threads.py [--connections 2] [--seconds 3] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from xdc.transport.sealed_records import SealedRecords
from xdc.transport.sockio import SockIO, ThreadStopped, fill_in_thread, send_all_in_thread

from xdc.protocol.aead_records import SHARE_BYTES, Cipher, Opener, Sealer, direction_secrets

CHUNK = 2 << 20
MODES = ["plain", *(c.label for c in Cipher)]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        a = socket.create_connection(lst.getsockname())
        b, _ = lst.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


Send = Callable[[memoryview, Callable[[], bool]], object]
Fill = Callable[[memoryview, Callable[[], bool]], int]


def _ends(mode: str, a: socket.socket, b: socket.socket) -> tuple[Send, Fill]:
    """The sending and receiving calls of one connection in ``mode``."""
    ta, tb = trio.socket.from_stdlib_socket(a), trio.socket.from_stdlib_socket(b)
    if mode == "plain":
        ia, ib = SockIO(ta), SockIO(tb)
        return (
            lambda v, stopped: send_all_in_thread(ia, [v], stopped),
            lambda d, stopped: fill_in_thread(ib, d, 0, stopped, None, contextlib.nullcontext())[0],
        )
    cipher = next(c for c in Cipher if c.label == mode)
    c2s, s2c = direction_secrets(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
    tx = SealedRecords(ta, Sealer(c2s, cipher=cipher), Opener(s2c, cipher=cipher), None)
    rx = SealedRecords(tb, Sealer(s2c, cipher=cipher), Opener(c2s, cipher=cipher), None)
    return (
        lambda v, stopped: tx.send_all_in_thread([v], stopped),
        lambda d, stopped: rx.fill_in_thread(d, 0, stopped, None, contextlib.nullcontext()),
    )


def run(mode: str, connections: int, seconds: float) -> dict[str, float]:
    """Gbit/s received over ``connections`` for ``seconds``, and process CPU s per GB."""
    payload = memoryview(bytearray(os.urandom(CHUNK)))
    received = [0] * connections
    errors: list[BaseException] = []
    stop = threading.Event()
    socks = [_tcp_pair() for _ in range(connections)]
    threads: list[threading.Thread] = []

    def sender(send: Send) -> None:
        with contextlib.suppress(ThreadStopped, OSError):
            while not stop.is_set():
                send(payload, stop.is_set)

    def receiver(i: int, fill: Fill) -> None:
        dest = memoryview(bytearray(CHUNK))
        try:
            while not stop.is_set():
                received[i] += fill(dest, stop.is_set)
        except (ThreadStopped, EOFError):
            pass
        except BaseException as e:  # a record that did not open: the run is void
            errors.append(e)

    for i, (a, b) in enumerate(socks):
        send, fill = _ends(mode, a, b)
        threads += [
            threading.Thread(target=sender, args=(send,)),
            threading.Thread(target=receiver, args=(i, fill)),
        ]
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    got = sum(received)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(timeout=10)
    for a, b in socks:
        a.close()
        b.close()
    if errors:
        raise SystemExit(f"{mode}: {errors[0]!r}")
    return {"gbps": got * 8 / wall / 1e9, "cpu_s_per_gb": cpu / (got / 1e9) if got else 0.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: choose from {', '.join(MODES)}")
    if a.connections < 1 or a.seconds <= 0 or a.repeats < 1:
        ap.error("--connections and --repeats must be >= 1, --seconds > 0")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for rep in range(a.repeats):
        for mode in modes:
            runs[mode].append(run(mode, a.connections, a.seconds))
        line = ", ".join(f"{m} {runs[m][-1]['gbps']:.2f}" for m in modes)
        print(f"repeat {rep + 1}: {line} Gbit/s", file=sys.stderr)
    out: dict[str, Any] = {
        "machine": f"{len(os.sched_getaffinity(0))} cores, {platform.machine()}",
        "params": {"connections": a.connections, "seconds": a.seconds, "chunk_bytes": CHUNK},
        "modes": {},
    }
    print(f"{'mode':<14}{'Gbit/s':>9}{'vs ' + modes[0]:>16}{'CPU s/GB':>10}")
    plain = statistics.median(r["gbps"] for r in runs[modes[0]])
    for mode in modes:
        g = statistics.median(r["gbps"] for r in runs[mode])
        c = statistics.median(r["cpu_s_per_gb"] for r in runs[mode])
        out["modes"][mode] = {
            "gbps": [round(r["gbps"], 3) for r in runs[mode]],
            "cpu_s_per_gb": [round(r["cpu_s_per_gb"], 3) for r in runs[mode]],
            "gbps_median": round(g, 3),
            "cpu_s_per_gb_median": round(c, 3),
        }
        print(f"{mode:<14}{g:>9.2f}{g / plain:>16.2f}{c:>10.3f}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
