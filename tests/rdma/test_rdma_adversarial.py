"""Adversarial tests of the RDMA path inside the real sender and receiver daemons.

Both daemons run in this process over the fake verbs fabric (as in test_rdma_daemons), with
one side played by a hostile or buggy peer: a raw protocol connection the test drives itself,
or a daemon method wrapped to lie. Whatever the peer does, the honest daemon must keep serving,
deliver an outcome to its engine, never free a buffer a WRITE may still read or land in, and
leave the fabric clean (no violation, registration or open verbs object). A daemon that
crashes (an exception out of its nursery) fails the test by itself.

Thirteen of these first reproduced bugs this review found (as strict xfails); all are fixed.
"""

from __future__ import annotations

import functools
import secrets
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
from xdc.transport.engine_client import Outcome, PrefillClient
from xdc.transport.peer_link import PeerLink
from xdc.transport.rdma.qpinfo import (
    QpInfo,
    decode_grant,
    decode_qpinfo,
    encode_grant,
    encode_qpinfo,
)
from xdc.transport.receiver import Receiver
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
    deliver_by_rdma,
    in_engine_thread,
    in_trio,
    logged,
    make_payloads,
    new_fabric,
    partial_handover,
    path_name,
    pools_empty,
    rdma_done,
    rdma_state,
    send_each,
    send_payloads,
)
from xdc.config import Config, ConfigError, load_config
from xdc.lab.fake_verbs import FakeFabric
from xdc.protocol import (
    Accept,
    Cancel,
    Event,
    Grant,
    Hello,
    LayerDone,
    Limits,
    Nack,
    Ping,
    Pong,
    RdmaAnswer,
    RdmaClose,
    RdmaOffer,
)
from xdc.protocol.books.send import TxRequest
from xdc.protocol.wire.events import PROTOCOL_VERSION

# --- harness -----------------------------------------------------------------------------------


async def _raw_sender(port: int, session: str) -> WireConn:
    """A hand-driven sender connection: HELLO exchanged, then whatever the test sends."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    wire = WireConn(sock, "sender", Limits())
    await wire.send(Hello(PROTOCOL_VERSION, "intruder", "sender", session, 0))
    hello = await wire.next_event()
    assert isinstance(hello, Hello) and hello.role == "receiver"
    return wire


async def _next(wire: WireConn, kind: type[Any], timeout: float = 5.0) -> Any:
    with trio.fail_after(timeout):
        while True:
            ev = await wire.next_event()
            if isinstance(ev, kind):
                return ev


async def _round_trip(wire: WireConn) -> None:
    """A PING answered: the receiver handled every frame sent before it on this connection."""
    nonce = secrets.randbits(32)
    await wire.send(Ping(nonce))
    pong = await _next(wire, Pong)
    assert pong.nonce == nonce


# --- a hostile or buggy receiver ---------------------------------------------------------------


def _lying_grants(rig: Rig, lie: Callable[[Grant], list[Grant]]) -> None:
    """The receiver's GRANT frames go through ``lie`` (which may change, drop or add some)."""
    send = rig.receiver._send_quiet

    async def send_quiet(wire: WireConn, ev: Any) -> bool:
        if isinstance(ev, Grant):
            sent = True
            for g in lie(ev):
                sent = await send(wire, g) and sent
            return sent
        return await send(wire, ev)

    rig.receiver._send_quiet = send_quiet  # type: ignore[method-assign]


def _edit_grant(ev: Grant, **changes: Any) -> Grant:
    return Grant(ev.rid, encode_grant(replace(decode_grant(ev.grant), **changes)))


def _pool_end(rig: Rig) -> int:
    (sess,) = rig.receiver.rdma.values()
    return sess.zone.pool_addr + len(sess.zone.pool)


@pytest.mark.parametrize(
    "lie",
    [
        "outside_pool",
        "sums_outside_pool",
        "wrong_length",
        "other_rid",
        "unknown_rid_extra",
        pytest.param(
            "slot_beyond_immediate",
        ),
    ],
)
def test_bad_grants_send_the_request_by_tcp(tmp_path: Path, lie: str) -> None:
    """A GRANT the sender cannot trust (or one for nobody) must not crash it or be used: the
    request goes by TCP, bytes intact, and the link stays up for the rest."""
    fabric = new_fabric()
    payloads = make_payloads(2)
    first = sorted(payloads)[0]

    def edit(ev: Grant) -> list[Grant]:
        if ev.rid != first:
            return [ev]
        g = decode_grant(ev.grant)
        if lie == "outside_pool":
            return [_edit_grant(ev, addr=end)]
        if lie == "sums_outside_pool":
            return [_edit_grant(ev, sums_addr=end - 8)]
        if lie == "wrong_length":
            return [_edit_grant(ev, length=g.length - 1)]
        if lie == "other_rid":
            return [Grant(ev.rid, encode_grant(replace(g, rid="someone-else")))]
        if lie == "unknown_rid_extra":
            return [Grant("nobody", encode_grant(replace(g, rid="nobody"))), ev]
        assert lie == "slot_beyond_immediate"
        return [_edit_grant(ev, slot=5000)]

    end = 0

    async def body(rig: Rig) -> None:
        nonlocal end
        assert (await rig.negotiated())["backend"] == "rdma"
        end = _pool_end(rig)
        _lying_grants(rig, edit)
        guard = FreeGuard(rig)
        outcomes = await rig.ship(payloads)
        all_ok(outcomes)
        # the lied-about request went by TCP, the other one by RDMA; the link is still up
        sent_tcp = rig.sender.metrics.bytes_sent._value.get()
        if lie == "unknown_rid_extra":
            assert sent_tcp == 0
        else:
            assert sent_tcp >= sum(LAYERS)
        assert rig.backend() == "rdma"
        await pools_empty(rig)
        assert guard.errors == [] and guard.checked > 0
        assert rig.receiver.status()["quarantined"] == 0

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


