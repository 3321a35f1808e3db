"""The real sender and receiver daemons with RDMA selected: engines on their Unix sockets,
real shared-memory pools, real TCP data connections carrying the QP exchange, grants and
control frames, and the fake verbs fabric (pyverbs' signatures, bytes really copied between
the two pools) in place of a NIC, since this machine's kernel has no RDMA. Both daemons run
in this process so they can share the fake fabric; the engines run in threads, as they would
in their own processes.
"""

from __future__ import annotations

import copy
import functools
import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import trio
from xdc.transport.engine_client import DecodeClient, Outcome, PrefillClient, TransferError
from xdc.transport.launcher import local_pair_config
from xdc.transport.rdma.select import RdmaDeps, usable_devices
from xdc.transport.rdma.verbs import PyverbsBackend
from xdc.transport.receiver import Receiver
from xdc.transport.sender import PeerLink, Sender
from xdc.transport.wire import WireConn

from tests.rdma_fixtures import (
    LAYERS,
    RDMA,
    Rig,
    assert_no_leaks,
    check_delivered,
    make_payloads,
    new_fabric,
    send_payloads,
    with_daemons,
)
from tests.transport_fixtures import Pair
from xdc.config import RdmaConfig
from xdc.lab.fake_verbs import FakeVerbs
from xdc.protocol import Cancel, Hello, RdmaOffer
from xdc.protocol.books.send import TxRequest
from xdc.protocol.wire.events import Event


def _found(device: str) -> tuple[list[str], str]:
    """A device probe that finds ``device``."""
    return [device], "test probe"


def test_same_domain_uses_rdma_layerwise_with_two_phase_visibility(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xdc.rdma")
    fabric = new_fabric()
    payloads = make_payloads(3)

    async def body(rig: Rig) -> None:
        status = await rig.negotiated()
        assert status["backend"] == "rdma", status
        # layer-wise: a single layer is readable before the request is complete
        rid = "layerwise"
        first = secrets.token_bytes(LAYERS[0])

        def partial() -> None:
            with (
                PrefillClient(rig.sender.sc.control_socket) as pc,
                DecodeClient(rig.receiver.rc.control_socket) as dc,
            ):
                t = pc.begin(rid, LAYERS)
                t.put_layer(0, first)
                assert dc.await_layer(rid, 0, timeout=5).tobytes() == first
                with pytest.raises(TransferError, match="TIMEOUT"):
                    dc.await_request(rid, timeout=0.3)  # not visible: not complete yet
                for layer in range(1, len(LAYERS)):
                    t.put_layer(layer, bytes(LAYERS[layer]))
                assert t.wait(10).ok
                dc.await_request(rid, timeout=5).release()

        await trio.to_thread.run_sync(partial)
        outcomes = await rig.ship(payloads)
        assert all(o.ok for o in outcomes.values()), outcomes
        total = 4 * sum(LAYERS)
        rdma = rig.sender.status()["peers"][rig.peer.name]["rdma"]
        assert rdma["backend"] == "rdma" and rdma["bytes_written"] == total
        assert rig.sender.metrics.bytes_sent._value.get() == 0  # no payload went by TCP
        (sess,) = rig.receiver.status()["rdma"].values()
        assert sess["landed_bytes"] == total and sess["granted"] == 0
        assert rig.receiver.status()["checksum_failures"] == 0
        await rig.until(lambda: rig.sender.pool.allocator.used_bytes == 0)
        await rig.until(lambda: rig.receiver.pool.allocator.used_bytes == 0)

    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)
    lines = [r.getMessage() for r in caplog.records if "using" in r.getMessage()]
    assert any("using rdma (same domain 'pd-a', device rxe0)" in m for m in lines), lines
    assert any("using rdma (same domain 'pd-a', device rxe1)" in m for m in lines), lines


@pytest.mark.parametrize(
    ("case", "expect"),
    [
        ("other_domain", "peer domain 'pd-a' differs from ours 'pd-b'"),
        ("receiver_off", "rdma disabled in local config"),
        ("sender_no_device", "no usable rdma device on this host: test probe"),
        # the real pyverbs loader: absent -> "pyverbs not installed", present -> no device
        ("real_pyverbs", "rdma setup on rxe0 failed"),
        ("sender_off", "rdma disabled in local config"),
    ],
)
def test_otherwise_tcp_with_the_reason(
    tmp_path: Path, case: str, expect: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    fabric = new_fabric()
    kw: dict[str, object] = {}
    if case == "other_domain":
        kw["rx_rdma"] = replace(RDMA, domain="pd-b")
    elif case == "receiver_off":
        kw["rx_rdma"] = replace(RDMA, enabled=False)
    elif case == "sender_no_device":
        kw["tx_devices"] = []
    elif case == "real_pyverbs":
        kw["verbs_factory"] = PyverbsBackend
    elif case == "sender_off":
        kw["tx_rdma"] = RdmaConfig()
    payloads = make_payloads(2)

    async def body(rig: Rig) -> None:
        status = await rig.negotiated()
        assert status["backend"] == "tcp" and expect in str(status["reason"]), status
        outcomes = await rig.ship(payloads)
        assert all(o.ok for o in outcomes.values()), outcomes
        assert rig.sender.metrics.bytes_sent._value.get() == 2 * sum(LAYERS)
        assert rig.receiver.status()["rdma"] == {}

    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric, **kw))  # type: ignore[arg-type]
    # everything set up for a refused offer was torn down again
    assert fabric.violations == [] and fabric.live_registrations == 0
    assert fabric.open_objects == 0
    chosen = [r.getMessage() for r in caplog.records if ": using " in r.getMessage()]
    assert chosen and all("using tcp" in m for m in chosen), chosen
    assert any(expect in m for m in chosen), chosen


def _written_by_rdma(rig: Rig) -> bool:
    return int(rig.sender.status()["peers"][rig.peer.name]["rdma"]["bytes_written"]) > 0


def test_link_failure_mid_transfer_finishes_over_tcp(tmp_path: Path) -> None:
    fabric = new_fabric()
    payloads = make_payloads(2)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"

        def half_then_break() -> dict[str, Outcome]:
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                transfers = {rid: pc.begin(rid, LAYERS) for rid in payloads}
                for layer in range(len(LAYERS)):
                    if layer == 3:
                        # the first layers went by RDMA before the break: on a busy host the
                        # sender had written none of them yet in a CI run (bytes_written 0)
                        trio.from_thread.run(
                            functools.partial(rig.until, lambda: _written_by_rdma(rig), timeout=10)
                        )
                        fabric.link_broken = True  # every later WRITE fails: RETRY_EXC_ERR
                    for rid, t in transfers.items():
                        t.put_layer(layer, payloads[rid][layer])
                return {rid: t.wait(30) for rid, t in transfers.items()}

        outcomes = await trio.to_thread.run_sync(half_then_break)
        assert all(o.ok for o in outcomes.values()), outcomes
        await trio.to_thread.run_sync(check_delivered, rig.receiver.rc.control_socket, payloads)
        rdma = rig.sender.status()["peers"][rig.peer.name]["rdma"]
        assert rdma["backend"] == "tcp" and "rdma link failed" in str(rdma["reason"])
        assert rdma["fallbacks"] == 1
        assert 0 < rdma["bytes_written"] < 2 * sum(LAYERS)  # the first layers went by RDMA
        # the layers after the break went by TCP, and both sides tore their QP down
        assert rig.sender.metrics.bytes_sent._value.get() >= 2 * sum(LAYERS[3:])
        await rig.until(lambda: rig.receiver.status()["rdma"] == {})
        assert fabric.live_registrations == 0 and fabric.open_objects == 0
        # and the peer stays on TCP for this receiver session: new work just flows
        more = make_payloads(1)
        outcomes = await rig.ship(more)
        assert all(o.ok for o in outcomes.values())

    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


def test_corrupt_samples_are_rewritten(tmp_path: Path) -> None:
    fabric = new_fabric()
    payloads = make_payloads(2)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        # flip a byte in the next 3 delivered WRITEs (data or the checksum written before it;
        # both flips of one chunk make one mismatch)
        fabric.corrupt_writes = 3
        outcomes = await rig.ship(payloads)
        assert all(o.ok for o in outcomes.values()), outcomes  # and send_payloads checked the bytes
        failures = rig.receiver.status()["checksum_failures"]
        assert 2 <= failures <= 3 and fabric.corrupt_writes == 0
        assert sum(o.resent_chunks for o in outcomes.values()) == failures
        assert rig.backend() == "rdma"

    # every chunk sampled, so every flipped chunk is caught (the sample rate's own test is
    # in test_rdma_transfer: unsampled flips are trusted to RC's link CRC)
    trio.run(
        functools.partial(
            with_daemons, tmp_path, body, fabric=fabric, rx_rdma=replace(RDMA, verify_every=1)
        )
    )
    assert_no_leaks(fabric)


def test_failed_requests_free_their_buffers_only_after_writes_stop(tmp_path: Path) -> None:
    """A request the engine cancels mid-way (the sender stops its WRITEs, then CANCELs) and
    one the receiver fails at its own deadline while the sender may still be writing (the
    buffer is quarantined until the sender's CANCEL says its WRITEs drained): both pools end
    empty and the link stays on RDMA."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"

        def fail_two() -> tuple[Outcome, Outcome]:
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                a = pc.begin("cancelled", LAYERS)
                a.put_layer(0, bytes(LAYERS[0]))
                a.put_layer(1, b"")
                pc.cancel("cancelled", "engine gave up")
                b = pc.begin("late", LAYERS, deadline_s=20)  # the receiver's 1 s comes first
                b.put_layer(0, bytes(LAYERS[0]))  # the rest never comes
                return a.wait(10), b.wait(10)

        a, b = await trio.to_thread.run_sync(fail_two)
        assert not a.ok and a.code == "CANCELLED"
        assert not b.ok and b.code == "DEADLINE" and "receiver" in b.error, b
        await rig.until(lambda: rig.receiver.pool.allocator.used_bytes == 0)
        await rig.until(lambda: rig.sender.pool.allocator.used_bytes == 0)
        status = rig.receiver.status()
        assert status["quarantined"] == 0 and status["rdma_quarantined"] == 1
        assert rig.backend() == "rdma"
        outcomes = await rig.ship(
            make_payloads(1),
        )
        assert all(o.ok for o in outcomes.values())

    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric, rx_deadline_s=1.0))
    assert_no_leaks(fabric)


def test_numpy_views_are_zero_copy_over_rdma(tmp_path: Path) -> None:
    """The decode engine's layer view is the receiver pool itself: what RDMA wrote there."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"

        def run() -> None:
            data = np.arange(LAYERS[0], dtype=np.uint8)
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                t = pc.begin("np", LAYERS[:1])
                t.layer_buffer(0)[:] = data
                t.layer_ready(0)
                assert t.wait(10).ok
            with DecodeClient(rig.receiver.rc.control_socket) as dc:
                got = dc.await_request("np", timeout=5)
                view = got.layer(0)
                assert not view.flags.owndata and np.array_equal(view, data)
                del view
                got.release()

        await trio.to_thread.run_sync(run)

    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


