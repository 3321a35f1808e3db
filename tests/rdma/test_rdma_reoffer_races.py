"""RDMA in the daemons across link failures, re-offers and frame races: RDMA comes back
after reconnects and failures (``rdma.reoffer_s`` backoff), a grant of a replaced queue pair
is never used, a CANCEL that overtakes its BEGIN or a close that overtakes its answer loses
nothing, LAYER_DONE before the WRITEs frees nothing. (Written as the second adversarial
review, after tests/rdma/test_rdma_adversarial.py.) Harness: both
daemons in this process over the fake verbs fabric, engines in threads, the test steering
frame order (holding a frame back, as a slow connection would) where a race decides.

The four bugs it first kept as strict xfails are fixed (issue 13); see the docstrings.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import trio
from xdc.transport.engine_client import Outcome, PrefillClient
from xdc.transport.peer_link import PeerLink
from xdc.transport.rdma.peer_sender import PeerRdma
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.wire import WireConn

from tests.rdma_fixtures import (
    LAYERS,
    PATIENT,
    RDMA,
    FreeGuard,
    Gate,
    PostGuard,
    Restartable,
    Rig,
    all_ok,
    any_wire,
    assert_no_leaks,
    check_delivered,
    daemon_pair,
    in_engine_thread,
    in_trio,
    is_granted,
    logged,
    make_payloads,
    new_fabric,
    partial_handover,
    pools_empty,
    rdma_done,
    send_payloads,
)
from xdc.config import Config
from xdc.protocol import (
    Accept,
    Begin,
    Cancel,
    Complete,
    Event,
    Hello,
    LayerDone,
    Nack,
    RdmaAnswer,
    RdmaClose,
    RdmaOffer,
)
from xdc.protocol.books.send import TxRequest

QUICK_REOFFER = replace(RDMA, reoffer_s=0.2)


def _fell_back(rdma: PeerRdma, times: int) -> bool:
    return rdma.fallbacks >= times


@contextlib.contextmanager
def _log_lines() -> Iterator[list[str]]:
    """Every message an xdc logger writes while the block runs (INFO and up)."""
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("xdc")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# --- the sender's connections all drop and come back to the same receiver ----------------


def test_rdma_comes_back_after_all_connections_reconnect(tmp_path: Path) -> None:
    """A network blip (or the sender pausing past the receiver's idle timeout) drops every
    data connection of the sender at once; the receiver, seeing the session gone, destroys
    its queue pair. The connections come back to the same receiver session. RDMA must come
    back too (offered again, as after any link failure), and the next requests go by RDMA."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        session = rig.sender.session
        for wire in list(rig.receiver.session_wires[session]):
            wire.sock.shutdown(socket.SHUT_RDWR)
        await rig.until(lambda: session not in rig.receiver.rdma)
        await rig.until(lambda: len(rig.peer.live) == 2 and session in rig.receiver.session_wires)
        # the same receiver: no restart, so only the link's own recovery can bring RDMA back
        assert rig.peer.peer_session == rig.receiver.session
        await rig.until(lambda: session in rig.receiver.rdma, timeout=3.0)
        await rig.until(lambda: rig.backend() == "rdma")
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0  # by RDMA, not TCP

    def configure(tx: Config, rx: Config) -> None:
        tx.sender.reconnect_backoff_s = 0.5  # both are gone at the receiver before either is back

    trio.run(
        functools.partial(
            daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=QUICK_REOFFER, configure=configure
        )
    )
    assert_no_leaks(fabric)


# --- grants and re-BEGINs ------------------------------------------------------------------


def test_regranted_request_that_fails_is_released_promptly(tmp_path: Path) -> None:
    """The receiver GRANTs a request, and the connection dies before its ACCEPT goes out. The
    sender BEGINs it again on another connection and is ACCEPTed there (the request goes on
    by TCP). When the receiver then fails it (its deadline), the buffer must be freed
    promptly and the queue pair must stay: nothing was ever written to it by RDMA."""
    fabric = new_fabric()
    rid = "regrant"
    cut: list[WireConn] = []

    def cut_at_accept(rig: Rig) -> None:
        send = rig.receiver._send_quiet

        async def send_quiet(wire: WireConn, ev: Any) -> bool:
            if isinstance(ev, Accept) and ev.rid == rid and not cut:
                cut.append(wire)  # the GRANT went out on it just before; now it dies
                wire.sock.shutdown(socket.SHUT_RDWR)
                return False
            return await send(wire, ev)

        rig.receiver._send_quiet = send_quiet  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        outcomes = await in_engine_thread(
            functools.partial(partial_handover, split=1, hand_rest=False, deadline_s=20),
            rig.sender.sc.control_socket,
            [rid],
            {rid: [bytes(n) for n in LAYERS]},
            lambda: None,
        )
        assert cut, "the connection carrying the GRANT was not cut"
        out = outcomes[rid]
        assert out.code == "DEADLINE" and "receiver" in out.error, out  # the receiver's 1 s
        # ~1.2 s after the failure (not 2 x stall_timeout + idle_timeout = 5 s)
        await rig.until(lambda: rig.receiver.status()["quarantined"] == 0, timeout=1.2)
        await rig.until(lambda: rig.receiver.pool.allocator.used_bytes == 0, timeout=1.0)
        assert rig.backend() == "rdma" and rig.sender.session in rig.receiver.rdma

    def configure(tx: Config, rx: Config) -> None:
        rx.receiver.transfer_deadline_s = 1.0
        rx.receiver.transfer_max_s = 1.0  # its own limit: the sender's KEEPs hold the window

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            configure=configure,
            before_start=cut_at_accept,
        )
    )
    assert_no_leaks(fabric)