@pytest.mark.parametrize(
    "nack",
    [
        "landed_chunk",
        pytest.param(
            "layer_out_of_range",
        ),
        pytest.param(
            "layer_not_handed_over",
        ),
        pytest.param(
            "offset_beyond_layer",
        ),
    ],
)
def test_hostile_nacks_do_not_crash_the_sender(tmp_path: Path, nack: str) -> None:
    """NACKs name (layer, offset) cells; the receiver is trusted with its own memory, not
    with the sender's process: a NACK naming no valid handed-over cell must be ignored (or
    end RDMA), never raise out of the sender's tasks."""
    fabric = new_fabric()
    payloads = make_payloads(1)
    (rid,) = payloads
    layer, offset = {
        "landed_chunk": (0, 0),
        "layer_out_of_range": (len(LAYERS) + 1, 0),
        "layer_not_handed_over": (4, 0),
        "offset_beyond_layer": (0, 10 << 20),
    }[nack]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        token = trio.lowlevel.current_trio_token()

        async def inject() -> None:
            await rig.until(lambda: 0 in rdma_done(rig.sender, rid))
            async with logged(rig, "names no chunk to rewrite; ignored"):
                await any_wire(rig).send(Nack(rid, layer, offset, "hostile"))
            assert rig.sender.requests[rid].resent == 0

        outcomes = await in_engine_thread(
            partial_handover, rig.sender.sc.control_socket, [rid], payloads, in_trio(token, inject)
        )
        all_ok(outcomes)
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        await pools_empty(rig)

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=PATIENT))
    assert_no_leaks(fabric)


# --- a hostile or buggy sender on the protocol ---------------------------------------------


BAD_QPINFO: dict[str, bytes | None] = {
    "not_msgpack": b"\xc1\xc1 not msgpack",
    "not_a_map": bytes(msgpack.packb([1, 2, 3])),
    "wrong_version": None,
    "qp_num_zero": None,
    "mtu_not_ib": None,
    "short_gid": None,
    "wraps_address_space": None,
    "extra_key": None,
    "bool_for_int": None,
}


def _qpinfo_bytes(case: str) -> bytes:
    fixed = BAD_QPINFO[case]
    if fixed is not None:
        return fixed
    good = QpInfo(0x42, 7, bytes(15) + b"\x09", 0, 4096, 0, 0, 0, "xdc-tx-x")
    msg: dict[str, Any] = msgpack.unpackb(encode_qpinfo(good), raw=False)
    if case == "wrong_version":
        msg["v"] = 2
    elif case == "qp_num_zero":
        msg["qp_num"] = 0
    elif case == "mtu_not_ib":
        msg["mtu"] = 1500
    elif case == "short_gid":
        msg["gid"] = bytes(15)
    elif case == "wraps_address_space":
        msg["addr"], msg["length"] = (1 << 64) - 4096, 8192
    elif case == "extra_key":
        msg["rkey2"] = 1
    elif case == "bool_for_int":
        msg["psn"] = True
    data: bytes = msgpack.packb(msg, use_bin_type=True)
    return data


def _fabric_objects(fabric: FakeFabric) -> tuple[int, int, int]:
    return fabric.open_objects, fabric.live_registrations, len(fabric.qps)


@pytest.mark.parametrize("case", sorted(BAD_QPINFO))
def test_undecodable_offer_gets_a_reason_and_nothing_leaks(tmp_path: Path, case: str) -> None:
    """An intruder session offers garbage QP info: the receiver answers 'tcp, because ...',
    keeps no session and no verbs object for it, and the honest sender's RDMA goes on."""
    fabric = new_fabric()
    payloads = make_payloads(2)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        before = _fabric_objects(fabric)
        wire = await _raw_sender(rig.receiver.port, "intruder-1")
        await wire.send(RdmaOffer("pd-a", _qpinfo_bytes(case)))
        answer = await _next(wire, RdmaAnswer)
        assert answer.info == b"" and "rdma setup on rxe1 failed" in answer.reason, answer
        assert "intruder-1" not in rig.receiver.rdma
        assert _fabric_objects(fabric) == before
        # the connection is still served: a second, equally bad offer gets the same answer
        await wire.send(RdmaOffer("pd-a", _qpinfo_bytes(case)))
        assert (await _next(wire, RdmaAnswer)).info == b""
        wire.close()
        outcomes = await rig.ship(payloads)
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0  # all of it by RDMA
        assert _fabric_objects(fabric) == before

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


