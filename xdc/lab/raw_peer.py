"""A hand-driven sender session on the real wire protocol: what a hostile or buggy peer on
a receiver's data port can do (the tests' hostile-peer cases and bench/soak.py's)."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Callable
from typing import Any

from xdc.protocol import (
    CLOSED,
    NEED_DATA,
    PROTOCOL_VERSION,
    ChunkHeader,
    Connection,
    Event,
    Hello,
    Limits,
    chunk_checksum,
)

_CONN_INDEX = itertools.count()


class RawSender:
    """A hand-driven sender session speaking the real wire protocol over a blocking socket:
    what a hostile or buggy peer on the data port can do."""

    def __init__(
        self,
        port: int,
        session: str,
        peer_id: str = "intruder",
        source: str = "",
        expect_hello: bool = True,
        conn_index: int | None = None,
    ) -> None:
        """``source``: the loopback address to connect from (127.0.0.2 is another host as
        far as the receiver can tell). ``conn_index``: the connection's number in its
        session (default: the next of a process-wide count, so that connections opened side
        by side are distinct ones, as a real sender's are; a connection that reuses a live
        one's number replaces it). The receiver's answer to our HELLO is ``answer``."""
        where = (source, 0) if source else None
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=where)
        self.conn = Connection("sender", Limits())
        index = next(_CONN_INDEX) % 256 if conn_index is None else conn_index
        self.send(Hello(PROTOCOL_VERSION, peer_id, "sender", session, index))
        self.answer = self.next_event()
        assert isinstance(self.answer, Hello) or not expect_hello, self.answer

    def send(self, event: Event) -> None:
        self.sock.sendall(self.conn.send(event))

    def send_chunk(
        self,
        rid: str,
        layer: int,
        offset: int,
        payload: bytes,
        upto: int | None = None,
        *,
        copy: bool | None = None,
        checksum: int | None = None,
    ) -> None:
        """A CHUNK with its true checksum (or ``checksum``); ``upto`` sends only that much of
        the payload (a peer that stalls half way); ``copy``: the header's mark (None: none)."""
        if checksum is None:
            checksum = chunk_checksum(payload, rid, layer, offset)
        hdr = ChunkHeader(rid, layer, offset, len(payload), checksum, copy)
        self.sock.sendall(self.conn.send_chunk_header(hdr) + payload[:upto])

    def next_event(self, timeout: float = 5.0) -> Any:
        self.sock.settimeout(timeout)
        while True:
            ev = self.conn.next_event()
            if ev is NEED_DATA:
                data = self.sock.recv(65536)
                self.conn.receive_data(data)
                continue
            if ev is CLOSED:
                raise ConnectionError("receiver closed the connection")
            return ev

    def events_until(self, pred: Callable[[Any], bool], timeout: float = 5.0) -> list[Any]:
        """Events received until one satisfies ``pred`` (included)."""
        out: list[Any] = []
        while True:
            ev = self.next_event(timeout)
            out.append(ev)
            if pred(ev):
                return out

    def close(self) -> None:
        self.sock.close()
