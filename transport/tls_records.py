"""TLS records after the handshake, without ``trio.SSLStream``'s per-record machinery.

The handshake stays on ``trio.SSLStream`` (its errors are classified in ``tls.py``); the data
phase drives the same ``ssl.SSLObject`` and memory BIOs directly, because that is where the
time went: ``SSLStream.receive_some`` returns a new bytes object per call (decrypted, then
copied again into place) and goes through its locks and retry loop for every 16 KiB record,
and its ``send_all`` pushes the ciphertext out in small pieces. Measured with the daemons
(``python bench/tls.py --repeats 2 --rates 10``, before and after alternately, 2 cores): mutual
TLS on loopback 5.1 -> 11.6-12.2 Gbit/s at 2.54 -> 1.27-1.32 CPU s/GB; on a 10 Gbit/s tbf link
5.0 -> 9.15-9.2 Gbit/s (0.96-0.97x plain). Here:

- receive: ciphertext arrives in large socket reads into one reused buffer, and
  ``SSLObject.read(n, dest)`` decrypts straight into the caller's destination (shared memory
  for a chunk payload): one copy into the BIO, one decryption into place;
- send: a frame is encrypted in 256 KiB pieces (measured best of 64 KiB, 256 KiB, 1 MiB), each
  piece's records leaving in as few ``send`` calls as the socket takes.

OpenSSL's AES-GCM does the cryptography in both paths; only the Python around it changed.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import cast

import trio
from xdc.transport.sockio import zeroed

# ciphertext read per socket call; a 1 MiB chunk then costs a handful of reads
RECV_BYTES = 256 * 1024
# plaintext encrypted per SSLObject.write: bounds the ciphertext held in memory per connection
WRITE_BYTES = 256 * 1024


class TlsRecords:
    """The data phase of one TLS connection whose handshake ``stream`` completed.

    Never call ``stream`` again after this takes it over: both would drive the same SSL
    object. Errors are the ssl module's (``ssl.SSLError`` is an ``OSError``) or the socket's;
    a clean close by the peer reads as 0 bytes.
    """

    record_layer = "tls"

    def __init__(self, sock: trio.socket.SocketType, stream: trio.SSLStream[trio.SocketStream]):
        self.sock = sock
        # trio keeps these private; the handshake left them in a consistent state, and
        # whatever the peer sent after it (TLS 1.3 session tickets, first records) is still
        # buffered in ``_incoming``
        self.obj: ssl.SSLObject = stream._ssl_object
        self.incoming: ssl.MemoryBIO = stream._incoming
        self.outgoing: ssl.MemoryBIO = stream._outgoing
        # A TLS 1.3 server's session tickets, which trio holds back until the first send
        # (trio issue 819): they must precede our first records on the wire.
        self._delayed: bytes = stream._delayed_outgoing or b""
        stream._delayed_outgoing = None
        self._rbuf = zeroed(RECV_BYTES)  # paged in as records come: an idle one costs none
        self._rview = memoryview(self._rbuf)
        self.eof = False

    def version(self) -> str | None:
        """The negotiated protocol ("TLSv1.3")."""
        return self.obj.version()

    async def recv_into(self, dest: memoryview) -> int:
        """Decrypt up to ``len(dest)`` bytes into ``dest``; 0 once the peer closed."""
        want = len(dest)
        if not want:
            return 0
        while True:
            # One SSL read yields at most one record (16 KiB): drain every record already
            # received before returning, so a large payload costs one call per socket read,
            # not one per record.
            got = 0
            try:
                while got < want:
                    # with a buffer, read() returns the count (typeshed says bytes | int)
                    k = cast(int, self.obj.read(want - got, dest[got:]))
                    if not k:
                        return got
                    got += k
            except ssl.SSLWantReadError:
                if got or self.eof:
                    return got
            except ssl.SSLZeroReturnError:  # close_notify: a clean close
                return got
            except ssl.SSLEOFError:
                # the connection ended without close_notify (a peer that refused us after the
                # handshake, or died): an error, so callers can tell it from a clean close
                if got:
                    return got
                raise
            else:
                return got
            # Whatever a read makes OpenSSL owe the peer (a KeyUpdate answer) waits in
            # ``outgoing`` for the next send, which holds the connection's send lock: flushing
            # here could interleave with a send in flight.
            size: int = await self.sock.recv_into(self._rview)
            if size == 0:
                self.eof = True
                self.incoming.write_eof()
            else:
                self.incoming.write(self._rview[:size])

    async def send_all(self, buffers: Sequence[memoryview]) -> int:
        """Encrypt and send ``buffers`` in order; the plaintext byte count."""
        total = 0
        for buf in buffers:
            for off in range(0, len(buf), WRITE_BYTES):
                piece = buf[off : off + WRITE_BYTES]
                self.obj.write(piece)
                total += len(piece)
                await self._flush()
        return total

    async def _flush(self) -> None:
        if not self.outgoing.pending and not self._delayed:
            return
        data = memoryview(self._delayed + self.outgoing.read())
        self._delayed = b""
        while data:
            sent = await self.sock.send(data)
            data = data[sent:]