def test_offer_naming_a_queue_pair_nobody_owns(tmp_path: Path) -> None:
    """Well-formed QP info for a QP that does not exist: the receiver sets a session up (it
    cannot know), and tears it down with every verbs object once the intruder's connection
    goes; the honest session is untouched throughout."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        before = _fabric_objects(fabric)
        wire = await _raw_sender(rig.receiver.port, "intruder-2")
        ghost = QpInfo(0xABCDE, 5, bytes(15) + b"\x77", 0, 1024, 0, 0, 0, "xdc-tx-ghost")
        await wire.send(RdmaOffer("pd-a", encode_qpinfo(ghost)))
        answer = await _next(wire, RdmaAnswer)
        assert answer.info and not answer.reason
        assert "intruder-2" in rig.receiver.rdma and _fabric_objects(fabric) != before
        # an RDMA_CLOSE from the intruder closes its own session only
        await wire.send(RdmaClose(ghost.qp_num, "intruder leaves"))
        await rig.until(lambda: "intruder-2" not in rig.receiver.rdma)
        assert _fabric_objects(fabric) == before
        # offered again, then the connection simply goes away
        await wire.send(RdmaOffer("pd-a", encode_qpinfo(ghost)))
        assert (await _next(wire, RdmaAnswer)).info
        wire.close()
        await rig.until(lambda: "intruder-2" not in rig.receiver.rdma)
        assert _fabric_objects(fabric) == before
        assert rig.sender.session in rig.receiver.rdma
        outcomes = await rig.ship(
            make_payloads(2),
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


def test_rdma_close_from_a_session_that_never_offered(tmp_path: Path) -> None:
    """RDMA_CLOSE from a session without RDMA (sent before any offer) is a no-op: the honest
    sender's queue pair stays, and so does the intruder's connection."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        wire = await _raw_sender(rig.receiver.port, "intruder-3")
        await wire.send(RdmaClose(1, "nothing to close"))
        await wire.send(RdmaClose(0xFFFFFF, "still nothing"))
        # still served: an offer on the same connection is answered
        await wire.send(RdmaOffer("pd-b", b"\x80"))
        answer = await _next(wire, RdmaAnswer)
        assert answer.info == b"" and "differs" in answer.reason
        wire.close()
        assert list(rig.receiver.rdma) == [rig.sender.session]
        outcomes = await rig.ship(
            make_payloads(1),
        )
        all_ok(outcomes)
        assert rig.backend() == "rdma" and rig.sender.metrics.bytes_sent._value.get() == 0

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


def test_cancel_from_another_session_does_not_kill_a_request(tmp_path: Path) -> None:
    """An intruder session (or a buggy second sender) CANCELs the honest sender's request
    mid-transfer by rid: the receiver must ignore it; the request completes, intact."""
    fabric = new_fabric()
    payloads = make_payloads(1)
    (rid,) = payloads

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        token = trio.lowlevel.current_trio_token()

        async def intrude() -> None:
            await rig.until(lambda: rid in rig.receiver.requests)
            wire = await _raw_sender(rig.receiver.port, "intruder-4")
            await wire.send(Cancel(rid, "not yours"))
            # naming the honest session's own queue pair: still not the intruder's to close
            honest = rig.receiver.rdma[rig.sender.session].remote_qp_num
            await wire.send(RdmaClose(honest, "nor this"))
            await _round_trip(wire)  # the receiver has handled both
            wire.close()

        outcomes = await in_engine_thread(
            functools.partial(partial_handover, deadline_s=3.0),
            rig.sender.sc.control_socket,
            [rid],
            payloads,
            in_trio(token, intrude),
        )
        all_ok(outcomes)
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        await pools_empty(rig)

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


# --- load: more work than queue depths, tiny chunks, tight pools ---------------------------


@pytest.mark.parametrize(
    ("tx_inflight", "rx_recv_depth", "verify_every", "requests"),
    [(4, 3, 4, 24), (2, 1, 1, 8), (16, 2, 0, 16)],
)
def test_more_requests_than_work_requests_and_receives(
    tmp_path: Path, tx_inflight: int, rx_recv_depth: int, verify_every: int, requests: int
) -> None:
    """Many requests at once over a QP whose send queue (max_inflight) and posted receives
    (recv_depth) are a fraction of the chunks in flight: WRITEs wait for receives (RNR) and
    for send slots, and everything still arrives by RDMA, intact."""
    fabric = new_fabric()
    payloads = make_payloads(requests)
    tx = replace(RDMA, max_inflight=tx_inflight, recv_depth=4)
    rx = replace(RDMA, recv_depth=rx_recv_depth, verify_every=verify_every)

    async def body(rig: Rig) -> None:
        guard, sess = await deliver_by_rdma(rig, payloads)
        assert sess["landed_bytes"] == requests * sum(LAYERS) and sess["granted"] == 0
        await pools_empty(rig)
        assert guard.errors == [] and guard.checked > 0

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=tx,
            rx_rdma=rx,
            recv_pool=64 << 20,
            send_pool=32 << 20,
        )
    )
    assert_no_leaks(fabric)


def test_the_smallest_work_request_budget_still_transfers(tmp_path: Path) -> None:
    """A sampled chunk posts two WRITEs (its checksum, then its data), so the config refuses
    rdma.max_inflight = 1 (which would never post one) and the minimum, 2, with every chunk
    sampled, still delivers by RDMA."""
    with pytest.raises(ConfigError, match=r"rdma\.max_inflight: must be >= 2"):
        load_config(None, env={}, overrides={"rdma.max_inflight": "1"})
    fabric = new_fabric()
    payloads = make_payloads(1)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        outcomes = await in_engine_thread(
            functools.partial(_send_with_deadline, deadline_s=10.0),
            rig.receiver.rc.control_socket,
            rig.sender.sc.control_socket,
            payloads,
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=replace(RDMA, max_inflight=2),
            rx_rdma=replace(RDMA, verify_every=1),
        )
    )
    assert_no_leaks(fabric)


