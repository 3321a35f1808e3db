"""Chunk payloads moved in worker threads (``WireConn(threaded=True)``, config
``data_threads``), on real loopback sockets (whole chunks through small buffers and a stalled
peer: test_sockio, in both modes): a corrupted payload is judged wrong, a vanished peer still
ends the wait, cancellation and close reach a thread blocked in the kernel, the socket is
closed only once the thread let go of it, and a chunk's guard keeps a thread from landing
bytes while the receiver copies a verified resend into place. Each runs on plain TCP and on
sealed records (the thread then also seals and opens), plus a forged record caught in the
thread."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import trio
from xdc.transport.daemon import link_description
from xdc.transport.sealed_records import SealedRecords
from xdc.transport.sockio import THREAD_POLL_S
from xdc.transport.wire import PeerClosed, WireConn

from tests.transport_fixtures import chunk_header, wire_pair
from xdc.config import (
    DATA_THREADS_MIN_CORES,
    ConfigError,
    DataThreads,
    data_threads_for,
    load_config,
)
from xdc.protocol import ChunkHeader, Limits, Ping, chunk_checksum
from xdc.protocol.aead_records import HEADER, Cipher

LIMITS = Limits()


@pytest.fixture(params=[None, *Cipher], ids=lambda c: c.label if c else "plain")
def sealed(request: pytest.FixtureRequest) -> Cipher | None:
    """Plain TCP, or sealed records with each cipher."""
    c: Cipher | None = request.param
    return c


async def _pair(
    body: Callable[[WireConn, WireConn], Awaitable[None]],
    *,
    sealed: Cipher | None,
    rcvbuf: int = 0,
    sndbuf: int = 0,
) -> None:
    async def checked(tx: WireConn, rx: WireConn) -> None:
        assert tx.threaded and rx.threaded
        assert (tx.tls is not None) is (sealed is not None)
        await body(tx, rx)

    await wire_pair(checked, threaded=True, rcvbuf=rcvbuf, sndbuf=sndbuf, sealed=sealed)


async def _raw(tx: WireConn, data: memoryview) -> None:
    """Bytes on the wire as the connection's record layer carries them, outside any frame."""
    if tx.io is not None:
        await tx.io.send_all([data])
    else:
        assert isinstance(tx.tls, SealedRecords)
        await tx.tls.send_all([data])


def _check(hdr: ChunkHeader) -> Callable[[memoryview], bool]:
    return lambda d: chunk_checksum(d, "r", 0, hdr.offset) == hdr.checksum


async def _start_chunk(tx: WireConn, payload: bytes, first: int) -> None:
    """A CHUNK header and the first ``first`` bytes of its payload, written by hand."""
    await _raw(tx, memoryview(tx.proto.send_chunk_header(chunk_header(payload))))
    await _raw(tx, memoryview(payload)[:first])


def test_a_corrupted_payload_is_reported_by_the_threaded_check(sealed: Cipher | None) -> None:
    payload = os.urandom(300_000)

    async def body(tx: WireConn, rx: WireConn) -> None:
        bad = chunk_header(payload)
        bad = ChunkHeader(bad.rid, bad.layer, bad.offset, bad.length, bad.checksum ^ 1)
        await tx.send_chunk(bad, memoryview(payload))  # no digest: the header goes as given
        ev = await rx.next_event()
        assert isinstance(ev, ChunkHeader)
        got = bytearray(ev.length)
        assert await rx.read_payload_checked(memoryview(got), _check(ev)) is False
        assert bytes(got) == payload  # landed, and judged wrong: the caller NACKs it

    trio.run(lambda: _pair(body, sealed=sealed))


def test_a_peer_closing_mid_payload_is_peer_closed_not_a_hang(sealed: Cipher | None) -> None:
    payload = os.urandom(256 * 1024)

    async def body(tx: WireConn, rx: WireConn) -> None:
        await _start_chunk(tx, payload, 5000)
        tx.close()
        ev = await rx.next_event()
        assert isinstance(ev, ChunkHeader)
        with trio.fail_after(5), pytest.raises(PeerClosed, match="mid-payload"):
            await rx.read_payload_checked(memoryview(bytearray(len(payload))), _check(ev))

    trio.run(lambda: _pair(body, sealed=sealed))


