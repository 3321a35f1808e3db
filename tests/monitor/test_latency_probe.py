"""The latency probe over real loopback sockets: one JSON line per probe, a summary, clear
errors for bad flags and a peer that goes away."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

from xdc.transport.launcher import free_port

PROBE = [sys.executable, "-m", "xdc.lab.latency_probe"]


def test_probes_are_echoed_and_timed() -> None:
    port = free_port()
    serve = subprocess.Popen(
        [*PROBE, "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert serve.stdout is not None and json.loads(serve.stdout.readline())["ready"]
        res = subprocess.run(
            [*PROBE, "probe", "--port", str(port), "--seconds", "0.5", "--interval", "0.01"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        serve.kill()
        serve.wait(5)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    rtts = [r["rtt_ms"] for r in rows if "rtt_ms" in r]
    assert 20 <= len(rtts) <= 51 and all(0 < r < 1000 for r in rtts), rtts
    summary = rows[-1]
    assert summary["probes"] == len(rtts) and round(summary["max_ms"], 3) == max(rtts)


def test_a_peer_that_closes_ends_the_run_with_an_error() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def accept_and_close() -> None:
        conn, _ = srv.accept()
        conn.recv(64)
        conn.close()

    th = threading.Thread(target=accept_and_close, daemon=True)
    th.start()
    with srv:
        res = subprocess.run(
            [*PROBE, "probe", "--port", str(port), "--seconds", "5"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    th.join(5)
    assert res.returncode == 1
    assert "error" in json.loads(res.stdout.splitlines()[-1])


def test_bad_flags_are_refused() -> None:
    res = subprocess.run(
        [*PROBE, "probe", "--port", "1", "--interval", "0"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "must be > 0" in res.stderr
