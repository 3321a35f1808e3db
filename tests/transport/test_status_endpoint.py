"""The daemons' HTTP status endpoint on a configured address, read by Prometheus-style scrapes
and by `xdc monitor`, against real daemon processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from xdc.transport.engine_client import DecodeClient, PrefillClient
from xdc.transport.launcher import free_port

from tests.transport_fixtures import PairFactory

MIB = 1 << 20


def test_sender_status_metrics_and_xdc_monitor(pair_factory: PairFactory) -> None:
    p = pair_factory(connections=2)
    host, port = "127.0.0.2", free_port("127.0.0.2")
    p.tx_cfg.sender.status_host = host
    p.tx_cfg.sender.status_port = port
    p.start()
    base = f"http://{host}:{port}"
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("st", [MIB] * 4)
        for i in range(4):
            t.layer_buffer(i)
            t.layer_ready(i)
        assert t.wait(20).ok
        rx.await_request("st", timeout=10).release()
    deadline = time.monotonic() + 5
    while True:
        with urllib.request.urlopen(f"{base}/status", timeout=5) as r:
            status = json.load(r)
        if (
            status["link"].get("state") in ("ok", "warn", "congested")
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert status["completed"] == 1 and status["link"]["state"] == "ok", status["link"]
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    for name in (
        "xdc_sender_bytes_total",
        "xdc_sender_requests_total",
        "xdc_link_goodput_bps",
        "xdc_link_state{",
    ):
        assert name in metrics, name
    with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
        assert r.status == 200
    out = subprocess.run(
        [sys.executable, "-m", "xdc", "monitor", "--url", base, "--count", "1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout
