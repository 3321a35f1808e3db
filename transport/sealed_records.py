"""The I/O shell of sealed records (``xdc.protocol.aead_records``) over one TCP socket.

Same interface as ``TlsRecords`` (``recv_into``, ``send_all``), so ``WireConn`` drives either.

- receive: a record's ciphertext is read into one reused buffer (reads ask for what the
  record still needs plus a little read-ahead, so the next header usually comes along and at
  most that little is moved after each record), then authenticated and decrypted straight
  into the caller's destination: for a chunk payload, its final place in shared memory. A
  record larger than the destination (small frames joined by the sender) is opened into a
  side buffer and handed out from there.
- send: each buffer becomes records of at most SEND_RECORD (256 KiB) bytes, each sealed into
  one reused, cache-sized buffer (the encryption is the only pass over the payload in user
  space) and written before the next is sealed. A chunk's header and payload are separate
  records, so the receiver can open the payload in place.
"""

from __future__ import annotations

import contextlib
import mmap
import secrets
from collections.abc import Callable, Iterator, Sequence

import trio
from xdc.transport.sockio import (
    SockIO,
    ThreadStopped,
    lowat_for,
    recv_in_thread,
    send_all_in_thread,
    zeroed,
)
from xdc.transport.tls_records import TlsRecords

from xdc.protocol.aead_records import (
    HEADER,
    RECORD_MAX,
    SHARE_BYTES,
    TAG_MAX,
    Cipher,
    KeyState,
    Opener,
    SealedError,
    Sealer,
    direction_secrets,
    sealed_size,
)

READ_AHEAD = 64 * 1024  # beyond the current record: the next header, a small frame
# Plaintext per record this side seals (a receiver accepts up to RECORD_MAX). Each record is
# sealed into a buffer that stays in the core's L2 and leaves in its own write, so the kernel
# copies it from cache, and the receiver reads and opens it in cache-sized steps too.
# Loopback, 8 connections, 2 MiB chunks, medians of 3, each line side by side with plain TCP:
# 1 MiB records 20.3 Gbit/s, 0.59 CPU s/GB; 256 KiB 31.6, 0.46 (128 KiB 28.7, 64 KiB 21.4,
# 512 KiB 22.5: per-record costs below, cache misses above). With one receiver wake-up per
# record, 256 KiB cost more CPU on a 10 Gbit/s link (1.15 vs 1.05 s/GB); the receiver's wait
# for a whole payload (``recv_into``'s ``lowat``) brought it to 0.97.
SEND_RECORD = 256 * 1024


