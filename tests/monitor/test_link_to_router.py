"""The sender's congestion monitor publishes link state to a real `xdc router` process, and a
router that is down never stalls the data path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

from xdc.transport.engine_client import DecodeClient, PrefillClient
from xdc.transport.launcher import free_port

from tests.transport_fixtures import PairFactory
from xdc.lab.synthetic import fill_layer

MIB = 1 << 20


def _send(tx: PrefillClient, rid: str, n: int) -> None:
    t = tx.begin(rid, [MIB] * n)
    for i in range(n):
        buf = t.layer_buffer(i)
        fill_layer(buf, rid, i)
        del buf
        t.layer_ready(i)


def test_sender_publishes_link_state_to_router(pair_factory: PairFactory) -> None:
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xdc",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--set",
            "router.gateway_token=gw",
            "--set",
            "router.daemon_token=dm",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert router.stdout is not None
        assert router.stdout.readline().startswith("xdc router listening")
        p = pair_factory(connections=2)
        p.tx_cfg.monitor.router_url = f"http://127.0.0.1:{port}"
        p.tx_cfg.monitor.router_token = "dm"
        p.start()
        with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
            _send(tx, "pub", 8)
            assert tx.wait("pub", 20).ok
            rx.await_request("pub", timeout=10).release()
            deadline = time.monotonic() + 10
            link = None
            while time.monotonic() < deadline:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/state", timeout=5) as r:
                    link = json.load(r)["links"]["prfaas->pd"]
                if link["reporters"]:
                    break
                time.sleep(0.2)
            assert link and link["reporters"], "router never received the sender's link state"
            # the sender reports its share of the link named by its config, as its node id
            assert list(link["reporters"]) == [p.tx_cfg.node.id]
            assert tx.status()["link"]["publish_failures"] == 0
    finally:
        router.terminate()
        router.wait(timeout=10)


def test_router_down_never_stalls_transfers(pair_factory: PairFactory) -> None:
    p = pair_factory(connections=2)
    p.tx_cfg.monitor.router_url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    p.tx_cfg.monitor.router_token = "dm"
    p.start()
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t0 = time.monotonic()
        for k in range(4):
            _send(tx, f"nr-{k}", 4)
        assert all(tx.wait(f"nr-{k}", 20).ok for k in range(4))
        for k in range(4):
            rx.await_request(f"nr-{k}", timeout=10).release()
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 5
        while tx.status()["link"]["publish_failures"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tx.status()["link"]["publish_failures"] > 0
    assert "publishing link state" in (p.tx.log() if p.tx else "")