def test_cancel_that_overtakes_its_begin_leaves_nothing_held(tmp_path: Path) -> None:
    """The engine cancels a request right after the sender sent its BEGIN; the CANCEL goes on
    another connection and reaches the receiver first (the BEGIN's connection is slow, here
    made so by holding the BEGIN back until the CANCEL was handled). Whatever the receiver
    does with the late BEGIN, it must not end up holding the request's buffer in quarantine
    for a sender that will never CANCEL again."""
    fabric = new_fabric()
    rid = "overtaken"
    begin_seen, cancel_handled = trio.Event(), trio.Event()

    def hold_begin(rig: Rig) -> None:
        receiver = rig.receiver
        on_begin, on_cancel = receiver._on_begin, receiver._on_cancel

        def late_begin(wire: WireConn, hello: Hello, begin: Begin) -> None:
            if begin.rid != rid or cancel_handled.is_set():
                on_begin(wire, hello, begin)
                return
            begin_seen.set()

            async def later() -> None:
                await cancel_handled.wait()
                on_begin(wire, hello, begin)

            receiver._nursery.start_soon(later)

        def cancel(session: str, ev: Cancel) -> None:
            on_cancel(session, ev)
            if ev.rid == rid:
                cancel_handled.set()

        receiver._on_begin = late_begin  # type: ignore[method-assign]
        receiver._on_cancel = cancel  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        token = trio.lowlevel.current_trio_token()

        def engine() -> Outcome:
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                t = pc.begin(rid, LAYERS, deadline_s=20)
                trio.from_thread.run(begin_seen.wait, trio_token=token)
                pc.cancel(rid, "the engine gave up")
                return t.wait(5)

        out = await in_engine_thread(engine)
        assert out.code == "CANCELLED", out
        await cancel_handled.wait()
        # the late request, if the receiver took it at all, is gone after its 1 s deadline
        await rig.until(lambda: rid not in rig.receiver.requests, timeout=2.0)
        await rig.until(lambda: rig.receiver.status()["quarantined"] == 0, timeout=1.0)
        await rig.until(lambda: rig.receiver.pool.allocator.used_bytes == 0, timeout=1.0)
        assert rig.backend() == "rdma" and rig.sender.session in rig.receiver.rdma

    def configure(tx: Config, rx: Config) -> None:
        rx.receiver.transfer_deadline_s = 1.0
        rx.receiver.transfer_max_s = 1.0  # its own limit: the sender's KEEPs hold the window

    trio.run(
        functools.partial(
            daemon_pair, tmp_path, body, fabric=fabric, configure=configure, before_start=hold_begin
        )
    )
    assert_no_leaks(fabric)


# --- grants across a re-offer --------------------------------------------------------------


