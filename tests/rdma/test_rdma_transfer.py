"""End-to-end RDMA transfers over the fake fabric: real shared-memory pools, QP info swapped
over a real loopback TCP connection, bytes really copied, the protocol's ReceiveTracker
deciding layer and request completion, and the TCP fallback over a real WireConn."""

from __future__ import annotations

import trio
from xdc.transport.rdma.verbs import RdmaLinkError
from xdc.transport.shm import count_segments
from xdc.transport.wire import WireConn

from tests.rdma_link_fixtures import (
    CHUNK,
    LAYERS,
    RX_OFFSET,
    Rig,
    make_rig,
    run_transfer,
)
from xdc.protocol import (
    PROTOCOL_VERSION,
    Ack,
    ChunkHeader,
    Complete,
    Disposition,
    Event,
    Hello,
    LayerDone,
    Limits,
    Nack,
    chunk_checksum,
)


def test_layerwise_rdma_transfer_with_two_phase_visibility() -> None:
    async def main() -> Rig:
        rig = await make_rig(verify_every=3)
        observed: list[tuple[int, bool, bool]] = []

        async def after(layer: int) -> None:
            # wait until the receiver reports this layer done (empty layers are done at once)
            with trio.fail_after(5):
                while not rig.tracker.layer_complete(layer):
                    await trio.sleep(0.001)
            nxt = layer + 1 < len(LAYERS) and rig.tracker.layer_complete(layer + 1)
            observed.append((layer, nxt, rig.tracker.complete))

        await run_transfer(rig, after)
        # layer i was complete while layer i+1 (not yet handed over) was not, and the request
        # stayed invisible (not complete) until its last layer
        assert [o for o in observed if o[0] < len(LAYERS) - 1 and LAYERS[o[0] + 1]] == [
            (i, False, False) for i in (1, 2, 3)
        ]
        return rig

    rig = trio.run(main)
    try:
        assert rig.tracker.complete and rig.landed() == rig.payload
        done = [e.layer for e in rig.events if isinstance(e, LayerDone)]
        assert done == [0, 2, 3, 4]  # in order; the empty layer never needed a chunk
        assert [e for e in rig.events if isinstance(e, Complete)] == [
            Complete("req-1", len(rig.payload))
        ]
        land = rig.zone.slots[0]
        chunks = land.chunks.count
        assert land.verified_by_sample == len(range(land.grant.phase, chunks, 3))
        assert land.verified_by_sample + land.unchecked == chunks
        assert not any(isinstance(e, Nack) for e in rig.events)
    finally:
        rig.close()
    rig.assert_clean()


def test_corruption_caught_by_checksum_and_rewritten() -> None:
    async def main() -> Rig:
        rig = await make_rig(verify_every=1)
        assert rig.fabric is not None
        rig.fabric.corrupt_writes = 3
        await run_transfer(rig)
        return rig

    rig = trio.run(main)
    try:
        nacks = [e for e in rig.events if isinstance(e, Nack)]
        assert 1 <= len(nacks) <= 3
        assert rig.tracker.complete and rig.landed() == rig.payload
        assert sum(r.resent for r in rig.sender.writer.requests.values()) in (0, len(nacks))
    finally:
        rig.close()
    rig.assert_clean()


def test_persistent_corruption_gives_up_rdma() -> None:
    """A path that corrupts every write is not retried forever: the sender gives RDMA up."""

    async def main() -> tuple[Rig, list[str]]:
        rig = await make_rig(verify_every=1)
        assert rig.fabric is not None
        rig.fabric.corrupt_writes = 10**9
        failures: list[str] = []
        try:
            with trio.fail_after(5):
                await run_transfer(rig)
        except* RdmaLinkError as group:  # raised inside run_transfer's nurseries
            failures = _leaf_messages(group)  # strings only: tracebacks would pin the pools
        return rig, failures

    rig, failures = trio.run(main)
    try:
        assert len(failures) == 1 and "failed its checksum 4 times" in failures[0]
        assert not rig.tracker.complete
    finally:
        rig.close()
    rig.assert_clean()


def _leaf_messages(exc: BaseException) -> list[str]:
    if isinstance(exc, BaseExceptionGroup):
        return [m for sub in exc.exceptions for m in _leaf_messages(sub)]
    return [str(exc)]