def _send_with_deadline(
    rx_sock: str, tx_sock: str, payloads: dict[str, list[bytes]], deadline_s: float
) -> dict[str, Outcome]:
    """One engine, requests handed over layer by layer; what was delivered is checked."""
    with PrefillClient(tx_sock) as pc:
        ts = {
            rid: pc.begin(rid, [len(x) for x in layers], deadline_s=deadline_s)
            for rid, layers in payloads.items()
        }
        for rid, t in ts.items():
            for layer, data in enumerate(payloads[rid]):
                t.put_layer(layer, data)
        outcomes = {rid: t.wait(deadline_s + 5) for rid, t in ts.items()}
    if all(o.ok for o in outcomes.values()):
        check_delivered(rx_sock, payloads)
    return outcomes


def test_thousands_of_small_chunks(tmp_path: Path) -> None:
    """4 KiB chunks: requests of thousands of WRITE_WITH_IMMs each, every 8th sampled."""
    fabric = new_fabric()
    sizes = [6 << 20, 4096, 1, 5000, (2 << 20) + 17]
    payloads = {
        f"small-{i}-{secrets.token_hex(3)}": [secrets.token_bytes(s) for s in sizes]
        for i in range(3)
    }

    async def body(rig: Rig) -> None:
        guard, sess = await deliver_by_rdma(rig, payloads)
        chunks = sum(-(-s // 4096) for s in sizes)
        assert chunks > 2000 and sess["landed_chunks"] == 3 * chunks
        await pools_empty(rig)
        assert guard.errors == []

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            chunk_bytes=4096,
            rx_rdma=replace(RDMA, verify_every=8),
            send_pool=32 << 20,
            recv_pool=32 << 20,
        )
    )
    assert_no_leaks(fabric)


@pytest.mark.parametrize(
    ("send_pool", "recv_pool"), [(1 << 20, 16 << 20), (16 << 20, 2 << 20)], ids=["tx", "rx"]
)
def test_tight_pools_push_back_over_rdma(tmp_path: Path, send_pool: int, recv_pool: int) -> None:
    """A send pool of about one request: layers wait for the receiver's LAYER_DONE (and their
    WRITEs' completions) to be freed. A receive pool of two requests: BEGINs wait for room
    and get their grant when it frees. (Both tight at once can deadlock until the deadline,
    over TCP as much as over RDMA: the send pool fills with layers of requests the receiver
    has not accepted yet. Not exercised here.)"""
    fabric = new_fabric()
    payloads = make_payloads(8)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        guard = FreeGuard(rig)
        outcomes = await in_engine_thread(
            send_each, rig.receiver.rc.control_socket, rig.sender.sc.control_socket, payloads
        )
        all_ok(outcomes)
        assert rig.sender.metrics.bytes_sent._value.get() == 0
        await pools_empty(rig)
        assert guard.errors == [] and guard.checked >= 8

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            send_pool=send_pool,
            recv_pool=recv_pool,
            timeout=15,
        )
    )
    assert_no_leaks(fabric)


def test_request_that_fits_the_receive_pool_only_without_its_checksum_table(
    tmp_path: Path,
) -> None:
    """A request exactly the size of the receive pool: it fits over TCP, but not with the
    RDMA checksum table after it. Delivered (by TCP) or refused (NO_SPACE), the receiver
    must stay up and the engine must get an outcome."""
    fabric = new_fabric()
    payloads = {"exactly-the-pool": [secrets.token_bytes(1 << 20)]}

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        outcomes = await in_engine_thread(
            functools.partial(_send_with_deadline, deadline_s=3.0),
            rig.receiver.rc.control_socket,
            rig.sender.sc.control_socket,
            payloads,
        )
        (out,) = outcomes.values()
        assert out.ok or out.code == "NO_SPACE", out

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric, recv_pool=1 << 20))


# --- the QP replaced or closed under running transfers -----------------------------------------


