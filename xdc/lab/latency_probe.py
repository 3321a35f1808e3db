"""A latency-sensitive flow for the bottleneck lab: small request/response probes over one
TCP connection, the RTT of each measured by the application that waits for it.

Bulk senders that fill a bottleneck queue make every flow behind them wait; this is the flow
that waits (think of a decode instance's small RPCs sharing the egress with KV streams). It
prints one JSON line per probe, ``{"t": <unix time>, "rtt_ms": <float>}``, so a test or a
bench reads the queue's cost to others directly.

    python -m xdc.lab.latency_probe serve --host 10.233.0.2 --port 5301
    python -m xdc.lab.latency_probe probe --host 10.233.0.2 --port 5301 --seconds 5
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence

MSG = 64  # bytes per probe, each way


def _recv_exact(conn: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = conn.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


def _echo(conn: socket.socket) -> None:
    buf = memoryview(bytearray(MSG))
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while _recv_exact(conn, buf):
                conn.sendall(buf)
        except OSError:
            pass


def serve(host: str, port: int) -> int:
    """Echo fixed-size probes back, forever, one thread per connection."""
    with socket.create_server((host, port), backlog=16) as srv:
        print(json.dumps({"ready": True, "port": srv.getsockname()[1]}), flush=True)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()


def probe(host: str, port: int, seconds: float, interval_s: float, timeout_s: float) -> int:
    """Send a probe every ``interval_s`` and print its RTT; a probe that takes longer than
    ``timeout_s`` ends the run with exit 1 (a stuck flow is a result, not a hang)."""
    rtts: list[float] = []
    with socket.create_connection((host, port), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = bytearray(MSG)
        back = memoryview(bytearray(MSG))
        print(json.dumps({"ready": True, "start": time.time()}), flush=True)
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        seq = 0
        while nxt < end:
            time.sleep(max(0.0, nxt - time.monotonic()))
            out[:8] = seq.to_bytes(8, "big")
            t0 = time.monotonic()
            try:
                conn.sendall(out)
                if not _recv_exact(conn, back):
                    print(json.dumps({"error": "peer closed"}), flush=True)
                    return 1
            except OSError as e:
                print(json.dumps({"error": str(e)}), flush=True)
                return 1
            if bytes(back[:8]) != bytes(out[:8]):
                print(json.dumps({"error": f"probe {seq} answered out of order"}), flush=True)
                return 1
            rtt = (time.monotonic() - t0) * 1000.0
            rtts.append(rtt)
            print(json.dumps({"t": time.time(), "rtt_ms": round(rtt, 3)}), flush=True)
            seq += 1
            nxt += interval_s
    if rtts:
        med = statistics.median(rtts)
        print(json.dumps({"probes": len(rtts), "median_ms": med, "max_ms": max(rtts)}), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m xdc.lab.latency_probe", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    ps = sub.add_parser("serve", help="echo probes back")
    ps.add_argument("--host", default="127.0.0.1")
    ps.add_argument("--port", type=int, default=0)
    pp = sub.add_parser("probe", help="send probes and print each RTT")
    pp.add_argument("--host", default="127.0.0.1")
    pp.add_argument("--port", type=int, required=True)
    pp.add_argument("--seconds", type=float, default=5.0)
    pp.add_argument("--interval", type=float, default=0.02, help="seconds between probes")
    pp.add_argument("--timeout", type=float, default=5.0, help="give up on one probe after")
    a = p.parse_args(argv)
    if a.cmd == "serve":
        return serve(a.host, a.port)
    if a.seconds <= 0 or a.interval <= 0 or a.timeout <= 0:
        p.error("--seconds, --interval and --timeout must be > 0")
    return probe(a.host, a.port, a.seconds, a.interval, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
