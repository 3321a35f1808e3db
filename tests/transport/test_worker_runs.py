"""Runs (transport/receive_runs.py, ``receiver.worker_runs``) against a sender that breaks the
protocol: a data worker lands a sender's first sends in place on its own, so a second "first
send" of a cell it already verified is caught when its report is settled, and only that
sender's request pays for it. Each case runs over plain TCP and over mutual TLS with sealed
records (the run then opens the records itself): the peer holds a certificate of the
deployment's CA, so it is the authenticated peer that misbehaves, the case mutual TLS does
not rule out. The well-behaved cases (byte-exact transfers, a worker killed mid-run, the
fault matrix) run as the "runs" and "worker-runs" variants of test_data_workers.py and
test_transport_faults.py."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient

from tests.tls_fixtures import Pki
from tests.transport_fixtures import Pair, PairFactory, intact, produce, wait_live
from xdc.errors import ErrorCode
from xdc.lab.raw_peer import RawSender
from xdc.protocol import Accept, Ack, Begin, Complete, Error, Nack
from xdc.protocol.aead_records import HEADER, checksum_sampled

CHUNK = 64 * 1024
MakePair = Callable[[], Pair]


@pytest.fixture(params=["plain", "sealed"])
def make_pair(request: pytest.FixtureRequest, pair_factory: PairFactory, pki: Pki) -> MakePair:
    """A pair with workers and runs on its receiver; ``sealed``: mutual TLS, sealed records."""

    def make() -> Pair:
        p = pair_factory(chunk_bytes=CHUNK, connections=2)
        p.tx_cfg.sender.data_workers = p.rx_cfg.receiver.data_workers = 2
        p.rx_cfg.receiver.worker_runs = True
        if request.param == "sealed":
            p.rx_cfg.tls = pki.config("rx", "rx.example", "127.0.0.1", allowed="tx.example")
            p.tx_cfg.tls = pki.config("tx", "tx.example", allowed="rx.example")
        return p.start()

    return make


def _raw(p: Pair, session: str) -> RawSender:
    """A hand-driven session on ``p``'s receiver, with the sender's certificate if any."""
    tls = p.tx_cfg.tls if p.tx_cfg.tls.mode != "off" else None
    raw = RawSender(p.rx_cfg.receiver.listen_port, session=session, tls=tls)
    if tls is not None:
        assert raw.records is not None and raw.records.record_layer == "sealed"
    return raw


def _begun(p: Pair, session: str, rid: str, cells: int) -> RawSender:
    """A hand-driven session of ``p``'s receiver whose request ``rid`` (one layer of
    ``cells`` chunks) was accepted."""
    raw = _raw(p, session)
    raw.send(Begin(rid, (cells * CHUNK,), CHUNK, (), 0, 30_000))
    raw.events_until(lambda ev: isinstance(ev, Accept))
    return raw


def _assert_layer(rx: DecodeClient, rid: str, cells: list[bytes]) -> None:
    """The engine gets ``rid``'s one layer as exactly ``cells``."""
    req = rx.await_request(rid, timeout=10)
    try:
        assert bytes(req.layer(0)) == b"".join(cells)
    finally:
        req.release()


