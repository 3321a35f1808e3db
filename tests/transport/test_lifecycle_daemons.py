"""The request lifecycle's rules held by real daemons, over real sockets, in the ways they were
seen broken: an intruder session on the data port, a decode engine that gave up on a call, a
receiver paused under traffic, claims and layer views, a sender killed and restarted."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
from xdc.transport.engine_client import DecodeClient, PrefillClient, Transfer, TransferError
from xdc.transport.shm import sweep_stale_segments

from tests.toxiproxy_fixtures import proxy_to
from tests.transport_fixtures import Pair, PairFactory
from xdc.lab.raw_peer import RawSender
from xdc.lab.synthetic import expected_digest, fill_layer, layer_digest
from xdc.protocol import Ack, Begin, Cancel, Error, ErrorCode, Keep, Ping, Pong
from xdc.protocol.engine_control import Alloc, Await, CancelRequest, Ready, Release, encode_request

CHUNK = 64 * 1024


def _hand_over(t: Transfer, layers: list[int]) -> None:
    for i in layers:
        buf = t.layer_buffer(i)
        fill_layer(buf, t.rid, i)
        del buf
        t.layer_ready(i)


def _intact(req: Any) -> bool:
    return all(
        layer_digest(req.layer(i)) == expected_digest(req.rid, i, size)
        for i, size in enumerate(req.layer_sizes)
    )


def _take_intact(rx: DecodeClient, rid: str) -> None:
    """The decode engine claims ``rid``, finds every byte as the engine wrote it, lets go."""
    req = rx.await_request(rid, timeout=10)
    assert _intact(req)
    req.release()


def _wait(cond: Any, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        time.sleep(0.02)


def _state(p: Pair, rid: str) -> str | None:
    with DecodeClient(p.rx_sock) as rx:
        return rx.status()["requests"].get(rid)  # type: ignore[no-any-return]


def test_an_intruder_session_cannot_land_cancel_or_rebegin_another_sessions_request(
    pair_factory: PairFactory,
) -> None:
    """Class 1: chunks for a request the session did not BEGIN were ACKed and completed it
    with the intruder's bytes."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    sizes = [4 * CHUNK] * 3
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("victim", sizes)
        _hand_over(t, [0])
        _wait(lambda: _state(p, "victim") == "receiving", what="victim receiving")
        evil = RawSender(p.rx_cfg.receiver.listen_port, session="evil-session")
        try:
            for layer, size in enumerate(sizes):
                for off in range(0, size, CHUNK):
                    evil.send_chunk("victim", layer, off, b"\xee" * CHUNK)
            evil.send(Cancel("victim", "mine now"))
            evil.send(Begin("victim", tuple(sizes), CHUNK, (), 0, 10_000))
            evil.send(Ping(7))
            said = evil.events_until(lambda ev: isinstance(ev, Pong))
        finally:
            evil.close()
        assert not any(isinstance(ev, Ack) for ev in said), said
        codes = [ev.code for ev in said if isinstance(ev, Error)]
        assert codes.count(ErrorCode.UNKNOWN_REQUEST) == 12, said
        assert ErrorCode.DUPLICATE_REQUEST in codes
        _hand_over(t, [1, 2])
        assert t.wait(20).ok
        req = rx.await_request("victim", timeout=10)
        assert _intact(req)  # the owner's bytes, every layer
        evil = RawSender(p.rx_cfg.receiver.listen_port, session="evil-session")
        try:  # a complete request is no more the intruder's than an arriving one
            evil.send_chunk("victim", 0, 0, b"\xee" * CHUNK)
            said = evil.events_until(lambda ev: isinstance(ev, Error | Ack))
            assert isinstance(said[-1], Error) and said[-1].code == ErrorCode.UNKNOWN_REQUEST
        finally:
            evil.close()
        assert _intact(req)
        req.release()
    p.assert_clean()


