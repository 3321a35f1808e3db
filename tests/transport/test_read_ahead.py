"""A plain-TCP payload read also takes the bytes after the payload, when they have come
(``sockio.READ_AHEAD``): the next frame's header is then served from the frame buffer, not
read by the event loop in a call of its own. Real loopback sockets, on the event loop and in
data threads: the payload bytes are exact, nothing is written past the payload's place, the
next payload (part of it read ahead) arrives exact, and bad bytes read ahead are judged by the
protocol like any others."""

from __future__ import annotations

import functools
import os

import pytest
import trio
from xdc.transport.sockio import READ_AHEAD
from xdc.transport.wire import WireConn

from tests.transport_fixtures import chunk_header, wait_unread, wire_pair
from xdc.errors import ProtocolError
from xdc.protocol import ChunkHeader, Ping, chunk_checksum

SENTINEL = b"\xa5" * 4096


async def _read_chunk(rx: WireConn, hdr: ChunkHeader) -> bytes:
    """The chunk's payload, read into a buffer with guard bytes behind it (checked intact)."""
    buf = bytearray(hdr.length) + bytearray(SENTINEL)
    with memoryview(buf) as view:
        verdict = await rx.read_payload_checked(
            view[: hdr.length],
            lambda d: chunk_checksum(d, "r", 0, hdr.offset) == hdr.checksum,
        )
    assert verdict is True
    assert buf[hdr.length :] == SENTINEL, "bytes were written past the payload's place"
    return bytes(buf[: hdr.length])


@pytest.mark.parametrize("threaded", [False, True], ids=["event-loop", "data-thread"])
def test_a_payload_read_brings_the_next_header_and_both_payloads_arrive_exact(
    threaded: bool,
) -> None:
    first, second = os.urandom(100_000), os.urandom(3 * READ_AHEAD)
    h1, h2 = chunk_header(first, 0), chunk_header(second, len(first))

    async def body(tx: WireConn, rx: WireConn) -> None:
        await tx.send_chunks([(h1, memoryview(first), None), (h2, memoryview(second), None)])
        await tx.send(Ping(7))
        before = rx.proto.next_event()  # nothing read yet: the protocol needs bytes
        assert before is not None and not isinstance(before, ChunkHeader)
        await wait_unread(rx.sock, len(first) + len(second))
        assert await rx.next_event() == h1
        assert await _read_chunk(rx, h1) == first
        # the next header came with the payload's last bytes: the state machine has it
        # without another read (a pure call: no socket is touched)
        assert rx.proto.next_event() == h2
        assert await _read_chunk(rx, h2) == second
        assert await rx.next_event() == Ping(7)

    trio.run(functools.partial(wire_pair, body, threaded=threaded))


@pytest.mark.parametrize("threaded", [False, True], ids=["event-loop", "data-thread"])
def test_garbage_read_ahead_is_refused_by_the_protocol_after_an_intact_payload(
    threaded: bool,
) -> None:
    payload = os.urandom(50_000)
    hdr = chunk_header(payload, 0)

    async def body(tx: WireConn, rx: WireConn) -> None:
        await tx.send_chunks([(hdr, memoryview(payload), None)])
        assert tx.io is not None
        await tx.io.send_all([memoryview(b"NOT A FRAME PREFIX AT ALL")])
        await wait_unread(rx.sock, len(payload) + 10)
        assert await rx.next_event() == hdr
        assert await _read_chunk(rx, hdr) == payload
        with pytest.raises(ProtocolError, match="magic"):
            await rx.next_event()

    trio.run(functools.partial(wire_pair, body, threaded=threaded))