def test_cancelling_a_send_blocked_in_its_thread_ends_within_the_poll_interval(
    sealed: Cipher | None,
) -> None:
    """The peer reads nothing, so the thread waits in poll() for room that never comes; a
    cancelled task must get its thread back promptly, and the socket must still be open (the
    thread was using it) until the connection is closed."""
    payload = os.urandom(4 << 20)  # max_chunk_bytes; far more than the buffers hold

    async def body(tx: WireConn, rx: WireConn) -> None:
        t0 = trio.current_time()
        with trio.move_on_after(0.3) as scope:
            await tx.send_chunk(chunk_header(payload), memoryview(payload))
        assert scope.cancelled_caught
        assert trio.current_time() - t0 < 0.3 + 20 * THREAD_POLL_S  # not a hang
        assert tx.sock.fileno() != -1 and not tx.closed

    trio.run(lambda: _pair(body, sealed=sealed, rcvbuf=64 * 1024, sndbuf=64 * 1024))


def test_closing_during_a_blocked_send_ends_it_and_closes_the_socket_after_the_thread(
    sealed: Cipher | None,
) -> None:
    payload = os.urandom(4 << 20)  # max_chunk_bytes; far more than the buffers hold

    async def body(tx: WireConn, rx: WireConn) -> None:
        seen: list[int] = []

        async def closer() -> None:
            await trio.sleep(0.3)
            tx.close()
            seen.append(tx.sock.fileno())  # the thread still holds it: not closed yet

        async with trio.open_nursery() as n:
            n.start_soon(closer)
            with trio.fail_after(5), pytest.raises(PeerClosed, match="closing"):
                await tx.send_chunk(chunk_header(payload), memoryview(payload))
        assert seen and seen[0] != -1
        assert tx.sock.fileno() == -1  # closed once the thread returned

    trio.run(lambda: _pair(body, sealed=sealed, rcvbuf=64 * 1024, sndbuf=64 * 1024))


def test_still_wanted_false_skips_the_rest_and_the_next_frame_parses(sealed: Cipher | None) -> None:
    payload = os.urandom(1 << 20)

    async def body(tx: WireConn, rx: WireConn) -> None:
        wanted = True

        async def send() -> None:
            await _start_chunk(tx, payload, 100_000)
            await trio.sleep(0.3)
            nonlocal wanted
            wanted = False
            await trio.sleep(0.3)
            await _raw(tx, memoryview(payload)[100_000:])
            await tx.send(Ping(9))

        async with trio.open_nursery() as n:
            n.start_soon(send)
            ev = await rx.next_event()
            assert isinstance(ev, ChunkHeader)
            got = bytearray(ev.length)
            with trio.fail_after(5):
                assert (
                    await rx.read_payload_checked(memoryview(got), _check(ev), lambda: wanted)
                    is None
                )
            assert bytes(got[100_000:]) == bytes(len(got) - 100_000)  # nothing more landed
            ping = await rx.next_event()
        assert isinstance(ping, Ping) and ping.nonce == 9

    trio.run(lambda: _pair(body, sealed=sealed))


def test_a_held_guard_keeps_the_thread_from_landing_bytes(sealed: Cipher | None) -> None:
    """What the receiver relies on when a verified resend of the same chunk is copied into
    place: while it holds the in-place read's guard, that read writes nothing; once it marks
    the chunk superseded and lets go, the read stops without writing another byte."""
    payload = bytes(i % 251 + 1 for i in range(1 << 20))  # no zero byte: landed = nonzero

    async def body(tx: WireConn, rx: WireConn) -> None:
        guard = threading.Lock()
        superseded = False
        await _start_chunk(tx, payload, 50_000)
        ev = await rx.next_event()
        assert isinstance(ev, ChunkHeader)
        got = bytearray(ev.length)
        result: list[bool | None] = []

        async def read() -> None:
            result.append(
                await rx.read_payload_checked(
                    memoryview(got), _check(ev), lambda: not superseded, guard
                )
            )

        async with trio.open_nursery() as n:
            n.start_soon(read)
            with trio.fail_after(10):  # the thread takes the first 50,000 bytes, then waits
                while len(got) - bytes(got).count(0) < 50_000:
                    await trio.sleep(0.01)
            landed = len(got) - bytes(got).count(0)
            assert landed == 50_000
            with guard:
                await _raw(tx, memoryview(payload)[50_000:])
                time.sleep(0.3)  # trio's thread holds the guard: the reader must not land
                assert len(got) - bytes(got).count(0) == landed
                superseded = True
        assert result == [None]
        assert len(got) - bytes(got).count(0) == landed
        assert bytes(got[:50_000]) == payload[:50_000]

    trio.run(lambda: _pair(body, sealed=sealed))