def test_quarantine_without_release_destroys_the_queue_pair(tmp_path: Path) -> None:
    """A sender that never confirms its WRITEs stopped (its CANCEL is lost here): after
    2 x stall_timeout + idle_timeout the receiver destroys the session's queue pair, which
    guarantees nothing more lands, frees the buffer, and tells the sender to use TCP."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        tell = rig.sender._tell_peer

        def drop_cancels(req_or_peer: TxRequest | PeerLink, ev: Event) -> None:
            if not isinstance(ev, Cancel):
                tell(req_or_peer, ev)

        rig.sender._tell_peer = drop_cancels  # type: ignore[method-assign]

        def fail_one() -> Outcome:
            with PrefillClient(rig.sender.sc.control_socket) as pc:
                t = pc.begin("late", LAYERS, deadline_s=20)
                t.put_layer(0, bytes(LAYERS[0]))
                return t.wait(10)

        out = await trio.to_thread.run_sync(fail_one)
        assert not out.ok and out.code == "DEADLINE"
        assert rig.receiver.status()["quarantined"] == 1
        held = rig.receiver.pool.allocator.used_bytes
        assert held >= sum(LAYERS)  # still held: WRITEs might be on their way
        limit = 2 * 0.5 + rig.receiver.rc.idle_timeout_s
        await rig.until(lambda: rig.receiver.pool.allocator.used_bytes == 0, timeout=limit + 3)
        assert rig.receiver.status()["quarantined"] == 0 and rig.receiver.status()["rdma"] == {}
        await rig.until(lambda: rig.backend() == "tcp")
        assert "no release of late" in str(rig.sender.status()["peers"][rig.peer.name]["rdma"])
        rig.sender._tell_peer = tell  # type: ignore[method-assign]
        outcomes = await rig.ship(
            make_payloads(1),
        )
        assert all(o.ok for o in outcomes.values())

    quick = replace(RDMA, stall_timeout_s=0.5)
    trio.run(
        functools.partial(
            with_daemons,
            tmp_path,
            body,
            fabric=fabric,
            tx_rdma=quick,
            rx_rdma=quick,
            rx_deadline_s=1.0,
        )
    )
    assert_no_leaks(fabric)


@pytest.mark.parametrize("how", ["answer lost", "connection dies"])
def test_an_unanswered_offer_is_made_again(tmp_path: Path, how: str) -> None:
    """The connection carrying the offer can die before the answer: the sender offers again
    (a few times) instead of settling for TCP with this receiver for good."""
    fabric = new_fabric()
    dropped: list[str] = []

    def lose_first_offer(rig: Rig) -> None:
        rig.sender.sc.connect_timeout_s = 0.5
        answer = rig.receiver._on_rdma_offer

        async def maybe(wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
            if not dropped:
                dropped.append(hello.session)
                if how == "connection dies":
                    wire.sock.shutdown(socket.SHUT_RDWR)
                return
            await answer(wire, hello, offer)

        rig.receiver._on_rdma_offer = maybe  # type: ignore[method-assign]

    async def body(rig: Rig) -> None:
        await rig.until(lambda: rig.backend() == "rdma", timeout=5)
        assert dropped and rig.peer.rdma is not None and rig.peer.rdma.unanswered == 0  # reset
        outcomes = await rig.ship(
            make_payloads(1),
        )
        assert all(o.ok for o in outcomes.values())
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    trio.run(
        functools.partial(
            with_daemons, tmp_path, body, fabric=fabric, before_start=lose_first_offer
        )
    )
    assert_no_leaks(fabric)


def test_daemon_processes_with_rdma_configured(pair_factory: Callable[..., Pair]) -> None:
    """`xdc sender` / `xdc receiver` as separate processes with [rdma] enabled in their config
    files and the production verbs (pyverbs, sysfs): on a host with a device they use RDMA;
    on this one (no RDMA in the kernel) each logs why it stays on TCP, and the data flows."""
    pair = pair_factory(connections=2, chunk_bytes=256 << 10, send_pool=32 << 20)
    for cfg in (pair.tx_cfg, pair.rx_cfg):
        cfg.rdma = replace(RDMA, stall_timeout_s=5.0)
    pair.start()
    payloads = make_payloads(2)
    outcomes = send_payloads(pair.rx_sock, pair.tx_sock, payloads)
    assert all(o.ok for o in outcomes.values()), outcomes
    devices, why = usable_devices()
    assert pair.tx is not None
    with PrefillClient(pair.tx_sock) as pc:
        (peer,) = pc.status()["peers"].values()
    if devices:
        assert peer["rdma"]["backend"] == "rdma", peer
    else:
        expect = f"using tcp (no usable rdma device on this host: {why})"
        assert expect in pair.tx.log(), pair.tx.log()[-2000:]
        assert peer["rdma"] == {**peer["rdma"], "backend": "tcp"}
        assert why in str(peer["rdma"]["reason"])


def test_pyverbs_without_a_channel_fd_polls_the_cq(tmp_path: Path) -> None:
    """rdma-core 44's pyverbs (Debian 12) has no CompChannel.fd to sleep on: the daemons then
    poll their CQs with a backoff, and transfers behave the same."""
    fabric = new_fabric()
    fabric.channel_fd = False
    payloads = make_payloads(3)

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        outcomes = await rig.ship(payloads)
        assert all(o.ok for o in outcomes.values()), outcomes
        assert rig.sender.metrics.bytes_sent._value.get() == 0

    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric))
    assert_no_leaks(fabric)


def test_two_senders_share_one_receiver_over_rdma(tmp_path: Path) -> None:
    """A decode node fed by two prefill nodes of its cluster: one queue pair and one set of
    slots per sender session, both writing into the one receive pool, requests interleaved."""
    fabric = new_fabric()
    fabric.add_device("rxe2")
    tx, rx, _ = local_pair_config(
        tmp_path, connections=2, chunk_bytes=64 << 10, send_pool=8 << 20, recv_pool=32 << 20
    )
    tx2 = copy.deepcopy(tx)
    tx2.node.id = "tx2"
    tx2.sender.control_socket = str(tmp_path / "tx2.sock")
    for cfg in (tx, tx2, rx):
        cfg.rdma = RDMA
    verbs = FakeVerbs(fabric)
    receiver = Receiver(rx, rdma=RdmaDeps(lambda: verbs, lambda: (["rxe0"], "test probe")))
    senders = [
        Sender(cfg, rdma=RdmaDeps(lambda: verbs, functools.partial(_found, dev)))
        for cfg, dev in ((tx, "rxe1"), (tx2, "rxe2"))
    ]
    payloads = [make_payloads(3), make_payloads(3)]

    async def main() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(receiver.serve)
                for s in senders:
                    await n.start(s.serve)
                rigs = [Rig(s, receiver, fabric) for s in senders]
                for rig in rigs:
                    assert (await rig.negotiated())["backend"] == "rdma"
                assert len(receiver.status()["rdma"]) == 2

                async def one(i: int) -> None:
                    outcomes = await trio.to_thread.run_sync(
                        send_payloads,
                        rx.receiver.control_socket,
                        senders[i].sc.control_socket,
                        payloads[i],
                    )
                    assert all(o.ok for o in outcomes.values()), outcomes

                async with trio.open_nursery() as both:
                    both.start_soon(one, 0)
                    both.start_soon(one, 1)
                landed = [s["landed_bytes"] for s in receiver.status()["rdma"].values()]
                assert landed == [3 * sum(LAYERS)] * 2
                assert all(s.metrics.bytes_sent._value.get() == 0 for s in senders)
                n.cancel_scope.cancel()

    trio.run(main)
    assert_no_leaks(fabric)


def test_rdma_is_offered_again_after_a_link_failure(tmp_path: Path) -> None:
    """A failed link is not forever: after rdma.reoffer_s the sender offers again, and once
    the fabric works new requests go by RDMA again."""
    fabric = new_fabric()

    async def body(rig: Rig) -> None:
        assert (await rig.negotiated())["backend"] == "rdma"
        fabric.link_broken = True
        outcomes = await rig.ship(
            make_payloads(1),
        )
        assert all(o.ok for o in outcomes.values())  # finished over TCP
        await rig.until(lambda: rig.backend() == "tcp")
        by_tcp = rig.sender.metrics.bytes_sent._value.get()
        assert by_tcp > 0
        fabric.link_broken = False  # the fabric is back
        await rig.until(lambda: rig.backend() == "rdma", timeout=5)
        outcomes = await rig.ship(
            make_payloads(2),
        )
        assert all(o.ok for o in outcomes.values())
        assert rig.sender.metrics.bytes_sent._value.get() == by_tcp  # all by RDMA
        rdma = rig.sender.status()["peers"][rig.peer.name]["rdma"]
        assert rdma["fallbacks"] == 1
        assert len(rig.receiver.status()["rdma"]) == 1

    quick = replace(RDMA, reoffer_s=0.3)
    trio.run(functools.partial(with_daemons, tmp_path, body, fabric=fabric, tx_rdma=quick))
    assert_no_leaks(fabric)
