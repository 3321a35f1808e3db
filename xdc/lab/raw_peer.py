"""A hand-driven sender session on the real wire protocol: what a hostile or buggy peer on
a receiver's data port can do (the tests' hostile-peer cases and bench/soak.py's), over plain
TCP or, with a certificate from the deployment's CA, over mutual TLS and the records ALPN
picks (an authenticated peer that misbehaves: the case mutual TLS does not rule out)."""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from xdc.config import TlsConfig
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
from xdc.transport.tls import DataRecords, client_handshake, load_policy

_CONN_INDEX = itertools.count()
_T = TypeVar("_T")


class _TrioThread:
    """A trio loop on a thread of its own, for a blocking caller to run coroutines on: the
    TLS records are trio's, and the hostile cases are written as plain blocking steps. One
    per process (``_shared_trio``): a loop each cost 3 descriptors more per peer, and 300
    peers took a test process past select()'s 1,024."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("the raw peer's trio thread did not start")

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._ready.set()
        await trio.sleep_forever()  # a daemon thread: it ends with the process

    def run(self, fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        return trio.from_thread.run(fn, *args, trio_token=self._token)


_SHARED: _TrioThread | None = None
_SHARED_LOCK = threading.Lock()


def _shared_trio() -> _TrioThread:
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or not _SHARED._thread.is_alive():
            _SHARED = _TrioThread()
        return _SHARED


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
        tls: TlsConfig | None = None,
    ) -> None:
        """``source``: the loopback address to connect from (127.0.0.2 is another host as
        far as the receiver can tell). ``conn_index``: the connection's number in its
        session (default: the next of a process-wide count, so that connections opened side
        by side are distinct ones, as a real sender's are; a connection that reuses a live
        one's number replaces it). ``tls``: this peer's mutual-TLS settings (its
        certificate, and the records it offers). The receiver's answer to our HELLO is
        ``answer``."""
        self.records: DataRecords | None = None
        self._trio: _TrioThread | None = None
        if tls is None:
            where = (source, 0) if source else None
            self.sock = socket.create_connection(
                ("127.0.0.1", port), timeout=5, source_address=where
            )
        else:
            self._trio = _shared_trio()
            self.records = self._trio.run(self._tls_connect, port, source, tls)
            self.sock = self.records.sock  # type: ignore[assignment]
            self._buf = bytearray(65536)  # plaintext of the records, as they are read
        self.conn = Connection("sender", Limits())
        index = next(_CONN_INDEX) % 256 if conn_index is None else conn_index
        self.send(Hello(PROTOCOL_VERSION, peer_id, "sender", session, index))
        self.answer = self.next_event()
        assert isinstance(self.answer, Hello) or not expect_hello, self.answer

    @staticmethod
    async def _tls_connect(port: int, source: str, tls: TlsConfig) -> DataRecords:
        policy = load_policy(tls, server=False)
        assert policy is not None, "tls.mode is off"
        sock = trio.socket.socket()
        try:
            if source:
                await sock.bind((source, 0))
            with trio.fail_after(5):
                await sock.connect(("127.0.0.1", port))
                return await client_handshake(sock, policy, "127.0.0.1")
        except BaseException:
            sock.close()
            raise

    def send(self, event: Event) -> None:
        self.write(self.conn.send(event))

    def write(self, *parts: bytes) -> None:
        """Bytes of the protocol, through the records when this peer speaks TLS: each part
        in records of its own, as a real sender seals a CHUNK's header apart from its
        payload (whose records a receiver opens straight into the chunk's cell)."""
        if self.records is None:
            self.sock.sendall(b"".join(parts))
        else:
            assert self._trio is not None
            self._trio.run(self.records.send_all, [memoryview(p) for p in parts if p])

    def write_record(self, plain: bytes) -> None:
        """``plain`` sealed as one record of any size the receiver allows (up to
        ``RECORD_MAX``), where a real sender seals at most ``SEND_RECORD``: what a peer that
        seals many frames into one record sends."""
        from xdc.protocol.aead_records import TAG_MAX, sealed_size
        from xdc.transport.sealed_records import SealedRecords

        assert isinstance(self.records, SealedRecords), "only sealed records take one"
        out = bytearray(sealed_size(len(plain), TAG_MAX))
        n = self.records.sealer.seal_into(memoryview(plain), memoryview(out))
        self.write_raw(bytes(out[:n]))

    def write_raw(self, data: bytes) -> None:
        """Bytes straight onto the socket, under the records (a forged record)."""
        if self._trio is None:
            self.sock.sendall(data)
            return
        sock = self.records.sock  # type: ignore[union-attr]

        async def send_all() -> None:
            view = memoryview(data)
            while view:
                view = view[await sock.send(view) :]

        self._trio.run(send_all)

    def _read(self, timeout: float) -> bytes:
        if self.records is None:
            self.sock.settimeout(timeout)
            return self.sock.recv(65536)
        assert self._trio is not None
        records, view = self.records, memoryview(self._buf)

        async def recv() -> int:
            try:
                with trio.fail_after(timeout):
                    return await records.recv_into(view)
            except trio.TooSlowError:
                raise TimeoutError(f"nothing from the receiver in {timeout} s") from None

        return bytes(view[: self._trio.run(recv)])

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
        self.write(self.conn.send_chunk_header(hdr), payload[:upto])

    def next_event(self, timeout: float = 5.0) -> Any:
        while True:
            ev = self.conn.next_event()
            if ev is NEED_DATA:
                self.conn.receive_data(self._read(timeout))
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
        if self._trio is None:
            self.sock.close()
            return
        sock = self.sock

        async def close() -> None:
            sock.close()

        self._trio.run(close)