def test_a_decode_engine_that_gave_up_on_its_call_never_costs_a_delivered_request(
    pair_factory: PairFactory,
) -> None:
    """Class 3: the stale wait claimed the next request and it was dropped with the
    connection; now it goes back to the ready queue for the next caller."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    import socket

    quitter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    quitter.connect(p.rx_sock)
    quitter.sendall(encode_request(Await(None, 30.0), 1))
    with DecodeClient(p.rx_sock) as probe:  # its call is waiting in the daemon
        _wait(lambda: probe.status()["awaiting"] == 1, what="the quitter's call waiting")
    quitter.close()  # gave up without reading the answer
    with PrefillClient(p.tx_sock) as tx:
        t = tx.begin("kept", [3 * CHUNK])
        _hand_over(t, [0])
        assert t.wait(20).ok
    with DecodeClient(p.rx_sock) as rx:
        req = rx.await_request(timeout=10)
        assert req.rid == "kept" and _intact(req)
        req.release()
        assert rx.status()["requeued"] == 1
    p.assert_clean()


@pytest.mark.slow
def test_a_receiver_paused_under_traffic_loses_no_request(pair_factory: PairFactory) -> None:
    """Class 3, as seen: the receiver SIGSTOPped for 8 s under traffic; 424 reported
    delivered, 423 received. Now every request the sender reports delivered reaches the
    decode engine exactly once."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    n = 60
    outcomes: dict[str, bool] = {}
    received: list[str] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            with PrefillClient(p.tx_sock) as tx:
                for i in range(n):
                    t = tx.begin(f"req-{i}", [2 * CHUNK, CHUNK], deadline_s=60)
                    _hand_over(t, [0, 1])
                    outcomes[t.rid] = t.wait(70).ok
                    time.sleep(0.05)
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    def consume() -> None:
        rx: DecodeClient | None = None
        try:
            while not (done.is_set() and len(received) >= sum(outcomes.values())):
                if rx is None:
                    rx = DecodeClient(p.rx_sock)
                try:
                    req = rx.await_request(timeout=1.0)
                except TransferError:
                    if rx._broken:  # gave up on a paused daemon: a fresh connection
                        rx.close()
                        rx = None
                    continue
                assert _intact(req), req.rid
                received.append(req.rid)
                req.release()
        except BaseException as e:
            errors.append(e)
        finally:
            if rx is not None:
                rx.close()

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for th in threads:
        th.start()
    _wait(lambda: len(received) >= 10, timeout=30, what="traffic")
    assert p.rx is not None
    os.kill(p.rx.proc.pid, signal.SIGSTOP)
    time.sleep(8)
    os.kill(p.rx.proc.pid, signal.SIGCONT)
    for th in threads:
        th.join(120)
    assert not errors, errors
    delivered = {rid for rid, ok in outcomes.items() if ok}
    assert len(outcomes) == n
    assert len(received) == len(set(received)), "a request was handed out twice"
    assert delivered == set(received), (sorted(delivered - set(received)), len(delivered))
    p.assert_clean()


def test_only_the_engine_connection_that_claimed_a_request_may_release_it(
    pair_factory: PairFactory,
) -> None:
    """Class 4: another client's release freed the buffer under the first one."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as a, DecodeClient(p.rx_sock) as b:
        t = tx.begin("mine", [4 * CHUNK])
        _hand_over(t, [0])
        assert t.wait(10).ok
        req = a.await_request("mine", timeout=10)
        with pytest.raises(TransferError) as e:
            b.call(Release("mine"))
        assert e.value.code == "NOT_OWNER"
        with pytest.raises(TransferError) as e:
            b.await_request("mine", timeout=0)
        assert e.value.code == "NOT_OWNER"
        assert _intact(req)
        req.release()
        with pytest.raises(TransferError) as e:
            b.await_request("mine", timeout=0)
        assert e.value.code == "RELEASED"
    p.assert_clean()


def test_a_layer_view_keeps_its_bytes_when_its_request_fails_at_the_deadline(
    pair_factory: PairFactory,
) -> None:
    """Class 4: a view an engine held silently changed to another request's bytes when its
    request failed and the buffer was reused."""
    p = pair_factory(chunk_bytes=CHUNK, recv_pool=640 * 1024).start()
    sizes = [4 * CHUNK, 4 * CHUNK]  # 512 KiB: the pool holds one such request at a time
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("doomed", sizes, deadline_s=1.5)
        _hand_over(t, [0])  # layer 1 never comes
        view = rx.await_layer("doomed", 0, timeout=10)
        want = expected_digest("doomed", 0, sizes[0])
        assert layer_digest(view) == want
        assert t.wait(10).code == "DEADLINE"
        _wait(lambda: rx.status()["held"] == 1, what="the failed request held for its view")
        t2 = tx.begin("next", sizes, deadline_s=3)  # needs the pool the doomed one holds
        _hand_over(t2, [0, 1])
        # its BEGIN has reached the receiver, which found no room: the held buffer is not
        # handed to it while the engine's view is alive
        _wait(
            lambda: rx.status()["requests"].get("next") == "allocating",
            what="the next request waiting for room",
        )
        assert rx.status()["pool"]["allocations"] == 1, rx.status()["pool"]
        assert layer_digest(view) == want  # not reused under the engine's view
        with pytest.raises(TransferError) as e:
            rx.await_request("doomed", timeout=0)
        assert e.value.code in ("DEADLINE", "CANCELLED")  # whichever end gave up first
        rx.call(Release("doomed"))  # the engine lets go of its view
        assert t2.wait(10).ok
        _take_intact(rx, "next")
        del view
    p.assert_clean()


def test_a_restarted_sender_can_retry_its_request_at_once(pair_factory: PairFactory) -> None:
    """Class 7: retries of the request id got DUPLICATE_REQUEST until the old partial
    request's deadline, then CANCELLED."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    sizes = [4 * CHUNK] * 3
    tx = PrefillClient(p.tx_sock)
    t = tx.begin("retry-me", sizes, deadline_s=60)
    _hand_over(t, [0])
    _wait(lambda: _state(p, "retry-me") == "receiving", what="receiving")
    p.restart_sender()  # SIGKILL first: the old sender never gets to cancel anything
    tx.close()
    t0 = time.monotonic()
    with PrefillClient(p.tx_sock) as tx2, DecodeClient(p.rx_sock) as rx:
        t = tx2.begin("retry-me", sizes, deadline_s=60)
        _hand_over(t, [0, 1, 2])
        outcome = t.wait(20)
        assert outcome.ok, outcome
        assert time.monotonic() - t0 < 10
        _take_intact(rx, "retry-me")
    assert p.rx is not None and "superseded by a retry" in p.rx.log()
    p.assert_clean()


