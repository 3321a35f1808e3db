"""End to end over real loopback TCP: real sender and receiver daemon processes, engines using
the client library through shared memory and Unix sockets."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError

from tests.transport_fixtures import PairFactory
from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest


def _send(tx: PrefillClient, rid: str, sizes: list[int], **kw: object) -> None:
    t = tx.begin(rid, sizes, **kw)  # type: ignore[arg-type]
    for i in range(len(sizes)):
        buf = t.layer_buffer(i)
        fill_layer(buf, rid, i)
        del buf
        t.layer_ready(i)


def _check(req: object) -> None:
    for i, size in enumerate(req.layer_sizes):  # type: ignore[attr-defined]
        assert layer_digest(req.layer(i)) == expected_digest(req.rid, i, size), (req.rid, i)  # type: ignore[attr-defined]


def test_requests_arrive_intact_and_striped(pair_factory: PairFactory) -> None:
    p = pair_factory(connections=4, chunk_bytes=64 * 1024).start()
    sizes = {
        "r-small": [5000, 0, 70000],  # empty layer, sub-chunk and multi-chunk layers
        "r-big": [3 * 1024 * 1024 + 17] * 6,
        "r-exact": [64 * 1024 * 4] * 3,
    }
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        for rid, s in sizes.items():
            _send(tx, rid, s, block_hashes=[11, 22, 33], cached_blocks=1)
        outcomes = {rid: tx.wait(rid, 20) for rid in sizes}
        assert all(o.ok for o in outcomes.values()), outcomes
        got = set()
        for _ in sizes:
            req = rx.await_request(timeout=10)
            assert req.layer_sizes == sizes[req.rid]
            assert req.block_hashes == [11, 22, 33] and req.cached_blocks == 1
            _check(req)
            got.add(req.rid)
            req.release()
        assert got == set(sizes)
        st = tx.status()
        peer = next(iter(st["peers"].values()))
        assert peer["live_connections"] == 4
        assert st["pool"]["used"] == 0, "sender kept layer buffers after delivery"
        assert rx.status()["pool"]["used"] == 0


def test_layer_visible_before_request_complete(pair_factory: PairFactory) -> None:
    """Layer-wise: layer 0 is readable at the decode side while later layers are not even
    produced yet, and the request is not handed out as complete until the last one lands."""
    p = pair_factory(connections=2).start()
    sizes = [256 * 1024] * 4
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("lw", sizes)
        buf = t.layer_buffer(0)
        fill_layer(buf, "lw", 0)
        del buf
        t.layer_ready(0)
        layer0 = rx.await_layer("lw", 0, timeout=10)
        assert layer_digest(layer0) == expected_digest("lw", 0, sizes[0])
        with pytest.raises(TransferError) as e:
            rx.await_request("lw", timeout=0.5)
        assert e.value.code == "TIMEOUT"
        for i in range(1, 4):
            buf = t.layer_buffer(i)
            fill_layer(buf, "lw", i)
            del buf
            t.layer_ready(i)
        assert t.wait(10).ok
        req = rx.await_request("lw", timeout=10)
        _check(req)
        req.release()


def test_oversized_requests_refused_clearly(pair_factory: PairFactory) -> None:
    p = pair_factory(send_pool=8 << 20, recv_pool=16 << 20).start()
    with PrefillClient(p.tx_sock) as tx:
        with pytest.raises(TransferError) as e:
            tx.begin("too-big-layer", [16 << 20])
        assert e.value.code == "NO_SPACE"
        # fits the send pool layer by layer, but can never fit the receive pool as a whole
        try:
            _send(tx, "too-big-request", [4 << 20] * 5)
        except TransferError as e2:  # refused before every layer was handed over
            assert e2.code == "NO_SPACE", e2
        o = tx.wait("too-big-request", 10)
        assert not o.ok and o.code == "NO_SPACE", o
        assert "receive pool" in o.error
        _send(tx, "fits", [1 << 20] * 3)
        assert tx.wait("fits", 10).ok


def test_backpressure_with_small_pools(pair_factory: PairFactory) -> None:
    """Total traffic is many times both pools: producers block instead of memory growing, and
    everything still arrives intact."""
    p = pair_factory(send_pool=4 << 20, recv_pool=12 << 20, connections=3).start()
    n, sizes = 12, [1 << 20] * 8  # 8 MiB per request, 96 MiB total
    received: list[str] = []

    def consume() -> None:
        with DecodeClient(p.rx_sock) as rx:
            for _ in range(n):
                req = rx.await_request(timeout=30)
                _check(req)
                received.append(req.rid)
                req.release()

    th = threading.Thread(target=consume)
    th.start()
    with PrefillClient(p.tx_sock) as tx:
        for k in range(n):
            _send(tx, f"bp-{k}", sizes)
        outs = [tx.wait(f"bp-{k}", 30) for k in range(n)]
        peak = tx.status()["pool"]["capacity"]
    th.join(40)
    assert all(o.ok for o in outs), [o for o in outs if not o.ok]
    assert sorted(received) == sorted(f"bp-{k}" for k in range(n))
    assert peak <= 4 << 20


@pytest.mark.serial
def test_peer_gone_fails_cleanly_and_releases_everything(pair_factory: PairFactory) -> None:
    p = pair_factory(connections=2).start(receiver=False)  # nobody listens on the data port
    with PrefillClient(p.tx_sock) as tx:
        t0 = time.monotonic()
        _send(tx, "orphan", [1 << 20] * 2, deadline_s=1.5)
        o = tx.wait("orphan", 10)
        took = time.monotonic() - t0
        assert not o.ok and o.code == "DEADLINE", o
        assert 1.4 <= took < 4.0
        st = tx.status()
        assert st["pool"]["used"] == 0 and st["requests"] == {}


def test_garbage_on_data_port_does_not_disturb_transfers(pair_factory: PairFactory) -> None:
    p = pair_factory(connections=2).start()
    port = p.rx_cfg.receiver.listen_port
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        junk = socket.create_connection(("127.0.0.1", port))
        junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 4)
        junk.settimeout(5)
        reply = b""
        try:
            while chunk := junk.recv(4096):
                reply += chunk
        except OSError:
            pass
        junk.close()
        assert reply[:2] == b"XD", "receiver should answer garbage with an ERROR frame, then close"
        _send(tx, "after-junk", [300_000] * 3)
        assert tx.wait("after-junk", 10).ok
        req = rx.await_request("after-junk", timeout=10)
        _check(req)
        req.release()
        assert (
            "bad_magic" in p.receiver.log() or "MALFORMED" in p.receiver.log()
        )  # logged with a reason


def test_engine_crash_frees_sender_memory(pair_factory: PairFactory) -> None:
    p = pair_factory().start()
    tx = PrefillClient(p.tx_sock)
    t = tx.begin("half", [1 << 20] * 4)
    buf = t.layer_buffer(0)
    buf[:] = 1
    del buf
    t.layer_ready(0)
    tx.close()  # engine dies before handing over layers 1..3
    with PrefillClient(p.tx_sock) as tx2:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st = tx2.status()
            if not st["requests"] and st["pool"]["used"] == 0:
                break
            time.sleep(0.05)
        assert st["requests"] == {} and st["pool"]["used"] == 0, st


def test_numpy_views_are_zero_copy(pair_factory: PairFactory) -> None:
    p = pair_factory().start()
    with PrefillClient(p.tx_sock) as tx:
        t = tx.begin("zc", [4096])
        a = t.layer_buffer(0)
        b = np.frombuffer(tx.segment.view, dtype=np.uint8)
        assert np.shares_memory(a, b)
        a[:] = 7
        del a, b
        t.layer_ready(0)
        assert t.wait(5).ok
