"""A bare TCP blaster and sink with the monitor attached, for the network-namespace lab.

It lets the monitor be tested (and demonstrated, ``python -m xdc.lab.link_load``) on a real
kernel path with loss and rate limits before the real daemons are wired to it: ``blast`` runs
``run_sampler`` over its own sockets and prints one JSON line per snapshot to stdout.

    python -m xdc.lab.link_load sink --host 10.231.0.2 --port 5201
    python -m xdc.lab.link_load blast --host 10.231.0.2 --port 5201 --conns 4 --seconds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Sequence

import trio

from xdc.config import MonitorConfig
from xdc.monitor.link_estimator import LinkSnapshot
from xdc.monitor.pacing import PacingController, apply_aggregate_pacing
from xdc.monitor.sampler import run_sampler


def _drain(conn: socket.socket) -> None:
    buf = bytearray(1 << 20)
    with conn:
        try:
            while conn.recv_into(buf):
                pass
        except OSError:
            pass


def sink(host: str, port: int) -> int:
    """Accept connections forever and discard what they send."""
    with socket.create_server((host, port), backlog=256, reuse_port=False) as srv:
        print(json.dumps({"ready": True, "port": srv.getsockname()[1]}), flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_drain, args=(conn,), daemon=True).start()


def _send(sock: socket.socket, stop: threading.Event) -> None:
    payload = memoryview(b"\0" * (1 << 20))
    try:
        while not stop.is_set():
            sock.sendall(payload)
    except OSError:
        pass


def blast(
    host: str, port: int, conns: int, seconds: float, hz: float, pace: bool, out: Sequence[str]
) -> int:
    cfg = MonitorConfig(sample_hz=hz)
    socks = [socket.create_connection((host, port), timeout=5) for _ in range(conns)]
    for s in socks:
        s.settimeout(None)
    stop = threading.Event()
    threads = [threading.Thread(target=_send, args=(s, stop), daemon=True) for s in socks]
    for th in threads:
        th.start()
    controller = PacingController() if pace else None
    fields = set(out)

    def emit(snap: LinkSnapshot) -> None:
        data = snap.to_json()
        if fields:
            data = {k: v for k, v in data.items() if k in fields}
        line: dict[str, object] = {"link": data}
        if controller is not None:
            rate = controller.update(snap)
            apply_aggregate_pacing(socks, rate)
            line["pacing_limit_bps"] = rate
        print(json.dumps(line), flush=True)

    async def main() -> None:
        with trio.move_on_after(seconds):
            await run_sampler(lambda: socks, cfg, emit)

    print(json.dumps({"ready": True, "start": time.time()}), flush=True)
    try:
        trio.run(main)
    finally:
        stop.set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdc.lab.link_load", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    ps = sub.add_parser("sink", help="accept and discard")
    ps.add_argument("--host", default="127.0.0.1")
    ps.add_argument("--port", type=int, default=0)
    pb = sub.add_parser("blast", help="send as fast as possible and print link snapshots")
    pb.add_argument("--host", default="127.0.0.1")
    pb.add_argument("--port", type=int, required=True)
    pb.add_argument("--conns", type=int, default=4)
    pb.add_argument("--seconds", type=float, default=5.0)
    pb.add_argument("--hz", type=float, default=10.0)
    pb.add_argument("--pace", action="store_true", help="apply the AIMD pacing controller")
    pb.add_argument("--fields", nargs="*", default=[], help="only print these snapshot keys")
    a = p.parse_args(argv)
    if a.cmd == "sink":
        return sink(a.host, a.port)
    return blast(a.host, a.port, a.conns, a.seconds, a.hz, a.pace, a.fields)


if __name__ == "__main__":
    sys.exit(main())