def _freed(rx: DecodeClient, rid: str, within_s: float) -> dict[str, Any]:
    """The receiver's status once ``rid`` has failed (or is gone) and its pool is empty,
    polled for at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        st = rx.status()
        if st["requests"].get(rid) in (None, "failed") and not st["pool"]["used"]:
            return st
        assert time.monotonic() < deadline, (st["requests"], st["pool"])
        time.sleep(0.05)


def _honest_transfer(p: Pair) -> None:
    """Another sender's request, through ``p``'s own sender: delivered byte-exact, and
    nothing is left behind."""
    wait_live(p, 2)
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        produce(tx, "honest", [4 * CHUNK] * 4)
        assert tx.wait("honest", 30).ok
        intact(rx, "honest")
    p.assert_clean()


def test_a_second_bad_first_send_of_a_verified_cell_fails_only_that_request(
    make_pair: MakePair,
) -> None:
    """The run lands a cell's "first send" again over verified bytes, and this time its
    checksum is wrong: the bytes in place are no longer the verified ones, so the request
    fails (OUT_OF_ORDER) and no engine ever gets it; another sender's request beside it is
    delivered byte-exact. (Cell 0: under sealed records with sampled checksums its chunks
    carry a checksum; another cell's would be vouched for by the records' tags alone.)"""
    p = make_pair()
    evil = _begun(p, "evil-session", "twice", 4)
    try:
        cells = [os.urandom(CHUNK) for _ in range(3)]
        for i, payload in enumerate(cells):  # the first by the daemon, then a run
            evil.send_chunk("twice", 0, i * CHUNK, payload, copy=False)
        acks = evil.events_until(lambda ev: isinstance(ev, Ack) and ev.offset == 2 * CHUNK)
        assert sum(isinstance(ev, Ack) for ev in acks) == 3, acks
        assert checksum_sampled(0, 0)
        evil.send_chunk("twice", 0, 0, os.urandom(CHUNK), copy=False, checksum=12345)
        said = evil.events_until(lambda ev: isinstance(ev, Error | Nack))
        err = said[-1]
        assert isinstance(err, Error) and err.code == ErrorCode.OUT_OF_ORDER, said
        assert err.rid == "twice" and "two first sends" in err.message
    finally:
        evil.close()
    with DecodeClient(p.rx_sock) as rx:
        st = rx.status()
        assert st["requests"].get("twice") in (None, "failed"), st["requests"]
        assert st["runs"] >= 1 and st["run_chunks"] >= 2, st
    _honest_transfer(p)


def test_a_copy_never_lands_where_a_run_could_be_writing(make_pair: MakePair) -> None:
    """With runs on, a cell sent again marked as a copy goes through scratch and is acked,
    and an unmarked chunk (a sender that says neither) is landed by the daemon as before:
    the request completes with the first sends' bytes."""
    p = make_pair()
    raw = _begun(p, "raw-session", "copies", 3)
    try:
        cells = [os.urandom(CHUNK) for _ in range(3)]
        raw.send_chunk("copies", 0, 0, cells[0], copy=False)
        raw.send_chunk("copies", 0, 0, cells[0], copy=True)
        raw.send_chunk("copies", 0, CHUNK, cells[1], copy=None)
        raw.send_chunk("copies", 0, 2 * CHUNK, cells[2], copy=False)
        said = raw.events_until(lambda ev: isinstance(ev, Error | Complete))
        assert not any(isinstance(ev, Error | Nack) for ev in said), said
        assert sum(isinstance(ev, Ack) for ev in said) == 4, said
    finally:
        raw.close()
    with DecodeClient(p.rx_sock) as rx:
        _assert_layer(rx, "copies", cells)
        assert rx.status()["duplicates"] == 1
    p.assert_clean()


def test_a_request_that_fails_mid_run_gives_its_buffer_back_while_the_sender_is_silent(
    make_pair: MakePair,
) -> None:
    """A sender sends the first cells of a request (a run leases its buffer) and then says
    nothing, its connection open. When the request's deadline fails it, the buffer is freed
    within a poll of the run's stop flag, not when the silent connection next speaks; the
    connection then carries another request byte-exact."""
    p = make_pair()
    raw = _raw(p, "quiet-session")
    try:
        raw.send(Begin("stalled", (8 * CHUNK,), CHUNK, (), 0, 1_500))
        raw.events_until(lambda ev: isinstance(ev, Accept))
        for i in range(3):
            raw.send_chunk("stalled", 0, i * CHUNK, os.urandom(CHUNK), copy=False)
        raw.events_until(lambda ev: isinstance(ev, Ack) and ev.offset == 2 * CHUNK)
        with DecodeClient(p.rx_sock) as rx:
            assert rx.status()["pool"]["used"] >= 8 * CHUNK
            # the deadline (1.5 s) and a poll, well before the connection's idle limit (5 s)
            st = _freed(rx, "stalled", 3.5)
            assert st["runs"] >= 1, st
        cells = [os.urandom(CHUNK) for _ in range(2)]
        raw.send(Begin("after", (2 * CHUNK,), CHUNK, (), 0, 30_000))
        raw.events_until(lambda ev: isinstance(ev, Accept))
        for i, payload in enumerate(cells):
            raw.send_chunk("after", 0, i * CHUNK, payload, copy=False)
        said = raw.events_until(lambda ev: isinstance(ev, Complete) and ev.rid == "after")
        assert not any(isinstance(ev, Nack) for ev in said), said
    finally:
        raw.close()
    with DecodeClient(p.rx_sock) as rx:
        _assert_layer(rx, "after", cells)
    p.assert_clean()


