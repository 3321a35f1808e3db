"""Graceful shutdown of real daemon processes on SIGTERM: stop taking new work, let in-flight
transfers finish within node.shutdown_drain_s, fail the rest with an outcome every engine
sees, exit 0; a second signal exits at once."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError
from xdc.transport.launcher import DaemonProcess

from tests.transport_fixtures import Pair
from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest

SIZES = [512 * 1024] * 4


def _hand(t: object, rid: str, layers: range) -> None:
    for i in layers:
        buf = t.layer_buffer(i)  # type: ignore[attr-defined]
        fill_layer(buf, rid, i)
        del buf
        t.layer_ready(i)  # type: ignore[attr-defined]


def _sigterm(d: DaemonProcess) -> float:
    d.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _wait_log(d, "graceful shutdown")
    return t0


def _wait_log(d: DaemonProcess, text: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in d.log():
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.02)


def _intact(rx: DecodeClient, rid: str, hold_s: float = 0.0) -> None:
    """``rid`` taken, checked and released, ``hold_s`` after it was taken (an engine
    copying it out takes its time)."""
    req = rx.await_request(rid, timeout=10)
    time.sleep(hold_s)
    for i, size in enumerate(req.layer_sizes):
        assert layer_digest(req.layer(i)) == expected_digest(rid, i, size), (rid, i)
    req.release()


def _settles_clean(rx_sock: str) -> None:
    with DecodeClient(rx_sock) as rx:
        deadline = time.monotonic() + 5
        while True:
            st = rx.status()
            if not st["requests"] and st["pool"]["used"] == 0:
                return
            assert time.monotonic() < deadline, st
            time.sleep(0.05)


def test_sender_finishes_in_flight_refuses_new_exits_0(pair_factory: Callable[..., Pair]) -> None:
    p = pair_factory(connections=2)
    p.tx_cfg.node.shutdown_drain_s = 8.0
    p.start()
    assert p.tx is not None
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("inflight", SIZES)
        _hand(t, "inflight", range(2))
        _sigterm(p.tx)
        with pytest.raises(TransferError) as e:
            tx.begin("late", SIZES)
        assert e.value.code == "SHUTTING_DOWN"
        time.sleep(0.3)  # the daemon keeps waiting for the engine's remaining layers
        assert p.tx.proc.poll() is None
        _hand(t, "inflight", range(2, 4))
        assert t.wait(10).ok
        _intact(rx, "inflight")
    assert p.tx.proc.wait(5) == 0
    assert "drained: 0 requests failed" in p.tx.log()
    _settles_clean(p.rx_sock)


def test_sender_fails_unfinished_at_the_deadline(pair_factory: Callable[..., Pair]) -> None:
    p = pair_factory(connections=2)
    p.tx_cfg.node.shutdown_drain_s = 1.0
    p.start()
    assert p.tx is not None
    with PrefillClient(p.tx_sock) as tx:
        t = tx.begin("stuck", SIZES)
        _hand(t, "stuck", range(1))  # the engine never hands over the rest
        t0 = _sigterm(p.tx)
        o = t.wait(10)
        waited = time.monotonic() - t0
        assert not o.ok and o.code == "SHUTDOWN", o
        assert 0.9 <= waited < 4, waited
    assert p.tx.proc.wait(5) == 0
    # the receiver was told: the partial request is gone there too, and it keeps serving
    _settles_clean(p.rx_sock)


def test_receiver_stops_accepting_and_drains(pair_factory: Callable[..., Pair]) -> None:
    p = pair_factory(connections=2)
    p.rx_cfg.node.shutdown_drain_s = 8.0
    p.start()
    assert p.rx is not None
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("inflight", SIZES)
        _hand(t, "inflight", range(1))
        rx.await_layer("inflight", 0, timeout=10)  # the receiver holds a request in flight
        _sigterm(p.rx)
        _wait_log(p.rx, "data listener closed")
        with pytest.raises(ConnectionRefusedError):  # no new data connections
            socket.create_connection(("127.0.0.1", p.rx_cfg.receiver.listen_port), timeout=2)
        # no new requests on the existing connections either; the refusal may come back
        # while the engine is still handing over, or as the outcome
        late = tx.begin("late", [4096])
        try:
            _hand(late, "late", range(1))
        except TransferError as e:
            assert "receiver is shutting down" in e.message, e
        o = late.wait(10)
        assert not o.ok and "receiver is shutting down" in o.error, o
        _hand(t, "inflight", range(1, 4))
        assert t.wait(10).ok
        # a connected decode engine may still collect it, and take its time to copy it out:
        # the drain waits for its release (it once exited under the engine, whose RELEASE
        # met a reset connection)
        _intact(rx, "inflight", hold_s=0.5)
    assert p.rx.proc.wait(5) == 0
    assert "drained: 0 transfers failed" in p.rx.log()


def test_receiver_fails_unfinished_and_sender_reports_it(
    pair_factory: Callable[..., Pair],
) -> None:
    p = pair_factory(connections=2)
    p.rx_cfg.node.shutdown_drain_s = 0.5
    p.start()
    assert p.rx is not None
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("stuck", SIZES)
        _hand(t, "stuck", range(1))
        rx.await_layer("stuck", 0, timeout=10)
        _sigterm(p.rx)
        o = t.wait(10)
        assert not o.ok and "receiver shut down" in o.error, o
    assert p.rx.proc.wait(5) == 0


def test_second_signal_exits_at_once(pair_factory: Callable[..., Pair]) -> None:
    p = pair_factory(connections=2)
    p.tx_cfg.node.shutdown_drain_s = 60.0
    p.start()
    assert p.tx is not None
    with PrefillClient(p.tx_sock) as tx:
        t = tx.begin("stuck", SIZES)
        _hand(t, "stuck", range(1))
        _sigterm(p.tx)
        time.sleep(0.2)
        assert p.tx.proc.poll() is None  # draining, for up to a minute
        t0 = time.monotonic()
        p.tx.proc.send_signal(signal.SIGTERM)
        assert p.tx.proc.wait(5) == 0
        assert time.monotonic() - t0 < 2
    assert "second signal SIGTERM: exiting now" in p.tx.log()