def test_a_grant_of_a_replaced_queue_pair_is_never_used(tmp_path: Path) -> None:
    """Request A is GRANTed a slot on the first queue pair; its ACCEPT is slow to come. The
    pair fails (here the receiver's landing loop gives up) and the sender offers RDMA again
    after rdma.reoffer_s: a second pair, same receiver session, whose slots start afresh.
    Request B is then BEGUN and granted on the new pair (not handed over yet), and only now
    does A's ACCEPT arrive. A must not be written with the first pair's grant: B's buffer
    must have nothing counted as received that B never sent, and both must arrive intact."""
    fabric = new_fabric()
    payloads = make_payloads(2)
    a, b = sorted(payloads)
    accept_held, release_accept = trio.Event(), trio.Event()

    def hold_accept(rig: Rig) -> None:
        send = rig.receiver._send_quiet

        async def send_quiet(wire: WireConn, ev: Any) -> bool:
            if isinstance(ev, Accept) and ev.rid == a:
                accept_held.set()
                await release_accept.wait()
            return await send(wire, ev)

        rig.receiver._send_quiet = send_quiet  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        session = rig.sender.session
        token = trio.lowlevel.current_trio_token()

        def new_pair_up(old: Any) -> bool:
            sess = rig.receiver.rdma.get(session)
            remote = rig.peer.rdma.remote if rig.peer.rdma is not None else None
            return sess not in (None, old) and remote is not None and remote.qp_num == sess.qp_num

        async def replace_pair() -> None:
            await accept_held.wait()
            await rig.until(lambda: is_granted(rig.sender, a))  # GRANT arrived
            old = rig.receiver.rdma[session]
            rig.receiver._close_rdma(session, "landing loop failed (test)", tell=True)
            await rig.until(lambda: new_pair_up(old))

        async def release_then_check() -> None:
            requests = rig.receiver.requests
            await rig.until(lambda: b in requests and requests[b].rdma_hold)
            release_accept.set()

            def settled() -> bool:
                got = requests.get(b)
                counted = got is not None and got.tracker is not None and got.tracker.verified_bytes
                return a in rig.sender.book.ended or bool(counted)

            await rig.until(settled)
            got = requests[b]
            assert got.tracker is not None and got.tracker.verified_bytes == 0, (
                f"{got.tracker.verified_bytes if got.tracker else '?'} bytes of {b} counted "
                "as received before its engine handed any layer over"
            )
            assert rig.receiver.rdma[session].zone.stale_writes == 0

        def engine() -> dict[str, Outcome]:
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                ta = pc.begin(a, LAYERS, deadline_s=8)
                for layer, data in enumerate(payloads[a]):
                    ta.put_layer(layer, data)
                trio.from_thread.run(replace_pair, trio_token=token)
                tb = pc.begin(b, LAYERS, deadline_s=8)
                trio.from_thread.run(release_then_check, trio_token=token)
                for layer, data in enumerate(payloads[b]):
                    tb.put_layer(layer, data)
                return {a: ta.wait(10), b: tb.wait(10)}

        all_ok(await in_engine_thread(engine))
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        await pools_empty(rig)

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=QUICK_REOFFER,
            before_start=hold_accept,
        )
    )
    assert_no_leaks(fabric)


# --- a slot given again while completions naming it are still queued ------------------------


def test_a_cancelled_slot_is_not_reused_under_queued_completions(tmp_path: Path) -> None:
    """Request A's WRITEs land and complete at the sender, but the receiver's landing loop
    lags behind (held here, as a congested reply connection would hold it) so their receive
    completions wait in its CQ. The engine cancels A: the sender sees no WRITE in flight and
    CANCELs, and the receiver frees A's buffer and slot. Request N is BEGUN, gets the same
    pool region and slot, and hands nothing over yet. When the landing loop catches up, A's
    old completions must not count as N's chunks (they name N's slot, and N's buffer holds
    A's bytes): N must have nothing received until its own engine hands its layers over."""
    fabric = new_fabric()
    payloads = make_payloads(2)
    a, n = sorted(payloads)
    later = (5, 6, 7, 8, 9, 10)  # chunk indices of layers 2 and 3 (LAYERS, 64 KiB chunks)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        session = rig.sender.session
        sess = rig.receiver.rdma[session]
        assert sess.ep.qp is not None
        fq = sess.ep.qp.native  # the receiver's fake QP: its CQ and its posted receives
        gate = Gate(rig.receiver)
        token = trio.lowlevel.current_trio_token()

        async def layers_written() -> None:
            assert rig.peer.rdma is not None and rig.peer.rdma.writer is not None
            out = rig.peer.rdma.writer.requests[a]
            await rig.until(lambda: set(later) <= out.placed and not out.posted)
            assert len(fq.rcq.entries) >= len(later)  # landed, not yet seen by the receiver

        async def cancel_handled() -> None:
            await rig.until(lambda: a not in rig.receiver.requests)

        async def open_when_granted() -> None:
            requests = rig.receiver.requests
            await rig.until(lambda: n in requests and requests[n].rdma_hold)
            gate.open()
            await rig.until(
                lambda: not fq.rcq.entries and len(fq.recvs) == sess.settings.recv_depth
            )
            got = requests[n].tracker
            assert got is not None and got.verified_bytes == 0, (
                f"{got.verified_bytes if got else '?'} bytes of {n} counted as received "
                "before its engine handed any layer over"
            )

        def engine() -> dict[str, Outcome]:
            def trio_run(fn: Any) -> None:
                trio.from_thread.run(fn, trio_token=token)

            with PrefillClient(rig.sender.sc.control_socket) as pc:
                ta = pc.begin(a, LAYERS, deadline_s=8)
                ta.put_layer(0, payloads[a][0])
                trio_run(gate.held.wait)  # layer 0 landed; the landing loop is held
                ta.put_layer(2, payloads[a][2])
                ta.put_layer(3, payloads[a][3])
                trio_run(layers_written)
                pc.cancel(a, "the engine gave up")
                trio_run(cancel_handled)
                tn = pc.begin(n, LAYERS, deadline_s=8)
                trio_run(open_when_granted)
                for layer, data in enumerate(payloads[n]):
                    tn.put_layer(layer, data)
                return {a: ta.wait(5), n: tn.wait(10)}

        outcomes = await in_engine_thread(engine)
        assert outcomes[a].code == "CANCELLED" and outcomes[n].ok, outcomes
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, {n: payloads[n]})
        await pools_empty(rig)
        assert rig.receiver.status()["quarantined"] == 0

    trio.run(
        functools.partial(
            daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=PATIENT, rx_rdma=PATIENT
        )
    )
    assert_no_leaks(fabric)


# --- what the sender believes of the receiver ---------------------------------------------


def test_layer_done_before_its_chunks_were_written_frees_nothing(tmp_path: Path) -> None:
    """The first review made the sender ignore a LAYER_DONE for a layer not handed over yet.
    A layer that *was* handed over but whose chunks still wait for send-queue room (a small
    rdma.max_inflight, a receiver that lags) is the same case: the receiver cannot have
    received them, the buffer is still the only copy, and freeing it lets the pool give it
    to another layer while the queued WRITEs will read it."""
    fabric = new_fabric()
    payloads = make_payloads(1)
    (rid,) = payloads
    last = (12, 13)  # chunk indices of the last layer (LAYERS, 64 KiB chunks)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        assert rig.peer.rdma is not None and rig.peer.rdma.ep is not None
        posts = PostGuard(rig, rig.peer.rdma.ep.verbs)
        gate = Gate(rig.receiver)
        token = trio.lowlevel.current_trio_token()

        async def lie() -> None:
            await gate.held.wait()  # layer 0 landed; nothing more is received for now
            assert rig.peer.rdma is not None and rig.peer.rdma.writer is not None
            out = rig.peer.rdma.writer.requests[rid]
            await rig.until(lambda: set(last) <= set(out.pending))
            wire = any_wire(rig)
            async with logged(rig, "names no chunk to rewrite; ignored"):
                await wire.send(LayerDone(rid, len(LAYERS) - 1))
                await wire.send(Nack(rid, 99, 0, "sentinel"))  # handled after the lie
            gate.open()

        outcomes = await in_engine_thread(
            functools.partial(partial_handover, split=len(LAYERS), deadline_s=6.0),
            rig.sender.sc.control_socket,
            [rid],
            payloads,
            in_trio(token, lie),
        )
        assert posts.posted > 0
        assert posts.errors == [], posts.errors
        all_ok(outcomes)
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        await pools_empty(rig)

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=replace(PATIENT, max_inflight=2),
            rx_rdma=replace(PATIENT, recv_depth=2),
        )
    )
    assert_no_leaks(fabric)


# --- the receiver's word over RDMA is sent once ------------------------------------------


def test_complete_lost_with_its_connection_still_reaches_the_sender(tmp_path: Path) -> None:
    """The connection that carried a request's BEGIN dies just as the receiver sends its
    COMPLETE (every byte landed by RDMA and was verified). Over TCP the sender would resend
    its unacked chunks on another connection and be ACKed; over RDMA it must learn of the
    completion too: the engine's outcome is 'delivered', not a DEADLINE failure for a
    request the decode engine has."""
    fabric = new_fabric()
    payloads = make_payloads(1)
    (rid,) = payloads
    cut: list[WireConn] = []

    def cut_at_complete(rig: Rig) -> None:
        send = rig.receiver._send_quiet

        async def send_quiet(wire: WireConn, ev: Any) -> bool:
            if isinstance(ev, Complete) and ev.rid == rid and not cut:
                cut.append(wire)
                wire.sock.shutdown(socket.SHUT_RDWR)  # the frame dies with its connection
            return await send(wire, ev)

        rig.receiver._send_quiet = send_quiet  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        outcomes = await in_engine_thread(
            functools.partial(partial_handover, split=len(LAYERS), deadline_s=3.0),
            rig.sender.sc.control_socket,
            [rid],
            payloads,
            lambda: None,
        )
        assert cut, "the COMPLETE's connection was not cut"
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0
        await pools_empty(rig)

    trio.run(
        functools.partial(daemon_pair, tmp_path, body, fabric=fabric, before_start=cut_at_complete)
    )
    assert_no_leaks(fabric)


# --- offering again ------------------------------------------------------------------------


def test_unanswered_offers_do_not_add_up_across_link_failures(tmp_path: Path) -> None:
    """Every other offer goes unanswered (the answer is lost or too slow); the next one gets
    through. After each link failure the sender offers again (rdma.reoffer_s), so RDMA must
    come back every time: "3 tries" bounds one negotiation, not the receiver's lifetime."""
    fabric = new_fabric()
    offers: list[str] = []

    def answer_every_other_offer(rig: Rig) -> None:
        answer = rig.receiver._on_rdma_offer

        async def maybe(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            offers.append(hello.session)
            if len(offers) % 2 == 1:
                return  # never answered
            await answer(wire, hello, offer)

        rig.receiver._on_rdma_offer = maybe  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        session = rig.sender.session
        rdma = rig.peer.rdma
        assert rdma is not None
        for failures in range(3):
            await rig.until(lambda: session in rig.receiver.rdma and rig.backend() == "rdma", 3.0)
            assert len(offers) == 2 * (failures + 1), offers
            rig.receiver._close_rdma(session, "landing loop failed (test)", tell=True)
            await rig.until(functools.partial(_fell_back, rdma, failures + 1))
        await rig.until(lambda: session in rig.receiver.rdma and rig.backend() == "rdma")
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    def configure(tx: Config, rx: Config) -> None:
        tx.sender.connect_timeout_s = 0.3

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=QUICK_REOFFER,
            configure=configure,
            before_start=answer_every_other_offer,
        )
    )
    assert_no_leaks(fabric)


def test_a_new_receiver_starts_a_new_reoffer_backoff(tmp_path: Path) -> None:
    """The backoff is per receiver session (a new session is a new link: _rdma_loop resets
    its count when a new session appears while it waits idle). A receiver that restarts
    while the sender waits out a backoff is just as new: its first failure is offered again
    after rdma.reoffer_s, not after the doubled wait earned by its predecessor."""
    fabric = new_fabric()
    pair = Restartable(tmp_path, fabric, rdma=replace(RDMA, reoffer_s=1.0))

    def close_link(why: str) -> None:
        pair.receiver._close_rdma(pair.sender.session, why, tell=True)

    async def main() -> None:
        with trio.fail_after(20), _log_lines() as lines:
            async with trio.open_nursery() as n:
                await pair.start_receiver(n)
                await n.start(pair.sender.serve)
                rig = pair.rig
                assert (await rig.negotiated())["backend"] == "rdma"
                session = pair.sender.session
                first = pair.receiver.session

                def waits() -> list[str]:
                    return [m for m in lines if "rdma offered again in" in m]

                close_link("first failure (test)")
                await rig.until(lambda: len(waits()) == 1)
                await rig.until(lambda: session in pair.receiver.rdma and rig.backend() == "rdma")
                close_link("second failure (test)")
                await rig.until(lambda: len(waits()) == 2)  # now waiting 2 x reoffer_s
                await pair.restart_receiver(n)
                rig = pair.rig
                await rig.until(lambda: rig.peer.peer_session not in (None, first))
                await rig.until(lambda: session in pair.receiver.rdma and rig.backend() == "rdma")
                close_link("the new receiver's first failure (test)")
                await rig.until(lambda: len(waits()) == 3)
                assert waits() == [
                    *waits()[:2],
                    f"peer {rig.peer.name}: rdma offered again in 1s",
                ], waits()
                n.cancel_scope.cancel()

    trio.run(main)
    assert_no_leaks(fabric)


