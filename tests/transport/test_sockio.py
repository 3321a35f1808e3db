"""The plain-TCP data path's direct socket calls (transport/sockio.py through WireConn), on real
loopback sockets: marks never hold a small frame back, an idle peer is noticed, partial writes
complete in order, a busy connection still lets other tasks run and be cancelled, and a dead
peer is an error, never a hang."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
from xdc.transport.sockio import LOWAT_MAX, LOWAT_MIN, lowat_for
from xdc.transport.wire import PeerClosed, WireConn

from tests.transport_fixtures import wire_pair
from xdc.protocol import ChunkHeader, Limits, Ping, chunk_checksum

LIMITS = Limits()


async def _pair(
    body: Callable[[WireConn, WireConn], Awaitable[None]], *, rcvbuf: int = 0, sndbuf: int = 0
) -> None:
    await wire_pair(body, rcvbuf=rcvbuf, sndbuf=sndbuf)


def _digest(data: memoryview, offset: int) -> int:
    return chunk_checksum(data, "r", 0, offset)


def _chunk(payload: bytes, offset: int = 0) -> ChunkHeader:
    return ChunkHeader("r", 0, offset, len(payload), chunk_checksum(payload, "r", 0, offset))


def test_low_water_mark_only_for_a_large_missing_part() -> None:
    assert lowat_for(1) == 1
    assert lowat_for(LOWAT_MIN - 1) == 1
    assert lowat_for(LOWAT_MIN) == LOWAT_MIN
    assert lowat_for(10 * LOWAT_MAX) == LOWAT_MAX


def test_small_frame_after_a_trickled_payload_is_not_held_back() -> None:
    """The payload arrives in small pieces, so its reads wait with a large SO_RCVLOWAT; the
    PING that follows a pause is a few bytes and must still wake the reader at once."""
    payload = os.urandom(1 << 20)

    async def body(tx: WireConn, rx: WireConn) -> None:
        hdr = _chunk(payload)

        async def trickle() -> None:
            # header and payload by hand, 64 KiB at a time: the reader waits between pieces
            assert tx.io is not None
            await tx.io.send_all([memoryview(tx.proto.send_chunk_header(hdr))])
            for off in range(0, len(payload), 64 * 1024):
                await tx.io.send_all([memoryview(payload)[off : off + 64 * 1024]])
                await trio.sleep(0.005)
            await trio.sleep(0.3)  # the reader is waiting for a header now
            await tx.send(Ping(7))

        got = bytearray(len(payload))
        async with trio.open_nursery() as n:
            n.start_soon(trickle)
            ev = await rx.next_event()
            assert isinstance(ev, ChunkHeader) and ev.length == len(payload)
            assert await rx.read_payload(memoryview(got))
            with trio.fail_after(2):  # a stale 512 KiB mark would keep this asleep
                ping = await rx.next_event()
        assert isinstance(ping, Ping) and ping.nonce == 7
        assert bytes(got) == payload

    trio.run(_pair, body)


def test_silent_peer_ends_the_connection_after_the_idle_timeout() -> None:
    async def body(tx: WireConn, rx: WireConn) -> None:
        rx.idle_timeout = 0.3
        t0 = trio.current_time()
        with trio.fail_after(5), pytest.raises(PeerClosed, match="idle timeout"):
            await rx.next_event()
        assert 0.25 <= trio.current_time() - t0 < 3

    trio.run(_pair, body)


@pytest.mark.parametrize("threaded", [False, True], ids=["event-loop", "data-thread"])
def test_idle_timeout_also_ends_a_payload_that_stops_half_way(threaded: bool) -> None:
    payload = os.urandom(256 * 1024)

    async def body(tx: WireConn, rx: WireConn) -> None:
        assert tx.io is not None and rx.threaded is threaded
        await tx.io.send_all([memoryview(tx.proto.send_chunk_header(_chunk(payload)))])
        await tx.io.send_all([memoryview(payload)[:1000]])  # then nothing
        ev = await rx.next_event()
        assert isinstance(ev, ChunkHeader)
        rx.idle_timeout = 0.3
        t0 = trio.current_time()
        with trio.fail_after(5), pytest.raises(PeerClosed, match="idle timeout"):
            await rx.read_payload_checked(memoryview(bytearray(len(payload))), lambda _: True)
        assert 0.25 <= trio.current_time() - t0 < 3

    trio.run(lambda: wire_pair(body, threaded=threaded))


@pytest.mark.parametrize("threaded", [False, True], ids=["event-loop", "data-thread"])
def test_large_chunks_through_small_buffers_arrive_whole_and_in_order(threaded: bool) -> None:
    """Small socket buffers and a slow reader force many partial writes and waits on both
    ends; every chunk must come out byte for byte, in order, its checksum filled in by the
    sender (in its data thread when threaded) and verified by the receiver."""
    payloads = [os.urandom((1 << 20) + i * 4099) for i in range(6)]

    async def body(tx: WireConn, rx: WireConn) -> None:
        async def send() -> None:
            for i, p in enumerate(payloads):
                hdr = ChunkHeader("r", 0, i << 22, len(p), 0)  # the digest fills the checksum
                await tx.send_chunk(hdr, memoryview(p), partial(_digest, offset=i << 22))
            await tx.send(Ping(1))

        async with trio.open_nursery() as n:
            n.start_soon(send)
            for i, p in enumerate(payloads):
                ev = await rx.next_event()
                assert isinstance(ev, ChunkHeader) and ev.offset == i << 22
                got = bytearray(ev.length)
                check = lambda d, h=ev: chunk_checksum(d, "r", 0, h.offset) == h.checksum  # noqa: E731
                assert await rx.read_payload_checked(memoryview(got), check) is True
                assert bytes(got) == p
                await trio.sleep(0.01)
            assert isinstance(await rx.next_event(), Ping)

    trio.run(lambda: wire_pair(body, threaded=threaded, rcvbuf=64 * 1024, sndbuf=64 * 1024))


def test_busy_reader_still_lets_other_tasks_run_and_can_be_cancelled() -> None:
    """Data that is always there never makes the reader wait; it must still yield once per
    chunk (another task runs meanwhile) and stop when cancelled."""
    payload = os.urandom(64 * 1024)
    count = 40

    async def body(tx: WireConn, rx: WireConn) -> None:
        for i in range(count):  # all queued before the reader starts: it never waits
            await tx.send_chunk(_chunk(payload, i << 16), memoryview(payload))
        await trio.sleep(0.2)
        ticks = 0
        ticks_at_half = -1

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async def reader(scope: trio.CancelScope) -> None:
            nonlocal ticks_at_half
            got = memoryview(bytearray(len(payload)))
            for i in range(count):
                ev = await rx.next_event()
                assert isinstance(ev, ChunkHeader)
                assert await rx.read_payload(got)
                if i == count // 2:
                    ticks_at_half = ticks
            scope.cancel()

        async with trio.open_nursery() as n:
            n.start_soon(ticker)
            n.start_soon(reader, n.cancel_scope)
        assert ticks_at_half >= count // 4, ticks_at_half

        # cancellation reaches a reader whose data never runs dry
        for i in range(count):
            await tx.send_chunk(_chunk(payload, i << 16), memoryview(payload))
        await trio.sleep(0.2)
        done = 0
        with trio.CancelScope() as scope:
            scope.cancel()
            for _ in range(count):
                ev = await rx.next_event()
                if isinstance(ev, ChunkHeader):
                    await rx.read_payload(memoryview(bytearray(ev.length)))
                done += 1
        assert scope.cancelled_caught and done == 0

    trio.run(_pair, body)


def test_sending_to_a_peer_that_is_gone_raises_peer_closed() -> None:
    payload = os.urandom(4 << 20)

    async def body(tx: WireConn, rx: WireConn) -> None:
        rx.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        rx.close()  # RST: the sender's next writes fail
        with trio.fail_after(5), pytest.raises(PeerClosed):
            for i in range(8):
                await tx.send_chunk(_chunk(payload, i << 22), memoryview(payload))
        with trio.fail_after(5), pytest.raises(PeerClosed):
            await tx.next_event()

    trio.run(_pair, body)


def test_a_closed_connection_fails_cleanly_instead_of_touching_its_old_descriptor() -> None:
    async def body(tx: WireConn, rx: WireConn) -> None:
        tx.close()
        with pytest.raises(PeerClosed):
            await tx.send(Ping(1))
        with pytest.raises(PeerClosed):
            await tx.next_event()

    trio.run(_pair, body)