def test_unsampled_corruption_is_trusted_to_the_link() -> None:
    """verify_every=0 trusts RC's CRC entirely: the fake's flipped byte goes unnoticed. This
    is the documented trade-off, and why the default samples."""

    async def main() -> Rig:
        rig = await make_rig(verify_every=0)
        assert rig.fabric is not None
        rig.fabric.corrupt_writes = 1
        await run_transfer(rig)
        return rig

    rig = trio.run(main)
    try:
        assert rig.tracker.complete and rig.landed() != rig.payload
    finally:
        rig.close()
    rig.assert_clean()


async def _tcp_receive(wire: WireConn, rig: Rig) -> int:
    """The TCP path's landing, as the receiver daemon does it: same tracker, same pool."""
    assert isinstance(await wire.next_event(), Hello)  # the sender speaks first
    await wire.send(Hello(PROTOCOL_VERSION, "rx", "receiver", "s", 0))
    scratch = memoryview(bytearray(CHUNK))
    duplicates = 0
    while not rig.tracker.complete:
        hdr = await wire.next_event()
        assert isinstance(hdr, ChunkHeader)
        rel, disp = rig.tracker.locate(hdr)
        if disp is Disposition.IN_PLACE:
            dest = rig.rx_pool.view[RX_OFFSET + rel : RX_OFFSET + rel + hdr.length]
        else:
            dest = scratch[: hdr.length]
            duplicates += 1
        assert await wire.read_payload(dest)
        ok = chunk_checksum(dest, hdr.rid, hdr.layer, hdr.offset) == hdr.checksum
        out = rig.tracker.finish(hdr, disp, ok)
        assert ok and not out.live_corrupted
        await wire.send(Ack(hdr.rid, hdr.layer, hdr.offset))
    return duplicates


def test_link_failure_falls_back_to_tcp_without_leaks() -> None:
    async def main() -> tuple[Rig, str, int, int]:
        rig = await make_rig(verify_every=4)
        a, b = trio.socket.socketpair()
        tx_wire, rx_wire = WireConn(a, "sender", Limits()), WireConn(b, "receiver", Limits())
        send_ch, recv_ch = trio.open_memory_channel[Event](1000)
        result: dict[str, object] = {}

        async def to_sender(ev: Event) -> None:
            rig.events.append(ev)
            await send_ch.send(ev)

        async def tcp_resend(rid: str, chunks: list[tuple[int, int, int]]) -> None:
            # the receiver learns of the fallback on the control connection and drops its QP
            rx_scope.cancel()
            rig.rx_ep.close()
            result["resent"] = len(chunks)
            await tx_wire.send(Hello(PROTOCOL_VERSION, "tx", "sender", "s", 0))
            await tx_wire.next_event()
            offsets = rig.tracker.begin.layer_offsets
            for layer, off, length in chunks:
                pos = offsets[layer] + off
                data = rig.tx_pool.view[pos : pos + length]
                hdr = ChunkHeader(rid, layer, off, length, chunk_checksum(data, rid, layer, off))
                await tx_wire.send_chunk(hdr, data)

        async with trio.open_nursery() as n:
            rx_scope = trio.CancelScope()

            async def rdma_rx() -> None:
                with rx_scope:
                    await rig.receiver.run(to_sender)

            async def tcp_rx() -> None:
                result["dups"] = await _tcp_receive(rx_wire, rig)

            async def send() -> None:
                result["backend"] = await rig.sender.run_with_fallback(recv_ch, tcp_resend)

            n.start_soon(rdma_rx)
            n.start_soon(tcp_rx)
            n.start_soon(send)
            rig.sender.layer_ready("req-1", 0)
            with trio.fail_after(5):
                while not rig.tracker.layer_complete(0):
                    await trio.sleep(0.001)
            assert rig.fabric is not None
            rig.fabric.link_broken = True  # the RC path dies mid-transfer
            for layer in range(1, len(LAYERS)):
                rig.sender.layer_ready("req-1", layer)
        tx_wire.close()
        rx_wire.close()
        return rig, str(result["backend"]), int(str(result["resent"])), int(str(result["dups"]))

    before = count_segments("xdc-test")
    rig, backend, resent, dups = trio.run(main)
    try:
        assert backend == "tcp"
        assert rig.tracker.complete and rig.landed() == rig.payload
        # layer 0 was confirmed over RDMA and is not resent; everything else is
        first_other = -(-LAYERS[0] // CHUNK)
        assert resent == rig.zone.slots[0].chunks.count - first_other
        assert dups <= resent  # chunks that had landed by RDMA before the link died
    finally:
        rig.close()
    rig.assert_clean()
    assert count_segments("xdc-test") == before