def test_a_late_answer_is_not_taken_for_the_next_offer(tmp_path: Path) -> None:
    """The receiver is slow to answer the first offer (registering a large pool can take
    seconds): the sender times out and offers again, and the receiver replaces its first
    queue pair with a second. The first answer then arrives while the sender waits for the
    second. The sender must end up connected to the second pair: requests go by RDMA with
    no link failure, rather than failing over to TCP at the first WRITE."""
    fabric = new_fabric()
    offers: list[RdmaOffer] = []
    second_offer, release_second = trio.Event(), trio.Event()

    def answer_first_offer_late(rig: Rig) -> None:
        receiver = rig.receiver
        answer = receiver._on_rdma_offer

        class Later:
            """Sends the answer from another task once ``until`` is set."""

            def __init__(self, wire: WireConn, until: trio.Event) -> None:
                self.wire, self.until = wire, until

            async def send(self, ev: RdmaAnswer) -> None:
                async def later() -> None:
                    await self.until.wait()
                    await receiver._send_quiet(self.wire, ev)

                receiver._nursery.start_soon(later)

        async def offer(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            offers.append(offer)
            if len(offers) == 1:  # answered only once the next offer is in
                await answer(Later(wire, second_offer), hello, offer)  # type: ignore[arg-type]
            elif len(offers) == 2:
                second_offer.set()
                await answer(Later(wire, release_second), hello, offer)  # type: ignore[arg-type]
            else:
                await answer(wire, hello, offer)

        receiver._on_rdma_offer = offer  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        session = rig.sender.session
        rdma = rig.peer.rdma
        assert rdma is not None
        await second_offer.wait()
        with trio.move_on_after(0.5):  # the sender takes the late first answer, or waits
            await rig.until(lambda: rdma.remote is not None)
        release_second.set()
        await rig.until(lambda: rig.backend() == "rdma" and session in rig.receiver.rdma)
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rdma.fallbacks == 0, rdma.status()
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    def configure(tx: Config, rx: Config) -> None:
        tx.sender.connect_timeout_s = 1.0

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            configure=configure,
            before_start=answer_first_offer_late,
        )
    )
    assert_no_leaks(fabric)


def test_a_close_that_overtakes_its_answer_is_not_lost(tmp_path: Path) -> None:
    """The receiver sets a queue pair up for an offer and answers, then gives the pair up at
    once (its landing loop failed); its RDMA_CLOSE reaches the sender before the answer does
    (here both on the offer's connection, close first). The sender must not end up on a
    pair that is gone: it offers again (rdma.reoffer_s) and requests go by RDMA."""
    fabric = new_fabric()
    offers: list[RdmaOffer] = []

    def close_before_answering(rig: Rig) -> None:
        receiver = rig.receiver
        answer = receiver._on_rdma_offer

        class CloseFirst:
            def __init__(self, wire: WireConn, session: str) -> None:
                self.wire, self.session = wire, session

            async def send(self, ev: RdmaAnswer) -> None:
                sess = receiver.rdma[self.session]
                receiver._close_rdma(self.session, "landing loop failed (test)", tell=False)
                await receiver._send_quiet(self.wire, RdmaClose(sess.qp_num, "landing failed"))
                await receiver._send_quiet(self.wire, ev)

        async def offer(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            offers.append(offer)
            if len(offers) == 1:
                await answer(CloseFirst(wire, hello.session), hello, offer)  # type: ignore[arg-type]
            else:
                await answer(wire, hello, offer)

        receiver._on_rdma_offer = offer  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        session = rig.sender.session
        await rig.until(lambda: bool(offers) and session not in rig.receiver.rdma)
        await rig.until(lambda: session in rig.receiver.rdma and rig.backend() == "rdma", 3.0)
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    def configure(tx: Config, rx: Config) -> None:
        tx.sender.connect_timeout_s = 0.5  # a fix may treat the answer as none: offer again

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=QUICK_REOFFER,
            configure=configure,
            before_start=close_before_answering,
        )
    )
    assert_no_leaks(fabric)


def test_a_refused_reoffer_is_retried_with_the_backoff(tmp_path: Path) -> None:
    """The receiver's RDMA port goes down: the link fails, and when the sender offers again
    the receiver has no usable device and refuses ('no usable rdma device'). The port comes
    back. Re-offering exists so that a failed link is not forever: the refused re-offer is
    one more failure, and RDMA must be offered again after the (doubled) backoff."""
    fabric = new_fabric()
    port_up = [True]

    def flappy_port(rig: Rig) -> None:
        verbs = rig.receiver.rdma_deps.verbs

        def probe() -> tuple[list[str], str]:
            return (["rxe1"], "test probe") if port_up[0] else ([], "rxe1 port 1 is DOWN")

        rig.receiver.rdma_deps = RdmaDeps(verbs, probe)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        session = rig.sender.session
        rdma = rig.peer.rdma
        assert rdma is not None
        port_up[0] = False
        rig.receiver._close_rdma(session, "port went down (test)", tell=True)
        await rig.until(lambda: "no usable rdma device" in rdma.reason)  # re-offer refused
        port_up[0] = True
        await rig.until(lambda: session in rig.receiver.rdma and rig.backend() == "rdma", 3.0)
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=QUICK_REOFFER,
            before_start=flappy_port,
        )
    )
    assert_no_leaks(fabric)