def test_tls_records_never_take_the_threaded_path() -> None:
    """TLS records (``tls.record_layer = tls``) stay on trio's thread; sealed records, the
    default, take it (every test above runs them)."""

    async def body() -> None:
        a, b = socket.socketpair()
        with a, b:
            ta = trio.socket.from_stdlib_socket(a)
            w = WireConn(ta, "sender", LIMITS, tls=object(), threaded=True)  # type: ignore[arg-type]
            assert not w.threaded

    trio.run(body)


@pytest.mark.parametrize("cipher", list(Cipher), ids=lambda c: c.label)
def test_a_forged_record_in_a_threaded_payload_drops_the_connection(cipher: Cipher) -> None:
    """A record that fails authentication while a thread opens a payload in place: the
    connection is dropped (PeerClosed), never a verdict on the bytes it left in ``dest``."""
    payload = os.urandom(600_000)

    async def body(tx: WireConn, rx: WireConn) -> None:
        await _start_chunk(tx, payload, 200_000)
        forged = HEADER.pack(100_000 + cipher.tag) + os.urandom(100_000 + cipher.tag)
        assert isinstance(tx.tls, SealedRecords)
        await tx.tls.io.send_all([memoryview(forged)])  # past the sealer: not a record of its
        ev = await rx.next_event()
        assert isinstance(ev, ChunkHeader)
        with trio.fail_after(5), pytest.raises(PeerClosed, match="bad sealed record"):
            await rx.read_payload_checked(memoryview(bytearray(ev.length)), _check(ev))

    trio.run(lambda: _pair(body, sealed=cipher))


def test_data_threads_setting_is_checked_and_auto_follows_the_core_count() -> None:
    with pytest.raises(ConfigError, match=r"sender\.data_threads: 'yes' is not one of"):
        load_config(env={}, overrides={"sender.data_threads": "yes"})
    with pytest.raises(ConfigError, match=r"receiver\.data_threads"):
        load_config(env={}, overrides={"receiver.data_threads": ""})
    cfg = load_config(env={"XDC_RECEIVER__DATA_THREADS": "on"}, overrides={})
    assert cfg.receiver.data_threads == "on" and cfg.sender.data_threads == "auto"
    assert data_threads_for("auto", cores=DATA_THREADS_MIN_CORES - 1) == DataThreads(False, False)
    # sealed records lost to their threads on every machine measured: auto keeps them off
    assert data_threads_for("auto", cores=DATA_THREADS_MIN_CORES) == DataThreads(True, False)
    assert data_threads_for("auto", cores=64) == DataThreads(True, False)
    assert data_threads_for("on", cores=1) == DataThreads(True, True)
    assert not data_threads_for("off", cores=64).any()


def test_the_start_up_line_says_which_connections_use_data_threads() -> None:
    auto_many = data_threads_for("auto", cores=16)
    assert (
        link_description(False, auto_many) == "plain TCP: tls.mode = off, payloads in data threads"
    )
    assert link_description(True, auto_many) == "mutual TLS 1.3"
    on = data_threads_for("on", cores=16)
    assert link_description(True, on) == "mutual TLS 1.3, payloads in data threads (sealed records)"
    assert link_description(False, data_threads_for("off")) == "plain TCP: tls.mode = off"


def test_auto_counts_the_cores_this_process_may_use_not_the_hosts() -> None:
    """A daemon pinned to one core (taskset, a cpuset) has no spare core for its threads."""
    code = (
        "from xdc.config import data_threads_for, usable_cores;"
        "print(usable_cores(), data_threads_for('auto').plain)"
    )
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["1", "False"], out