@pytest.mark.parametrize("who", ["sender_offers_again", "receiver_closes", "receiver_lies"])
def test_queue_pair_replaced_or_closed_mid_transfer(tmp_path: Path, who: str) -> None:
    """Layers are half handed over when the link changes under them:

    - the sender's session offers again on one of its connections (the receiver replaces its
      QP without a word; the sender's WRITEs then hit a destroyed QP);
    - the receiver sends RDMA_CLOSE but keeps its QP (the sender must give RDMA up anyway);
    - the receiver sends an unsolicited RDMA_ANSWER with garbage (nothing changes).

    Every request completes (over TCP where RDMA ended), bytes intact, both pools empty, and
    the receiver ends with no queue pair for a session the sender gave up."""
    fabric = new_fabric()
    payloads = make_payloads(3)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        token = trio.lowlevel.current_trio_token()
        guard = FreeGuard(rig)
        session = rig.sender.session

        async def interfere() -> None:
            await rig.until(lambda: all(0 in rdma_done(rig.sender, r) for r in rig.sender.requests))
            if who == "sender_offers_again":
                rdma = rig.peer.rdma
                assert rdma is not None and rdma.ep is not None
                old = rig.receiver.rdma[session]
                info = encode_qpinfo(rdma.ep.local_info(rig.sender.pool.name))
                slot = rig.peer.live[0]
                assert slot.wire is not None
                await slot.wire.send(RdmaOffer("pd-a", info))
                await rig.until(lambda: rig.receiver.rdma.get(session) not in (None, old))
            elif who == "receiver_closes":
                assert rig.peer.rdma is not None and rig.peer.rdma.remote is not None
                qpn = rig.peer.rdma.remote.qp_num
                await any_wire(rig).send(RdmaClose(qpn + 1, "a pair long gone"))  # ignored
                await any_wire(rig).send(RdmaClose(qpn, "receiver says so"))
                await rig.until(lambda: rig.backend() == "tcp")
            else:
                await any_wire(rig).send(RdmaAnswer("pd-a", b"\xc1garbage", ""))
                await any_wire(rig).send(RdmaAnswer("pd-a", b"", "and another"))

        outcomes = await in_engine_thread(
            partial_handover,
            rig.sender.sc.control_socket,
            sorted(payloads),
            payloads,
            in_trio(token, interfere),
        )
        all_ok(outcomes)
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        rdma = rig.sender.status()["peers"][rig.peer.name]["rdma"]
        if who == "receiver_lies":
            assert rdma["backend"] == "rdma" and rig.sender.metrics.bytes_sent._value.get() == 0
        else:
            assert rdma["backend"] == "tcp" and rdma["fallbacks"] == 1, rdma
            assert rig.sender.metrics.bytes_sent._value.get() > 0
            await rig.until(lambda: rig.receiver.rdma == {})
        await pools_empty(rig)
        assert guard.errors == []
        assert rig.receiver.status()["quarantined"] == 0

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


# --- lifecycle with WRITEs in flight -----------------------------------------------------------


HELD_RX = replace(PATIENT, recv_depth=2)  # few receives: a held landing loop stalls WRITEs


def _busy_rids(rig: Rig) -> set[str]:
    rdma = rig.peer.rdma
    if rdma is None or rdma.writer is None:
        return set()
    return {req.begin.rid for req, _i, _s in rdma.writer._inflight.values()}


def _writes_in_flight(rig: Rig) -> int:
    rdma = rig.peer.rdma
    return rdma.writer.inflight if rdma is not None and rdma.writer is not None else 0


@pytest.mark.parametrize("how", ["engine_gone", "sender_shutdown", "receiver_shutdown", "deadline"])
def test_requests_end_while_writes_are_in_flight(tmp_path: Path, how: str) -> None:
    """The receiver's landing loop is held so the sender has WRITEs posted and not completed;
    then the requests end: the prefill engine disconnects (ENGINE_GONE), the sender or the
    receiver drains and shuts down, or the deadline passes. Neither side may free a buffer
    while those WRITEs can still read or land in it (FreeGuard); once they complete, both
    pools empty, the engine got its outcome, nothing stays quarantined, the fabric is clean."""
    fabric = new_fabric()
    payloads = make_payloads(2)
    rids = sorted(payloads)
    expect = {
        "engine_gone": "ENGINE_GONE",
        "sender_shutdown": "SHUTDOWN",
        "receiver_shutdown": "CANCELLED",
        "deadline": "DEADLINE",
    }[how]

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        token = trio.lowlevel.current_trio_token()
        gate = Gate(rig.receiver)
        guard = FreeGuard(rig)

        def ended() -> bool:
            return all(r.state == "failed" for r in rig.sender.requests.values())

        async def release_when_failed() -> None:
            await rig.until(ended, timeout=8)
            # the failed requests with WRITEs not completed have not ended: they hold both
            # their buffers (the others may have ended and freed theirs)
            busy = _busy_rids(rig)
            assert busy and not any(rid in rig.sender.book.ended for rid in busy)
            assert rig.sender.pool.allocator.used_bytes > 0
            assert rig.receiver.pool.allocator.used_bytes > 0
            gate.open()

        async with trio.open_nursery() as bg:

            async def interfere() -> None:
                await gate.held.wait()
                await rig.until(lambda: _writes_in_flight(rig) > 0)
                if how == "sender_shutdown":
                    bg.start_soon(rig.sender.shutdown)
                elif how == "receiver_shutdown":
                    bg.start_soon(rig.receiver.shutdown)
                if how != "engine_gone":
                    bg.start_soon(release_when_failed)

            outcomes = await in_engine_thread(
                functools.partial(
                    partial_handover,
                    deadline_s=1.5 if how == "deadline" else None,
                    vanish=how == "engine_gone",
                ),
                rig.sender.sc.control_socket,
                rids,
                payloads,
                in_trio(token, interfere),
            )
            if how == "engine_gone":
                await release_when_failed()
        await rig.until(lambda: all(rid in rig.sender.book.ended for rid in rids))
        assert {rig.sender.book.ended[rid][0] for rid in rids} == {expect}, rig.sender.book.ended
        if how != "engine_gone":
            assert {o.code for o in outcomes.values()} == {expect}, outcomes
        await pools_empty(rig)
        assert guard.errors == [] and guard.checked > 0
        status = rig.receiver.status()
        assert status["quarantined"] == 0 and status["failed"] == len(rids)
        if how != "receiver_shutdown":  # a receiver that shut down keeps no queue pair
            assert rig.backend() == "rdma"

    trio.run(
        functools.partial(
            daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=PATIENT, rx_rdma=HELD_RX
        )
    )
    assert_no_leaks(fabric)