def test_a_dead_senders_partial_request_is_freed_after_the_grace_not_its_deadline(
    pair_factory: PairFactory,
) -> None:
    """Class 7: the orphaned partial request held pool space for its whole deadline
    although its session had no connection left."""
    p = pair_factory(chunk_bytes=CHUNK)
    p.rx_cfg.receiver.orphan_grace_s = 1.0
    p.start()
    tx = PrefillClient(p.tx_sock)
    t = tx.begin("orphan", [4 * CHUNK] * 2, deadline_s=120)
    _hand_over(t, [0])
    _wait(lambda: _state(p, "orphan") == "receiving", what="receiving")
    assert p.tx is not None
    p.tx.kill()  # SIGKILL: no CANCEL, nothing
    tx.close()
    assert any(name.startswith("xdc-tx-") for name in sweep_stale_segments())
    t0 = time.monotonic()
    with DecodeClient(p.rx_sock) as rx:
        _wait(lambda: rx.status()["pool"]["used"] == 0, timeout=10, what="freed")
        assert time.monotonic() - t0 < 8  # idle timeout + grace, not the 120 s deadline
        with pytest.raises(TransferError) as e:
            rx.await_request("orphan", timeout=0)
        assert e.value.code == "PEER_GONE"


def test_another_engine_connection_can_neither_fill_hand_over_nor_cancel_a_request(
    pair_factory: PairFactory,
) -> None:
    """Class 1's sibling on the engine socket: any process allowed on the sender's socket
    could write into, hand over or cancel another engine's request."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    sizes = [4 * CHUNK, 4 * CHUNK]
    with PrefillClient(p.tx_sock) as owner, PrefillClient(p.tx_sock) as other:
        t = owner.begin("owned", sizes)
        for msg in (
            Alloc("owned", (0,)),
            Ready("owned", 0, None),
            CancelRequest("owned", "mine now"),
        ):
            with pytest.raises(TransferError) as e:
                other.call(msg)
            assert e.value.code == "NOT_OWNER"
        _hand_over(t, [0, 1])
        assert t.wait(10).ok
    with DecodeClient(p.rx_sock) as rx:
        _take_intact(rx, "owned")
    p.assert_clean()


def test_a_prefill_longer_than_its_deadline_is_delivered_while_the_engine_keeps_handing_over(
    pair_factory: PairFactory,
) -> None:
    """CI saw a 3,073-token hybrid prefill on a loaded machine fail DEADLINE at 30 s with its
    link idle: the deadline counted from BEGIN. Now only a stall fails it. The engine here
    hands one layer over in parts below a chunk every 0.25 s for 3 s, four windows of 0.75 s:
    no chunk can go out until the end, so the receiver keeps the request on the sender's KEEP
    alone."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    sizes = [2 * CHUNK, CHUNK]
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t0 = time.monotonic()
        t = tx.begin("long-prefill", sizes, deadline_s=0.75)
        buf = t.layer_buffer(0)
        fill_layer(buf, "long-prefill", 0)
        for upto in range(1000, 13_000, 1000):  # 12 parts, all inside the first chunk
            t.layer_ready(0, upto)
            time.sleep(0.25)
        assert _state(p, "long-prefill") == "receiving"
        t.layer_ready(0)
        del buf
        _hand_over(t, [1])
        outcome = t.wait(10)
        assert outcome.ok, outcome
        assert time.monotonic() - t0 > 4 * 0.75
        _take_intact(rx, "long-prefill")
    p.assert_clean()


