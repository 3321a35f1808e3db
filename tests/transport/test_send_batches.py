"""With data threads, a connection sends the queued chunks no idle connection would take in
one hand-off to its thread (``sender.send_batch_chunks``), plain and sealed alike, against
real daemon processes: every byte still arrives where it belongs, and the sender's
``xdc_sender_chunks_per_send`` shows the batches (or their absence when batching is off)."""

from __future__ import annotations

import re
import urllib.request

import pytest
from xdc.transport.engine_client import PrefillClient
from xdc.transport.launcher import free_port

from tests.tls_fixtures import Pki
from tests.transport_fixtures import PairFactory, transfer_and_verify

CHUNK = 256 * 1024


def _sends(port: int) -> dict[str, float]:
    """The sender's chunks-per-send histogram: cumulative counts by bucket, and the sum."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {
        le: float(v)
        for le, v in re.findall(r'xdc_sender_chunks_per_send_bucket\{le="([^"]+)"\} (\S+)', text)
    }
    total = re.search(r"xdc_sender_chunks_per_send_sum (\S+)", text)
    assert total is not None, text
    out["sum"] = float(total[1])
    return out


@pytest.mark.parametrize(("record_layer", "batch"), [("plain", 4), ("sealed", 4), ("plain", 1)])
def test_queued_chunks_leave_in_batches_and_arrive_byte_exact(
    pair_factory: PairFactory, pki: Pki, record_layer: str, batch: int
) -> None:
    p = pair_factory(chunk_bytes=CHUNK, connections=1)
    for cfg, side in ((p.tx_cfg, "sender"), (p.rx_cfg, "receiver")):
        getattr(cfg, side).data_threads = "on"
    p.tx_cfg.sender.send_batch_chunks = batch
    port = p.tx_cfg.sender.status_port = free_port()
    if record_layer == "sealed":
        p.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")
        p.tx_cfg.tls = pki.config("tx", "tx.example", allowed="rx.example")
    p.start()
    # one connection and 8 layers of 8 chunks handed over at once: the queue runs deep
    transfer_and_verify(p.tx_sock, p.rx_sock, f"batched-{record_layer}", [8 * CHUNK] * 8)
    transfer_and_verify(p.tx_sock, p.rx_sock, f"batched-{record_layer}-2", [3 * CHUNK + 5] * 4)
    with PrefillClient(p.tx_sock) as tx:
        peer = next(iter(tx.status()["peers"].values()))
    want = "plain" if record_layer == "plain" else "sealed/aegis-128l"
    assert peer["records"] == {want: 1}, peer
    sends = _sends(port)
    chunks = sends["sum"]
    assert chunks >= 64 + 16, sends
    if batch == 1:
        assert sends["1.0"] == sends["+Inf"] == chunks, sends  # one chunk a send, always
    else:
        assert sends["+Inf"] < chunks, sends  # fewer sends than chunks: some were batched
        assert sends["4.0"] == sends["+Inf"], sends  # never more than the setting