# --- receiver restart --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old_close",
    [
        "dropped",
        pytest.param(
            "late",
        ),
    ],
)
def test_receiver_restart_during_rdma_transfer(tmp_path: Path, old_close: str) -> None:
    """The receiver process is replaced (same port) while requests are half written by RDMA:
    those requests end with PEER_RESTARTED (their partial bytes died with the old pool), the
    old queue pair's resources are all released, and the sender negotiates RDMA afresh with the
    new receiver session, over which new requests go.

    The sender's RDMA_CLOSE for the old QP races with its new offer (they may go on different
    connections); the test makes the race deterministic: the notice is ``dropped``, or
    delivered ``late`` (after the new QP is up), as a congested connection would."""
    fabric = new_fabric()
    pair = Restartable(tmp_path, fabric)
    payloads = make_payloads(2)
    rids = sorted(payloads)

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await pair.start_receiver(n)
                await n.start(pair.sender.serve)
                rig = pair.rig
                assert (await rig.negotiated())["backend"] == "rdma"
                old_session = rig.peer.peer_session
                token = trio.lowlevel.current_trio_token()
                tell = pair.sender._tell_peer
                stale_close: list[trio.Event] = []

                async def late(peer: Any, ev: Any, handled: trio.Event) -> None:
                    """Deliver the old QP's RDMA_CLOSE once the new QP is up, then make sure
                    the receiver has handled it: a probe CANCEL sent after it on every
                    connection comes back through the receiver's _on_cancel."""
                    await pair.rig.until(lambda: pair.sender.session in pair.receiver.rdma)
                    receiver = pair.receiver
                    seen: set[str] = set()
                    on_cancel = receiver._on_cancel

                    def probe(session: str, ev: Cancel) -> None:
                        if ev.rid.startswith("probe-"):
                            seen.add(ev.rid)
                        else:
                            on_cancel(session, ev)

                    receiver._on_cancel = probe  # type: ignore[method-assign]
                    tell(peer, ev)
                    await rig.until(lambda: pair.sender._notifying == 0)
                    sent = set()
                    for slot in list(peer.live):
                        if slot.wire is not None:
                            rid = f"probe-{slot.index}"
                            await slot.wire.send(Cancel(rid, "probe"))
                            sent.add(rid)
                    await rig.until(lambda: sent <= seen)
                    handled.set()

                def tell_peer(req_or_peer: TxRequest | PeerLink, ev: Event) -> None:
                    if not isinstance(ev, RdmaClose):
                        tell(req_or_peer, ev)
                    elif old_close == "late":
                        stale_close.append(trio.Event())
                        n.start_soon(late, req_or_peer, ev, stale_close[-1])

                pair.sender._tell_peer = tell_peer  # type: ignore[method-assign]

                async def restart() -> None:
                    await rig.until(
                        lambda: all(0 in rdma_done(pair.sender, r) for r in pair.sender.requests)
                    )
                    await pair.restart_receiver(n)
                    await rig.until(lambda: rig.peer.peer_session not in (None, old_session))

                outcomes = await in_engine_thread(
                    partial_handover,
                    pair.tx.sender.control_socket,
                    rids,
                    payloads,
                    in_trio(token, restart),
                )
                assert {o.code for o in outcomes.values()} == {"PEER_RESTARTED"}, outcomes
                rig = pair.rig  # the new receiver
                await rig.until(lambda: pair.sender.session in pair.receiver.rdma, timeout=5)
                for handled in stale_close:  # none if the sender sends no stale close
                    await handled.wait()
                assert rig.peer.rdma is not None and rig.peer.rdma.fallbacks == 1
                more = make_payloads(2)
                outcomes = await in_engine_thread(
                    send_payloads,
                    pair.rx.receiver.control_socket,
                    pair.tx.sender.control_socket,
                    more,
                )
                all_ok(outcomes)
                sessions = rig.receiver.status()["rdma"]
                assert len(sessions) == 1, "the new receiver has no queue pair for the sender"
                (sess,) = sessions.values()
                assert sess["landed_bytes"] == 2 * sum(LAYERS)
                assert rig.backend() == "rdma"
                await pools_empty(rig)
                n.cancel_scope.cancel()

    trio.run(main)
    assert_no_leaks(fabric)