def test_an_engine_that_stops_handing_over_fails_a_window_later_and_both_ends_free_it(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory(chunk_bytes=CHUNK).start()
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t = tx.begin("stalled", [2 * CHUNK, CHUNK], deadline_s=1.0)
        buf = t.layer_buffer(0)
        fill_layer(buf, "stalled", 0)
        for upto in (CHUNK, CHUNK + 100):
            t.layer_ready(0, upto)
            time.sleep(0.5)
        t_last = time.monotonic()
        outcome = t.wait(10)  # the engine hands nothing more over
        waited = time.monotonic() - t_last
        assert outcome.code == "DEADLINE" and 0.5 <= waited < 3.0, (outcome, waited)
        assert "no progress for 1.0s" in outcome.error
        assert f"{CHUNK + 100} bytes handed over by the engine" in outcome.error
        del buf
        _wait(lambda: rx.status()["pool"]["used"] == 0, what="the receiver freed it")
    p.assert_clean()


def test_no_progress_holds_a_request_past_transfer_max_s(pair_factory: PairFactory) -> None:
    """An engine handing a few bytes over now and then cannot hold a request forever."""
    p = pair_factory(chunk_bytes=CHUNK)
    p.tx_cfg.sender.transfer_deadline_s = 1.0
    p.tx_cfg.sender.transfer_max_s = 2.0
    p.start()
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t0 = time.monotonic()
        t = tx.begin("dripping", [2 * CHUNK], deadline_s=1.0)
        buf = t.layer_buffer(0)
        upto = 0
        for _ in range(40):
            upto += 100
            try:
                t.layer_ready(0, upto)
            except TransferError:
                break  # refused at the next call once it failed
            time.sleep(0.1)
            if time.monotonic() - t0 > 3.5:
                break
        outcome = t.wait(10)
        assert outcome.code == "DEADLINE", outcome
        assert "not done within its limit of 2.0s" in outcome.error
        assert time.monotonic() - t0 < 5
        del buf
        _wait(lambda: rx.status()["pool"]["used"] == 0, what="the receiver freed it")
    p.assert_clean()


def test_the_receiver_keeps_a_request_while_its_sender_says_keep_and_frees_it_after(
    pair_factory: PairFactory,
) -> None:
    """A sender that drops a request without its CANCEL arriving stops saying KEEP, and the
    receiver frees the request a window later; while KEEPs come it waits however long."""
    p = pair_factory(chunk_bytes=CHUNK).start()
    raw = RawSender(p.rx_cfg.receiver.listen_port, session="keeper")
    try:
        raw.send(Begin("kept", (2 * CHUNK,), CHUNK, (), 0, 1000))
        raw.events_until(lambda ev: not isinstance(ev, Pong))  # its ACCEPT
        for _ in range(8):  # 2.4 s, more than two windows
            time.sleep(0.3)
            raw.send(Keep("kept"))
        assert _state(p, "kept") == "receiving"
        t_last = time.monotonic()
        _wait(lambda: _state(p, "kept") is None, timeout=10, what="freed after the KEEPs")
        assert 0.8 <= time.monotonic() - t_last < 4.0
        raw.send(Ping(1))
        said = raw.events_until(lambda ev: isinstance(ev, Pong))
        errors = [ev for ev in said if isinstance(ev, Error)]
        assert errors and errors[0].code == ErrorCode.DEADLINE and errors[0].rid == "kept"
        assert "no progress for 1.0s" in errors[0].message
    finally:
        raw.close()
    with DecodeClient(p.rx_sock) as rx:
        assert rx.status()["pool"]["used"] == 0


def test_a_thin_link_that_keeps_acknowledging_is_no_stall(
    pair_factory: PairFactory, toxiproxy: Any
) -> None:
    """16 MiB through a 4 MB/s link with an 8 MiB send pool and a 0.6 s window: the engine
    waits about a second for room before each layer after the second (longer than a window),
    while ACKs come every 65 ms. Those are progress, also for a wait that began before them."""
    mib = 1 << 20
    p = pair_factory(chunk_bytes=256 * 1024, connections=4, send_pool=8 * mib)
    proxy, port = proxy_to(toxiproxy, "thin", p.rx_cfg.receiver.listen_port)
    proxy.add_toxic(type="bandwidth", attributes={"rate": 1000}, stream="upstream")  # KB/s each
    p.tx_cfg.sender.peer_port = port
    p.start()
    with PrefillClient(p.tx_sock) as tx, DecodeClient(p.rx_sock) as rx:
        t0 = time.monotonic()
        t = tx.begin("thin", [4 * mib] * 4, deadline_s=0.6)
        _hand_over(t, [0, 1, 2, 3])
        outcome = t.wait(30)
        assert outcome.ok, outcome
        assert time.monotonic() - t0 > 3 * 0.6
        _take_intact(rx, "thin")
    p.assert_clean()
