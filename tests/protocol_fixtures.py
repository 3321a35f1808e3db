"""Helpers shared by the protocol tests (no tests here): frame builders and a tiny driver.

The driver does what the receiver daemon does with a connection, minus the sockets: create a
tracker per BEGIN, land each CHUNK in place or in scratch, verify it, and record which
requests completed, so tests can compare the landed bytes with what the sender meant.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from xdc.protocol import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    PROTOCOL_VERSION,
    Begin,
    ChunkHeader,
    Connection,
    Disposition,
    End,
    Event,
    Hello,
    Limits,
    ProtocolError,
    ReceiveTracker,
    checksum,
    encode,
    encode_chunk_header,
)

LIMITS = Limits()
SENDER_HELLO = Hello(PROTOCOL_VERSION, "prefill-1", "sender", "sess-1", 0)
RECEIVER_HELLO = Hello(PROTOCOL_VERSION, "decode-1", "receiver", "sess-1", 0)
CHUNK = 4096


def raw_frame(
    ftype: int,
    header: bytes,
    payload_len: int = 0,
    *,
    magic: bytes = b"XD",
    flags: int = 0,
    reserved: int = 0,
    header_len: int | None = None,
) -> bytes:
    """A frame prefix + header built by hand, so tests can break any single field."""
    hlen = len(header) if header_len is None else header_len
    return struct.pack("!2sBBHHI", magic, ftype, flags, hlen, reserved, payload_len) + header


def raw(ftype: int, fields: Any, payload_len: int = 0) -> bytes:
    return raw_frame(ftype, msgpack.packb(fields, use_bin_type=True), payload_len)


def chunk_frame(rid: str, layer: int, offset: int, payload: bytes) -> bytes:
    hdr = ChunkHeader(rid, layer, offset, len(payload), checksum(payload))
    return encode_chunk_header(hdr) + payload


def open_receiver() -> Connection:
    """A receiver-role connection that has completed the handshake."""
    conn = Connection("receiver", LIMITS)
    conn.receive_data(encode(SENDER_HELLO))
    assert conn.next_event() == SENDER_HELLO
    conn.send(RECEIVER_HELLO)
    return conn


def open_sender() -> Connection:
    conn = Connection("sender", LIMITS)
    conn.send(SENDER_HELLO)
    conn.receive_data(encode(RECEIVER_HELLO))
    assert conn.next_event() == RECEIVER_HELLO
    return conn


def drain(conn: Connection) -> list[Event | bytes]:
    """All events available now; each CHUNK header is followed by its payload bytes."""
    out: list[Event | bytes] = []
    while True:
        ev = conn.next_event()
        if ev is NEED_DATA or ev is CLOSED:
            return out
        if ev is PAYLOAD:
            n = conn.payload_buffered
            if n == 0:
                return out
            buf = bytearray(n)
            assert conn.take_buffered_payload(memoryview(buf)) == n
            if out and isinstance(out[-1], bytes):
                out[-1] += bytes(buf)
            else:
                out.append(bytes(buf))
            continue
        out.append(ev)
        if isinstance(ev, ChunkHeader):
            out.append(b"")


# ---- a valid sender stream with known bytes per cell ------------------------------------------


@dataclass
class Stream:
    data: bytes
    begins: dict[str, Begin]
    payloads: dict[tuple[str, int, int], bytes]  # (rid, layer, offset) -> the sender's bytes


def make_stream(
    rng: random.Random, requests: list[tuple[str, list[int]]], *, chunk_bytes: int = CHUNK
) -> Stream:
    """HELLO, the BEGINs, every chunk of every request exactly once in random order, ENDs."""
    parts = [encode(SENDER_HELLO)]
    begins: dict[str, Begin] = {}
    payloads: dict[tuple[str, int, int], bytes] = {}
    chunks: list[bytes] = []
    for rid, sizes in requests:
        begin = Begin(rid, tuple(sizes), chunk_bytes, (11, 22, 33), 1, 30_000)
        begins[rid] = begin
        parts.append(encode(begin))
        for layer, size in enumerate(sizes):
            for offset in range(0, size, chunk_bytes):
                payload = rng.randbytes(min(chunk_bytes, size - offset))
                payloads[(rid, layer, offset)] = payload
                chunks.append(chunk_frame(rid, layer, offset, payload))
    rng.shuffle(chunks)
    parts += chunks
    parts += [encode(End(rid)) for rid in begins]
    return Stream(b"".join(parts), begins, payloads)


@dataclass
class _Current:
    hdr: ChunkHeader
    tracker: ReceiveTracker
    disposition: Disposition
    dest: memoryview
    got: int = 0


@dataclass
class Driver:
    """Receiver-side daemon logic over one Connection, with no sockets."""

    conn: Connection = field(default_factory=lambda: Connection("receiver", LIMITS))
    trackers: dict[str, ReceiveTracker] = field(default_factory=dict)
    buffers: dict[str, bytearray] = field(default_factory=dict)
    completed: set[str] = field(default_factory=set)
    error: ProtocolError | None = None
    events: list[Event] = field(default_factory=list)
    _cur: _Current | None = None
    _scratch: bytearray = field(default_factory=lambda: bytearray(LIMITS.max_chunk_bytes))

    def feed(self, data: bytes, *, direct: bool = False) -> None:
        """Feed one read. With ``direct``, payload bytes go straight into the destination
        (as recv_into would) and are reported with payload_consumed."""
        if self.error is not None:
            return
        try:
            if direct and data and self._cur is not None and self.conn.payload_buffered == 0:
                cur = self._cur
                n = min(len(data), self.conn.payload_pending)
                cur.dest[cur.got : cur.got + n] = data[:n]
                self.conn.payload_consumed(n)
                cur.got += n
                data = data[n:]
                self._maybe_finish()
                if not data:
                    self._pump()
                    return
            self.conn.receive_data(data)
            self._pump()
        except ProtocolError as exc:
            self.error = exc
            if self._cur is not None:
                self._cur.tracker.abandon(self._cur.hdr, self._cur.disposition)
                self._cur = None

    def _pump(self) -> None:
        while True:
            ev = self.conn.next_event()
            if ev is NEED_DATA or ev is CLOSED:
                return
            if ev is PAYLOAD:
                cur = self._cur
                if cur is None:  # only while a skipped payload drains, which is not PAYLOAD
                    raise AssertionError("PAYLOAD without a chunk in progress")
                n = self.conn.take_buffered_payload(cur.dest[cur.got :])
                cur.got += n
                if not self._maybe_finish():
                    return
                continue
            self.events.append(ev)
            if isinstance(ev, Hello):
                self.conn.send(RECEIVER_HELLO)
            elif isinstance(ev, Begin):
                if ev.rid not in self.trackers:
                    self.trackers[ev.rid] = ReceiveTracker(ev)
                    self.buffers[ev.rid] = bytearray(ev.total_bytes)
            elif isinstance(ev, ChunkHeader):
                self._start_chunk(ev)

    def _start_chunk(self, hdr: ChunkHeader) -> None:
        tracker = self.trackers.get(hdr.rid)
        if tracker is None:
            self.conn.skip_payload()
            return
        try:
            pos, disposition = tracker.locate(hdr)
        except ProtocolError as exc:  # request-scoped: the connection carries on
            assert exc.rid == hdr.rid
            self.conn.skip_payload()
            return
        if disposition is Disposition.IN_PLACE:
            dest = memoryview(self.buffers[hdr.rid])[pos : pos + hdr.length]
        else:
            dest = memoryview(self._scratch)[: hdr.length]
        self._cur = _Current(hdr, tracker, disposition, dest)

    def _maybe_finish(self) -> bool:
        cur = self._cur
        assert cur is not None
        if cur.got < cur.hdr.length:
            return False
        assert self.conn.payload_pending == 0
        self._cur = None
        ok = checksum(cur.dest) == cur.hdr.checksum
        out = cur.tracker.finish(cur.hdr, cur.disposition, ok)
        if out.copy_from_scratch:
            pos = cur.tracker.begin.layer_offsets[cur.hdr.layer] + cur.hdr.offset
            self.buffers[cur.hdr.rid][pos : pos + cur.hdr.length] = cur.dest
        if out.request_done:
            assert cur.tracker.complete
            self.completed.add(cur.hdr.rid)
        return True

    def landed_correctly(self, stream: Stream, rid: str) -> bool:
        """Every grid cell of the request as *received* holds the sender's bytes for it."""
        begin = self.trackers[rid].begin
        buf = self.buffers[rid]
        for layer, start in enumerate(begin.layer_offsets):
            size = begin.layer_sizes[layer]
            for offset in range(0, size, begin.chunk_bytes):
                length = min(begin.chunk_bytes, size - offset)
                expected = stream.payloads.get((rid, layer, offset))
                if expected is None or len(expected) != length:
                    return False
                if buf[start + offset : start + offset + length] != expected:
                    return False
        return True