def test_a_grant_from_a_previous_receiver_session_is_never_used(tmp_path: Path) -> None:
    """Receiver 1 GRANTs a request and dies before its ACCEPT goes out; the sender BEGINs it
    again on receiver 2, which accepts it before the new queue pair exists (so without a
    grant), the ACCEPT arriving once RDMA is up again. The request must go by TCP (or a new
    grant): never by the dead session's grant."""
    fabric = new_fabric()
    pair = Restartable(tmp_path, fabric)
    rid = "regranted"
    payload = {rid: [secrets.token_bytes(s) for s in LAYERS]}

    async def main() -> None:
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                await pair.start_receiver(n)
                await n.start(pair.sender.serve)
                rig = pair.rig
                assert (await rig.negotiated())["backend"] == "rdma"
                accept_held = trio.Event()
                send = pair.receiver._send_quiet

                async def lose_accept(wire: WireConn, ev: Any) -> bool:
                    if isinstance(ev, Accept) and ev.rid == rid:
                        accept_held.set()
                        await trio.sleep_forever()  # the receiver dies before sending it
                    return await send(wire, ev)

                pair.receiver._send_quiet = lose_accept  # type: ignore[method-assign]

                def slow_second(receiver: Receiver) -> None:
                    answer, send2 = receiver._on_rdma_offer, receiver._send_quiet

                    async def answer_after_accepting(
                        wire: WireConn, hello: Hello, offer: RdmaOffer
                    ) -> None:
                        # from another task: the BEGIN may come on this very connection,
                        # whose reader must not wait here for the request it carries
                        async def later() -> None:
                            req = receiver.requests
                            await rig.until(lambda: rid in req and req[rid].state == "receiving")
                            await answer(wire, hello, offer)

                        receiver._nursery.start_soon(later)

                    async def accept_once_rdma_is_up(wire: WireConn, ev: Any) -> bool:
                        if isinstance(ev, Accept) and ev.rid == rid:
                            await rig.until(
                                lambda: rig.peer.rdma is not None and rig.peer.rdma.active
                            )
                        return await send2(wire, ev)

                    receiver._on_rdma_offer = answer_after_accepting  # type: ignore[method-assign]
                    receiver._send_quiet = accept_once_rdma_is_up  # type: ignore[method-assign]

                async def restart() -> None:
                    await accept_held.wait()
                    # the receiver sent the GRANT before this ACCEPT; the sender may not have
                    # read it yet on a busy host (a CI run saw no state here): it arrives
                    await rig.until(
                        lambda: getattr(rdma_state(pair.sender, rid), "grant", None) is not None
                    )
                    await pair.restart_receiver(n, slow_second)

                token = trio.lowlevel.current_trio_token()
                outcomes = await in_engine_thread(
                    functools.partial(partial_handover, split=len(LAYERS), deadline_s=4.0),
                    pair.tx.sender.control_socket,
                    [rid],
                    payload,
                    in_trio(token, restart),
                )
                all_ok(outcomes)
                rig = pair.rig
                await in_engine_thread(check_delivered, pair.rx.receiver.control_socket, payload)
                (sess,) = rig.receiver.status()["rdma"].values()
                assert sess["stale_writes"] == 0
                assert rig.peer.rdma is not None and rig.peer.rdma.fallbacks == 1  # the restart
                assert rig.backend() == "rdma"
                await pools_empty(rig)
                n.cancel_scope.cancel()

    trio.run(main)
    assert_no_leaks(fabric)


def test_granted_request_sent_by_tcp_is_not_quarantined_forever(tmp_path: Path) -> None:
    """A request BEGUN while the receiver's RDMA_ANSWER is still on its way gets a GRANT the
    sender cannot use yet, and goes by TCP; when the receiver then fails it (its deadline),
    its buffer must be freed promptly, and the session's queue pair must stay up."""
    fabric = new_fabric()
    rid = "granted-early"
    answer_sent = trio.Event()
    release_answer = trio.Event()

    def hold_answer(rig: Rig) -> None:
        answer = rig.receiver._on_rdma_offer

        class LateWire:
            """Sends the answer later, from another task (the connection goes on)."""

            def __init__(self, wire: WireConn) -> None:
                self.wire = wire

            async def send(self, ev: Event) -> None:
                async def later() -> None:
                    await release_answer.wait()
                    await self.wire.send(ev)
                    answer_sent.set()

                rig.receiver._nursery.start_soon(later)

        async def slow(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            await answer(LateWire(wire), hello, offer)  # type: ignore[arg-type]

        rig.receiver._on_rdma_offer = slow  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        token = trio.lowlevel.current_trio_token()
        await rig.until(lambda: rig.sender.session in rig.receiver.rdma)  # QP up, answer held

        async def granted_then_answer() -> None:
            await rig.until(lambda: rig.sender.requests[rid].state == "sending")
            assert rig.receiver.requests[rid].rdma_hold  # the receiver granted it
            assert path_name(rig.sender, rid) == "tcp"  # the sender could not use it
            release_answer.set()
            await answer_sent.wait()
            await rig.until(lambda: rig.backend() == "rdma")

        outcomes = await in_engine_thread(
            functools.partial(partial_handover, split=1, hand_rest=False, deadline_s=20),
            rig.sender.sc.control_socket,
            [rid],
            {rid: [bytes(LAYERS[0])]},
            in_trio(token, granted_then_answer),
        )
        assert outcomes[rid].code == "DEADLINE", outcomes  # the receiver's 1 s deadline
        await rig.until(lambda: rig.receiver.status()["quarantined"] == 0, timeout=2.0)
        assert rig.receiver.pool.allocator.used_bytes == 0
        assert rig.backend() == "rdma" and rig.sender.session in rig.receiver.rdma

    def configure(tx: Config, rx: Config) -> None:
        rx.receiver.transfer_deadline_s = 1.0
        rx.receiver.transfer_max_s = 1.0  # the receiver's own limit, whatever the KEEPs

    trio.run(
        functools.partial(
            daemon_pair,
            tmp_path,
            body,
            fabric=fabric,
            configure=configure,
            before_start=hold_answer,
        )
    )
    assert_no_leaks(fabric)


def test_receiver_failure_reaches_the_sender_after_its_begin_connection_died(
    tmp_path: Path,
) -> None:
    """An RDMA request whose BEGIN connection dies (and is replaced) mid-transfer, then fails
    at the receiver's limit (its sender's KEEPs hold it past the receiver's window, so the
    limit, transfer_max_s, is what the receiver alone decides): the sender must hear of it on
    another connection (so it stops writing, CANCELs, and the quarantine ends), not find out
    at its own deadline."""
    fabric = new_fabric()
    rid = "orphaned-reply"
    payload = {rid: [secrets.token_bytes(s) for s in LAYERS]}

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        token = trio.lowlevel.current_trio_token()

        async def cut_begin_connection() -> None:
            await rig.until(lambda: 0 in rdma_done(rig.sender, rid))
            wire = rig.receiver.reply_to[rid]
            assert wire is not None
            wire.sock.shutdown(socket.SHUT_RDWR)
            await rig.until(lambda: wire.closed and len(rig.peer.live) == 2)

        outcomes = await in_engine_thread(
            functools.partial(partial_handover, hand_rest=False, deadline_s=4.0),
            rig.sender.sc.control_socket,
            [rid],
            payload,
            in_trio(token, cut_begin_connection),
        )
        out = outcomes[rid]
        assert out.code == "DEADLINE" and "receiver" in out.error, out  # told, not timed out
        await pools_empty(rig)
        assert rig.receiver.status()["quarantined"] == 0 and rig.backend() == "rdma"

    def configure(tx: Config, rx: Config) -> None:
        rx.receiver.transfer_deadline_s = 1.5
        rx.receiver.transfer_max_s = 1.5

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric, configure=configure))
    assert_no_leaks(fabric)