def test_a_first_send_again_after_completion_never_lands_under_the_engine(
    make_pair: MakePair,
) -> None:
    """A run leases every request of its session receiving now, and goes on after one of
    them completes. A sender that then sends a first send of that request's cell again
    (other bytes, their true checksum) while an engine holds the request: the run lands
    nothing in it (its lease was closed at completion), the daemon reads the chunk into
    scratch and acks it as a duplicate, the engine's bytes stay the verified ones, and the
    session's other request is delivered byte-exact."""
    p = make_pair()
    raw = _raw(p, "late-session")
    try:
        raw.send(Begin("done", (3 * CHUNK,), CHUNK, (), 0, 30_000))
        raw.send(Begin("open", (2 * CHUNK,), CHUNK, (), 0, 30_000))
        raw.events_until(lambda ev: isinstance(ev, Accept) and ev.rid == "open")
        cells = [os.urandom(CHUNK) for _ in range(3)]
        for i, payload in enumerate(cells):  # the first by the daemon, then a run
            raw.send_chunk("done", 0, i * CHUNK, payload, copy=False)
        said = raw.events_until(lambda ev: isinstance(ev, Complete) and ev.rid == "done")
        assert not any(isinstance(ev, Nack | Error) for ev in said), said
        with DecodeClient(p.rx_sock) as rx:
            assert rx.status()["run_chunks"] >= 2
            req = rx.await_request("done", timeout=10)
            try:
                assert bytes(req.layer(0)) == b"".join(cells)
                raw.send_chunk("done", 0, CHUNK, os.urandom(CHUNK), copy=False)
                said = raw.events_until(lambda ev: isinstance(ev, Ack | Error | Nack))
                assert said == [Ack("done", 0, CHUNK)], said
                assert bytes(req.layer(0)) == b"".join(cells)
            finally:
                req.release()
        more = [os.urandom(CHUNK) for _ in range(2)]
        for i, payload in enumerate(more):
            raw.send_chunk("open", 0, i * CHUNK, payload, copy=False)
        said = raw.events_until(lambda ev: isinstance(ev, Complete) and ev.rid == "open")
        assert not any(isinstance(ev, Nack | Error) for ev in said), said
    finally:
        raw.close()
    with DecodeClient(p.rx_sock) as rx:
        _assert_layer(rx, "open", more)
    p.assert_clean()


@pytest.mark.parametrize("make_pair", ["sealed"], indirect=True)
def test_a_forged_record_mid_payload_of_a_run_loses_the_connection_not_the_daemon(
    make_pair: MakePair,
) -> None:
    """Mid-payload of a chunk a run is landing, a record that was never sealed with the
    connection's key (an authenticated peer's own bytes under the records, or anyone on the
    path): the worker's open fails, the connection is lost, no engine gets the request, its
    buffer comes back at its deadline, and the daemon serves the next transfer byte-exact."""
    p = make_pair()
    raw = _raw(p, "forger-session")
    try:
        raw.send(Begin("forged", (4 * CHUNK,), CHUNK, (), 0, 1_500))
        raw.events_until(lambda ev: isinstance(ev, Accept))
        for i in range(2):  # the first by the daemon, then a run
            raw.send_chunk("forged", 0, i * CHUNK, os.urandom(CHUNK), copy=False)
        raw.events_until(lambda ev: isinstance(ev, Ack) and ev.offset == CHUNK)
        raw.send_chunk("forged", 0, 2 * CHUNK, os.urandom(CHUNK), upto=CHUNK // 2, copy=False)
        tag = 32  # AEGIS-128L's tag (the longest): a length the opener accepts either way
        raw.write_raw(HEADER.pack(CHUNK // 2 + tag) + os.urandom(CHUNK // 2 + tag))
        with pytest.raises(ConnectionError):
            raw.events_until(lambda ev: False, timeout=5)
    finally:
        raw.close()
    with DecodeClient(p.rx_sock) as rx:
        assert _freed(rx, "forged", 5)["runs"] >= 1
    _honest_transfer(p)