# --- what works: backoff, every request state across a failure, quarantine --------------


def test_repeated_link_failures_back_off_and_rdma_comes_back(tmp_path: Path) -> None:
    """Three link failures in a row (the fabric breaks under a transfer, which finishes over
    TCP): each time the sender waits at least rdma.reoffer_s x 2^(n-1) before offering
    again, and each time RDMA comes back and carries the next request."""
    fabric = new_fabric()
    reoffer = 0.3
    offered_at: list[float] = []
    fell_back_at: list[float] = []

    def record(rig: Rig) -> None:
        answer = rig.receiver._on_rdma_offer

        async def offer(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            offered_at.append(trio.current_time())
            await answer(wire, hello, offer)

        rig.receiver._on_rdma_offer = offer  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        session = rig.sender.session
        rdma = rig.peer.rdma
        assert rdma is not None
        run = rdma.run

        async def timed_run(tell_peer: Callable[[Event], None]) -> None:
            await run(tell_peer)
            fell_back_at.append(trio.current_time())

        rdma.run = timed_run  # type: ignore[method-assign]
        rx, tx = rig.receiver.rc.control_socket, rig.sender.sc.control_socket
        by_tcp = 0
        for k in range(3):
            await rig.until(lambda: session in rig.receiver.rdma and rig.backend() == "rdma", 4.0)
            assert len(offered_at) == k + 1
            all_ok(await in_engine_thread(send_payloads, rx, tx, make_payloads(1)))
            assert rig.sender.metrics.bytes_sent._value.get() == by_tcp  # that one by RDMA
            fabric.link_broken = True
            all_ok(
                await in_engine_thread(send_payloads, rx, tx, make_payloads(1))
            )  # finished over TCP
            await rig.until(functools.partial(_fell_back, rdma, k + 1))
            fabric.link_broken = False
            by_tcp = rig.sender.metrics.bytes_sent._value.get()
        await rig.until(lambda: session in rig.receiver.rdma and rig.backend() == "rdma", 4.0)
        all_ok(await in_engine_thread(send_payloads, rx, tx, make_payloads(1)))
        assert rig.sender.metrics.bytes_sent._value.get() == by_tcp
        waits = [offered_at[k + 1] - fell_back_at[k] for k in range(3)]
        assert all(w >= reoffer * 2**k for k, w in enumerate(waits)), waits
        await pools_empty(rig)

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=replace(RDMA, reoffer_s=reoffer),
            before_start=record,
        )
    )
    assert_no_leaks(fabric)