@pytest.mark.parametrize(
    "lie",
    [
        pytest.param(
            "layer_done_before_hand_over",
        ),
        pytest.param(
            "nack_of_a_done_layer",
        ),
    ],
)
def test_receiver_lies_about_layers(tmp_path: Path, lie: str) -> None:
    """The receiver is trusted with its own buffers only: a LAYER_DONE or NACK that does not
    fit the request's state must not make the sender free, or read, a buffer it should not."""
    fabric = new_fabric()
    payloads = make_payloads(1)
    (rid,) = payloads

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        assert rig.peer.rdma is not None and rig.peer.rdma.ep is not None
        posts = PostGuard(rig, rig.peer.rdma.ep.verbs)
        token = trio.lowlevel.current_trio_token()

        async def lie_now() -> None:
            req = rig.sender.requests[rid]
            await rig.until(
                lambda: 0 in rdma_done(rig.sender, req.rid) and req.layer_slot[0] is None
            )
            assert req.layer_slot[3] is not None  # allocated ahead by the engine, not handed
            # the sender says it ignored the lie, and its state shows it
            async with logged(rig, "ignored"):
                if lie == "layer_done_before_hand_over":
                    await any_wire(rig).send(LayerDone(rid, 3))
                else:
                    await any_wire(rig).send(Nack(rid, 0, 0, "hostile"))
            assert 3 not in rdma_done(rig.sender, req.rid) and req.layer_slot[3] is not None
            assert req.resent == 0

        outcomes = await in_engine_thread(
            functools.partial(partial_handover, deadline_s=4.0),
            rig.sender.sc.control_socket,
            [rid],
            payloads,
            in_trio(token, lie_now),
        )
        all_ok(outcomes)
        assert posts.posted > 0 and posts.errors == []
        await in_engine_thread(check_delivered, rig.receiver.rc.control_socket, payloads)
        await pools_empty(rig)

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric, tx_rdma=PATIENT))
    assert_no_leaks(fabric)


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("garbage", "not valid msgpack"),
        ("no_pool", "without a registered pool"),
        ("ghost_qp", "rdma link failed"),
    ],
)
def test_hostile_answers_leave_the_sender_on_tcp(tmp_path: Path, answer: str, reason: str) -> None:
    """The receiver answers the offer with garbage, with a QP but no pool, or with a QP that
    does not exist: the sender stays on (or falls back to) TCP with the reason, releases
    everything it set up, and its requests are delivered intact."""
    fabric = new_fabric()
    payloads = make_payloads(2)

    def lie(rig: Rig) -> None:
        offer_answer = rig.receiver._on_rdma_offer

        class Rewrite:
            """The receiver's real answer (its session is set up and grants follow), with
            the QP number replaced by one nobody owns."""

            def __init__(self, wire: WireConn) -> None:
                self.wire = wire

            async def send(self, ev: RdmaAnswer) -> None:
                info = replace(decode_qpinfo(ev.info), qp_num=0xFEED)
                await self.wire.send(RdmaAnswer(ev.domain, encode_qpinfo(info), ""))

        async def answer_offer(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            if answer == "ghost_qp":
                await offer_answer(Rewrite(wire), hello, offer)  # type: ignore[arg-type]
                return
            if answer == "garbage":
                info = b"\xc1\xc1"
            else:
                bare = QpInfo(0xFEED, 1, bytes(15) + b"\x05", 0, 4096, 0, 0, 0, "pool")
                info = encode_qpinfo(bare)
            await wire.send(RdmaAnswer("pd-a", info, ""))

        rig.receiver._on_rdma_offer = answer_offer  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        await rig.negotiated()
        outcomes = await rig.ship(payloads)
        all_ok(outcomes)
        status = rig.sender.status()["peers"][rig.peer.name]["rdma"]
        assert status["backend"] == "tcp" and reason in str(status["reason"]), status
        assert rig.sender.metrics.bytes_sent._value.get() >= 2 * sum(LAYERS)
        await rig.until(lambda: rig.receiver.rdma == {})  # its QP closed on our RDMA_CLOSE
        assert fabric.live_registrations == 0 and fabric.open_objects == 0
        await pools_empty(rig)

    trio.run(functools.partial(daemon_pair, tmp_path, body, fabric=fabric, before_start=lie))
    assert_no_leaks(fabric)