def _pages(n: int) -> int:
    """``n`` bytes rounded up to whole pages (where ``madvise`` may start)."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


# The most of a connection's record buffers a sender that seals at most SEND_RECORD per record
# (and joins small frames up to wire.TLS_JOIN_MAX) ever touches; a larger record is allowed
# (up to RECORD_MAX), and the pages it took beyond these go back once it is read. Without
# that, every connection of an authenticated peer that sent one 1 MiB record kept 2 MiB
# resident until it closed (1,024 connections: 2 GiB).
IN_KEEP = _pages(HEADER.size + SEND_RECORD + TAG_MAX + READ_AHEAD)
PLAIN_KEEP = 64 * 1024


class SealedRecords:
    """The data phase of one connection after ``upgrade``."""

    record_layer = "sealed"

    def __init__(
        self,
        sock: trio.socket.SocketType,
        sealer: Sealer,
        opener: Opener,
        tls_version: str | None,
        leftover: bytes = b"",
        *,
        sampled_checksums: bool = False,
    ) -> None:
        self.sock = sock
        # xdc-sealed/2: only chunks ``checksum_sampled`` picks carry a checksum (AEAD covers all)
        self.sampled_checksums = sampled_checksums
        self.io = SockIO(sock)  # the socket's reads and writes; the connection paces it
        self.sealer = sealer
        self.opener = opener
        self._tls_version = tls_version
        self._in = zeroed(max(sealed_size(RECORD_MAX, TAG_MAX) + READ_AHEAD, len(leftover)))
        self._inv = memoryview(self._in)
        self._in[: len(leftover)] = leftover
        self._have = len(leftover)
        self._plain: mmap.mmap | None = None  # a record bigger than the reader's buffer
        self._plain_off = 0
        self._plain_end = 0
        self._out = zeroed(sealed_size(SEND_RECORD, TAG_MAX) + sealed_size(READ_AHEAD, TAG_MAX))
        self._outv = memoryview(self._out)

    # --- lending a direction to a data worker (docs/data_workers.md) ------------------------

    def read_ahead(self) -> bytes | None:
        """The bytes read past the last record opened, to lend with the receiving direction
        for one payload; None while plaintext of an earlier record is still to be handed out
        (that payload is then read here)."""
        if self._plain_off < self._plain_end:
            return None
        return bytes(self._inv[: self._have])

    def resume_receive(self, st: KeyState, buffered: bytes) -> None:
        """Take the receiving direction back from a job, with what it read ahead."""
        if len(buffered) > len(self._in):
            raise SealedError(f"{len(buffered)} bytes read ahead by a worker do not fit")
        self.opener.resume(st)
        self._in[: len(buffered)] = buffered
        self._have = len(buffered)

    def version(self) -> str | None:
        """The TLS version of the handshake that keyed these records ("TLSv1.3")."""
        return self._tls_version

    # --- receive --------------------------------------------------------------------------

    async def recv_into(self, dest: memoryview, lowat: int = 1) -> int:
        """Up to ``len(dest)`` authenticated plaintext bytes (at most one record's); 0 when the
        peer closed between records. SealedError for a bad record or an end inside one.

        ``lowat``: plaintext bytes the caller knows are coming (the rest of a chunk payload).
        A wait then lasts until that much ciphertext is in the socket, so a payload of several
        records costs one wake-up; the reads stay small (the record plus READ_AHEAD), so what
        is opened is still in the cache (reads of up to 1 MiB: loopback 31 -> 21 Gbit/s).
        (Opening further buffered small records in the same call was measured: no change.)"""
        if not len(dest):
            return 0
        if self._plain_off < self._plain_end:
            return self._take_plain(dest)
        if not await self._fill(HEADER.size, lowat):
            return 0
        end = self._record_end()
        ahead = self._ahead(len(dest) if lowat > 1 else 0, end)
        if not await self._fill(end, lowat, ahead):
            raise SealedError(f"connection ended inside a record ({self._have} of {end} bytes)")
        return self._open_buffered(dest, end)

    def _ahead(self, payload_left: int, end: int) -> int:
        """How far past the record ending at ``end`` to read. Inside a payload whose next
        record is payload too, only that record's header: the read-ahead is moved to the
        buffer's front after every record, and 64 KiB of a 256 KiB record's successor moved
        each time was a quarter more copying, under the GIL in a data thread (16 cores)."""
        if payload_left > end - HEADER.size - self.opener.tag:
            return HEADER.size
        return READ_AHEAD

    def _record_end(self) -> int:
        """Where the record whose header is buffered ends (SealedError for a bad length)."""
        return (
            HEADER.size + self.opener.plaintext_length(self._inv[: HEADER.size]) + self.opener.tag
        )

    def _open_buffered(self, dest: memoryview, end: int) -> int:
        """Open the whole record buffered in ``[0, end)`` into ``dest`` (what does not fit is
        kept and handed out by the next reads); the bytes written to ``dest``."""
        want = len(dest)
        header = self._inv[: HEADER.size]
        n = end - HEADER.size - self.opener.tag
        body = self._inv[HEADER.size : end]
        if n <= want:
            self.opener.open_into(header, body, dest[:n])
            got = n
        else:
            if self._plain is None:
                self._plain = zeroed(RECORD_MAX)
            with memoryview(self._plain) as plain:
                self.opener.open_into(header, body, plain[:n])
                dest[:want] = plain[:want]
            self._plain_off, self._plain_end = want, n
            got = want
        rest = self._have - end
        if rest:
            self._inv[:rest] = self._inv[end : self._have]  # memoryview: overlap-safe
        self._have = rest
        if end > IN_KEEP:  # a record larger than we send: its pages go back
            keep = max(IN_KEEP, _pages(rest))
            if keep < len(self._in):
                self._in.madvise(mmap.MADV_DONTNEED, keep, len(self._in) - keep)
        return got

    def _take_plain(self, dest: memoryview) -> int:
        """Plaintext left over from a record larger than an earlier destination."""
        if self._plain_off >= self._plain_end:
            return 0
        assert self._plain is not None
        k = min(len(dest), self._plain_end - self._plain_off)
        with memoryview(self._plain) as plain:
            dest[:k] = plain[self._plain_off : self._plain_off + k]
        self._plain_off += k
        if self._plain_off >= self._plain_end > PLAIN_KEEP:  # all handed out: pages go back
            self._plain.madvise(mmap.MADV_DONTNEED, PLAIN_KEEP, RECORD_MAX - PLAIN_KEEP)
        return k

    async def _fill(self, need: int, lowat: int = 1, ahead: int = READ_AHEAD) -> bool:
        """Until ``need`` bytes are buffered; False if the peer closed before any byte of
        them arrived with nothing buffered (a clean end between records). A wait sets
        SO_RCVLOWAT (``sockio.lowat_for``) to what the record still needs or, if more, to the
        caller's ``lowat``: ciphertext is never shorter than its plaintext, so
        that much is sure to come."""
        while self._have < need:
            view, mark = self._window(need, lowat, ahead)
            if not self._took(await self.io.recv_into(view, mark), need):
                return False
        return True

    def _window(self, need: int, lowat: int, ahead: int = READ_AHEAD) -> tuple[memoryview, int]:
        """Where the next read goes (up to the record plus ``ahead``) and its SO_RCVLOWAT."""
        stop = min(len(self._in), need + ahead)
        return self._inv[self._have : stop], lowat_for(max(need, lowat) - self._have)

    def _took(self, got: int, need: int) -> bool:
        """Count ``got`` bytes read; False for a clean end between records."""
        if not got:
            if self._have == 0:
                return False
            raise SealedError(f"connection ended inside a record ({self._have} of {need} bytes)")
        self._have += got
        return True

    # --- receive, from a data thread ------------------------------------------------------

    def fill_in_thread(
        self,
        dest: memoryview,
        start: int,
        stopped: Callable[[], bool],
        still_wanted: Callable[[], bool] | None,
        guard: contextlib.AbstractContextManager[object],
    ) -> int:
        """``sockio.fill_in_thread`` through sealed records: receive a chunk payload into
        ``dest[start:]`` from a worker thread, whole records at a time; the byte count reached
        (short only when ``still_wanted`` said no). Waits (``sockio.recv_in_thread``) hold no
        guard; the check of ``still_wanted`` and the opening of a record into ``dest`` happen
        under ``guard``, so whoever holds it knows nothing lands in ``dest`` meanwhile. The
        caller (one reader per connection, waiting for this) owns the record state."""
        total = len(dest)
        n = start
        while n < total:
            if stopped():
                raise ThreadStopped("connection closing")
            end = 0
            if self._plain_off >= self._plain_end:
                lowat = lowat_for(total - n)
                if not self._fill_in_thread(HEADER.size, lowat, stopped):
                    raise EOFError("peer closed the connection mid-payload")
                end = self._record_end()
                if not self._fill_in_thread(end, lowat, stopped, self._ahead(total - n, end)):
                    raise SealedError(
                        f"connection ended inside a record ({self._have} of {end} bytes)"
                    )
            with guard:
                if still_wanted is not None and not still_wanted():
                    return n
                n += self._open_buffered(dest[n:], end) if end else self._take_plain(dest[n:])
        return n

    def read_in_thread(
        self, dest: memoryview, stopped: Callable[[], bool], hold: int
    ) -> int | None:
        """From a worker thread, the next plaintext onto ``dest``, at most one record's: what
        an earlier record left over first, else the next record whole, if its plaintext fits
        in ``dest``; None when it does not (nothing opened: it stays buffered for whoever
        reads next), 0 at a clean end between records. At most ``hold`` ciphertext bytes are
        buffered afterwards (a data worker's run hands them back: ``worker_jobs``)."""
        if self._plain_off < self._plain_end:
            return self._take_plain(dest)
        if not self._fill_in_thread(HEADER.size, 1, stopped, min(READ_AHEAD, hold - HEADER.size)):
            return 0
        end = self._record_end()
        if end - HEADER.size - self.opener.tag > len(dest) or end > hold:
            return None
        if not self._fill_in_thread(end, 1, stopped, min(READ_AHEAD, hold - end)):
            raise SealedError(f"connection ended inside a record ({self._have} of {end} bytes)")
        return self._open_buffered(dest, end)

    def plain_pending(self) -> int:
        """Plaintext opened and not handed out yet (a record that ran past its reader's end)."""
        return self._plain_end - self._plain_off

    def _fill_in_thread(
        self, need: int, lowat: int, stopped: Callable[[], bool], ahead: int = READ_AHEAD
    ) -> bool:
        """``_fill`` for a worker thread (the same buffer, marks and clean-end rule)."""
        while self._have < need:
            view, mark = self._window(need, lowat, ahead)
            if not self._took(recv_in_thread(self.io, view, mark, stopped), need):
                return False
        return True

    # --- send -----------------------------------------------------------------------------

    def _sealed(self, buffers: Sequence[memoryview]) -> Iterator[memoryview]:
        """``buffers`` as records of at most SEND_RECORD bytes each, sealed into the one
        output buffer: each view yielded must be sent before the next is asked for."""
        pos = 0
        out = self._outv
        for buf in buffers:
            for off in range(0, len(buf), SEND_RECORD):
                piece = buf[off : off + SEND_RECORD]
                if pos + sealed_size(len(piece), self.sealer.tag) > len(out):
                    yield out[:pos]
                    pos = 0
                pos += self.sealer.seal_into(piece, out[pos:])
        if pos:
            yield out[:pos]

    async def send_all(self, buffers: Sequence[memoryview]) -> int:
        """Seal and send ``buffers`` in order; the plaintext byte count."""
        for data in self._sealed(buffers):
            await self.io.send_all([data])
        return sum(len(b) for b in buffers)

    def send_all_in_thread(self, buffers: Sequence[memoryview], stopped: Callable[[], bool]) -> int:
        """``send_all`` from a worker thread (``sockio.send_all_in_thread`` per batch); the
        caller holds the connection's send lock, so records leave in their nonce order."""
        for data in self._sealed(buffers):
            send_all_in_thread(self.io, [data], stopped)
        return sum(len(b) for b in buffers)


async def upgrade(
    records: TlsRecords,
    *,
    server_side: bool,
    tls_version: str | None,
    sampled_checksums: bool = False,
    cipher: Cipher = Cipher.AES_128_GCM,
) -> SealedRecords:
    """Switch a connection whose handshake negotiated sealed records to them (``xdc-sealed/3``:
    AEGIS-128L and ``sampled_checksums``; ``/2``: AES-128-GCM and ``sampled_checksums``;
    ``/1``: AES-128-GCM).

    The client sends its share first and the server answers with its own, so when the client
    reads the server's share nothing sealed can precede it, and the server has nothing sealed
    to read before it answered. Whatever the TLS layer had already received past the share
    record (sealed records the server sent right away) is carried over. Errors are the TLS
    layer's (a peer that refused our certificate shows up here, on the first read).
    """
    mine = secrets.token_bytes(SHARE_BYTES)
    if server_side:
        theirs = await _read_share(records)
        await records.send_all([memoryview(mine)])
        c2s, s2c = direction_secrets(theirs, mine)
        sealer, opener = Sealer(s2c, cipher=cipher), Opener(c2s, cipher=cipher)
    else:
        await records.send_all([memoryview(mine)])
        theirs = await _read_share(records)
        c2s, s2c = direction_secrets(mine, theirs)
        sealer, opener = Sealer(c2s, cipher=cipher), Opener(s2c, cipher=cipher)
    if records.obj.pending():
        raise SealedError("peer sent TLS data after its key share")
    leftover = records.incoming.read()
    return SealedRecords(
        records.sock, sealer, opener, tls_version, leftover, sampled_checksums=sampled_checksums
    )


async def _read_share(records: TlsRecords) -> bytes:
    share = bytearray(SHARE_BYTES)
    view = memoryview(share)
    got = 0
    while got < SHARE_BYTES:
        n = await records.recv_into(view[got:])
        if n == 0:
            raise trio.BrokenResourceError("peer closed before sending its key share")
        got += n
    return bytes(share)