def test_requests_in_every_state_across_a_failure_and_a_reoffer(tmp_path: Path) -> None:
    """One link failure with requests in every state: C complete by RDMA and not yet taken
    by the decode engine, A half written by RDMA (finishes over TCP), B BEGUN but not yet
    accepted (its BEGIN reaches the receiver only once the new queue pair is up: granted
    there, it goes by RDMA). E is new after the re-offer. All arrive intact, B and E by the
    new pair, and no buffer is freed under a WRITE on either side."""
    fabric = new_fabric()
    payloads = make_payloads(4)
    a, b, c, e = sorted(payloads)
    b_held, release_b = trio.Event(), trio.Event()

    def hold_b(rig: Rig) -> None:
        receiver = rig.receiver
        on_begin = receiver._on_begin

        def late(wire: WireConn, hello: Hello, begin: Begin) -> None:
            if begin.rid != b or release_b.is_set():
                on_begin(wire, hello, begin)
                return
            b_held.set()

            async def later() -> None:
                await release_b.wait()
                on_begin(wire, hello, begin)

            receiver._nursery.start_soon(later)

        receiver._on_begin = late  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        session = rig.sender.session
        first = rig.receiver.rdma[session]
        rdma = rig.peer.rdma
        assert rdma is not None
        guard = FreeGuard(rig)
        token = trio.lowlevel.current_trio_token()

        async def a_on_rdma() -> None:
            await rig.until(lambda: 0 in rdma_done(rig.sender, a))
            await b_held.wait()
            fabric.link_broken = True  # A's next WRITE fails

        async def new_pair() -> None:
            await rig.until(lambda: rdma.fallbacks == 1)
            fabric.link_broken = False
            await rig.until(
                lambda: (
                    rig.receiver.rdma.get(session) not in (None, first) and rig.backend() == "rdma"
                )
            )
            release_b.set()

        def engine() -> dict[str, Outcome]:
            def put(t: Any, rid: str, layers: range) -> None:
                for layer in layers:
                    t.put_layer(layer, payloads[rid][layer])

            every = range(len(LAYERS))
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                tc = pc.begin(c, LAYERS)
                put(tc, c, every)
                assert tc.wait(10).ok
                ta = pc.begin(a, LAYERS, deadline_s=15)
                put(ta, a, range(3))
                tb = pc.begin(b, LAYERS, deadline_s=15)
                trio.from_thread.run(a_on_rdma, trio_token=token)
                put(ta, a, range(3, 4))
                trio.from_thread.run(new_pair, trio_token=token)
                put(tb, b, every)
                put(ta, a, range(4, len(LAYERS)))
                te = pc.begin(e, LAYERS, deadline_s=15)
                put(te, e, every)
                return {rid: t.wait(15) for rid, t in ((a, ta), (b, tb), (e, te))}

        all_ok(await in_engine_thread(engine))
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        assert rdma.fallbacks == 1
        assert 0 < rig.sender.metrics.bytes_sent._value.get() < sum(LAYERS)  # part of A only
        (sess,) = rig.receiver.status()["rdma"].values()
        assert sess["landed_bytes"] == 2 * sum(LAYERS) and sess["stale_writes"] == 0  # B, E
        await pools_empty(rig)
        assert guard.errors == [] and guard.checked > 0
        assert rig.receiver.status()["quarantined"] == 0

    trio.run(
        functools.partial(
            daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=QUICK_REOFFER, before_start=hold_b
        )
    )
    assert_no_leaks(fabric)


def test_quarantine_of_a_replaced_queue_pair_ends_with_it(tmp_path: Path) -> None:
    """A request fails at the receiver while granted (quarantined) and its sender's CANCEL
    is slow. The pair fails and the sender offers a new one. The quarantined buffer is freed
    when the old pair is destroyed; the late CANCEL touches nothing of the new pair; and the
    reaper, past its limit, never tears the new pair down on the old request's account."""
    fabric = new_fabric()
    rid = "held-over"
    held: list[Any] = []

    def configure(tx: Config, rx: Config) -> None:
        rx.receiver.transfer_deadline_s = 1.0
        rx.receiver.transfer_max_s = 1.0  # its own limit: the sender's KEEPs hold the window
        tx.sender.idle_timeout_s = rx.receiver.idle_timeout_s = 1.5

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        session = rig.sender.session
        rdma = rig.peer.rdma
        assert rdma is not None
        tell = rig.sender._tell_peer

        def hold_cancel(req_or_peer: TxRequest | PeerLink, ev: Event) -> None:
            if isinstance(ev, Cancel) and ev.rid == rid:
                held.append((req_or_peer, ev))
            else:
                tell(req_or_peer, ev)

        rig.sender._tell_peer = hold_cancel  # type: ignore[method-assign]
        outcomes = await in_engine_thread(
            functools.partial(partial_handover, split=1, hand_rest=False, deadline_s=20),
            rig.sender.sc.control_socket,
            [rid],
            {rid: [bytes(n) for n in LAYERS]},
            lambda: None,
        )
        assert outcomes[rid].code == "DEADLINE", outcomes
        await rig.until(lambda: bool(held))
        assert rig.receiver.status()["quarantined"] == 1
        old = rig.receiver.rdma[session]
        rig.receiver._close_rdma(session, "landing loop failed (test)", tell=True)
        assert rig.receiver.status()["quarantined"] == 0
        await pools_empty(rig)
        await rig.until(lambda: rig.receiver.rdma.get(session) not in (None, old))
        new = rig.receiver.rdma[session]
        await rig.until(lambda: rig.backend() == "rdma")
        for peer, ev in held:
            tell(peer, ev)
        limit = 2 * RDMA.stall_timeout_s + rig.receiver.rc.idle_timeout_s
        await trio.sleep(limit + 0.5)
        assert rig.receiver.rdma.get(session) is new and rig.backend() == "rdma"
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0
        assert rig.receiver.status()["quarantined"] == 0

    trio.run(
        functools.partial(
            daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=QUICK_REOFFER, configure=configure
        )
    )
    assert_no_leaks(fabric)
