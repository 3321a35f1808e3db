"""Sealed records on real loopback sockets (transport/sealed_records.py): a payload leaves as
cache-sized records, a reader told a payload is coming waits for all of it at once instead of
waking per record, and the wait can never outlast a peer that sends less or goes away."""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable

import pytest
import trio
from xdc.transport.sealed_records import SEND_RECORD, SealedRecords
from xdc.transport.sockio import IdleTimeout, lowat_for

from tests.transport_fixtures import loopback_tcp_pair
from xdc.protocol.aead_records import HEADER, SHARE_BYTES, TAG, Opener, Sealer, direction_secrets


async def _pair(body: Callable[[SealedRecords, SealedRecords], Awaitable[None]]) -> None:
    """A sender/receiver SealedRecords pair over loopback TCP, keyed for one direction."""
    client, server = await loopback_tcp_pair()
    c2s, s2c = direction_secrets(os.urandom(SHARE_BYTES), os.urandom(SHARE_BYTES))
    tx = SealedRecords(client, Sealer(c2s), Opener(s2c), None)
    rx = SealedRecords(server, Sealer(s2c), Opener(c2s), None)
    try:
        with trio.fail_after(20):
            await body(tx, rx)
    finally:
        client.close()
        server.close()


def test_a_payload_leaves_as_records_no_larger_than_the_send_size() -> None:
    payload = os.urandom(3 * SEND_RECORD + 5)

    async def body(tx: SealedRecords, rx: SealedRecords) -> None:
        await tx.send_all([memoryview(payload)])
        wire = bytearray()
        want = len(payload) + 4 * (HEADER.size + TAG)
        while len(wire) < want:
            wire += await rx.sock.recv(1 << 20)
        assert len(wire) == want  # four records, nothing else
        opener, pos, plain = rx.opener, 0, bytearray()
        sizes = []
        while pos < len(wire):
            n = opener.plaintext_length(bytes(wire[pos : pos + HEADER.size]))
            end = pos + HEADER.size + n + TAG
            out = bytearray(n)
            at = pos + HEADER.size
            hdr, body_ = memoryview(wire)[pos:at], memoryview(wire)[at:end]
            opener.open_into(hdr, body_, memoryview(out))
            plain += out
            sizes.append(n)
            pos = end
        assert sizes == [SEND_RECORD, SEND_RECORD, SEND_RECORD, 5]
        assert bytes(plain) == payload

    trio.run(_pair, body)


def test_a_reader_told_a_payload_is_coming_waits_for_all_of_it_not_each_record() -> None:
    payload = os.urandom(8 * SEND_RECORD)  # 2 MiB: eight records

    async def body(tx: SealedRecords, rx: SealedRecords) -> None:
        dest = bytearray(len(payload))
        got = 0

        async def read() -> None:
            nonlocal got
            view = memoryview(dest)
            while got < len(dest):
                got += await rx.recv_into(view[got:], lowat_for(len(dest) - got))

        async with trio.open_nursery() as n:
            n.start_soon(read)
            await tx.send_all([memoryview(payload)[:SEND_RECORD]])  # one record of eight
            await trio.sleep(0.2)
            # still waiting, for the whole payload's worth, not for the next record
            mark = rx.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)
            assert got < len(dest)
            assert mark > 2 * (SEND_RECORD + HEADER.size + TAG), mark
            await tx.send_all([memoryview(payload)[SEND_RECORD:]])
        assert bytes(dest) == payload

    trio.run(_pair, body)


def test_inside_a_payload_a_read_stops_at_the_next_records_header() -> None:
    """What a reader buffers past a record is moved to its buffer's front after opening it;
    inside a payload it reads no further than the next record's header (64 KiB moved per
    256 KiB record was a quarter more copying), and what follows the payload (a small frame,
    the next chunk's header) still arrives whole, read ahead as before."""
    payload = os.urandom(4 * SEND_RECORD + 777)
    frame = os.urandom(300)

    async def body(tx: SealedRecords, rx: SealedRecords) -> None:
        await tx.send_all([memoryview(payload)])
        await tx.send_all([memoryview(frame)])
        await trio.sleep(0.1)  # all of it in the socket: a read could take as much as it likes
        dest = bytearray(len(payload))
        view, got, left_over = memoryview(dest), 0, []
        while got < len(dest):
            got += await rx.recv_into(view[got:], lowat_for(len(dest) - got))
            left_over.append(rx._have)
        assert bytes(dest) == payload
        assert max(left_over[:-1]) <= HEADER.size, left_over  # records with payload after them
        small = bytearray(len(frame))
        assert await rx.recv_into(memoryview(small)) == len(frame)
        assert bytes(small) == frame

    trio.run(_pair, body)


def test_a_wait_for_a_payload_ends_at_the_idle_timeout_when_the_peer_sends_less() -> None:
    async def body(tx: SealedRecords, rx: SealedRecords) -> None:
        rx.io.idle_timeout = 0.3
        dest = bytearray(4 * SEND_RECORD)
        await tx.send_all([memoryview(os.urandom(SEND_RECORD))])  # a quarter, then silence
        view = memoryview(dest)
        got = await rx.recv_into(view, lowat_for(len(dest)))
        assert got == SEND_RECORD  # bytes already there are read at once, no wait
        start = trio.current_time()
        with pytest.raises(IdleTimeout):
            await rx.recv_into(view[got:], lowat_for(len(dest) - got))
        assert trio.current_time() - start < 5

    trio.run(_pair, body)


def test_a_wait_for_a_payload_ends_at_once_when_the_peer_goes_away() -> None:
    async def body(tx: SealedRecords, rx: SealedRecords) -> None:
        rx.io.idle_timeout = 30.0  # the end must come from the close, not from this
        dest = bytearray(4 * SEND_RECORD)
        view = memoryview(dest)
        got = 0

        async def read() -> None:
            nonlocal got
            while True:
                n = await rx.recv_into(view[got:], lowat_for(len(dest) - got))
                if not n:
                    return
                got += n

        with trio.fail_after(5):  # long before the idle timeout
            async with trio.open_nursery() as n:
                n.start_soon(read)
                await tx.send_all([memoryview(os.urandom(SEND_RECORD))])  # a quarter, then gone
                await trio.sleep(0.2)
                tx.sock.close()
        assert got == SEND_RECORD

    trio.run(_pair, body)
