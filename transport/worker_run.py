"""A run (``worker_jobs.Run``): a data worker reads a connection's frames itself and lands
the first sends of leased chunks in place, plain TCP or sealed records alike.

The frame loop is one function over a ``FrameSource``: the connection's bytes as frames
(``read_some``) and payloads (``fill``). Plain TCP reads the socket; sealed records open
whole records, the frames' plaintext onto the frame buffer and the payloads' straight into
their cells, exactly as the daemon's own reads do (``SealedRecords``), and at the end the
receiving direction's record state goes back to the daemon with the ciphertext read past
the last record opened. What the daemon gets back is bounded either way: at most
``MAX_AHEAD`` frame bytes and ``MAX_BUFFERED`` ciphertext bytes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Protocol

from xdc.transport.sealed_records import SealedRecords
from xdc.transport.sockio import (
    READ_AHEAD,
    SockIO,
    ThreadStopped,
    fill_in_thread,
    wait_readable,
)

from xdc.errors import ProtocolError
from xdc.protocol import ChunkHeader, Limits
from xdc.protocol.aead_records import SealedError, checksum_sampled
from xdc.protocol.books.grid import ChunkGrid
from xdc.protocol.wire.checksum import chunk_checksum
from xdc.protocol.wire.frames import PREFIX, FrameType, decode_header
from xdc.protocol.worker_jobs import (
    FLAG_STOP,
    MAX_AHEAD,
    MAX_BUFFERED,
    Done,
    Landed,
    LandedCell,
    Lease,
    RecordState,
    Run,
    WorkerProtocolError,
)

FRAME_READ = 16 * 1024  # a run's reads between payloads (frames, and what follows them)
REPORT_EVERY = 16  # a run reports its landed chunks at least this often (and before a wait)

Stopped = Callable[[], bool]


class _Told(Exception):
    """A run's stop flag was seen during a wait for frame bytes."""


class FrameSource(Protocol):
    """A connection's bytes, as a run reads them."""

    def read_some(self, buf: bytearray, told_to_stop: Stopped) -> bool:
        """More frame bytes onto ``buf`` (which has room for ``FRAME_READ``); False when the
        run is to end first: told to stop, the peer closed (the daemon reads on and sees the
        end itself), or what comes next is too large to hand back."""
        ...

    def fill(self, dest: memoryview, have: int, wanted: Stopped, buf: bytearray) -> int:
        """The rest of a payload into ``dest[have:]``: how far it got, short only when
        ``wanted`` said no (the rest is then the daemon's to skip, or already dropped here:
        see ``skip``). Bytes read past the payload go onto ``buf`` (sealed records keep a
        record's plaintext past it for the next ``read_some``)."""
        ...

    def skip(self, plen: int, got: int) -> int:
        """After ``fill`` stopped at ``got`` of ``plen``: payload bytes the daemon still has to
        skip (0 when this source read and dropped them itself)."""
        ...

    def finish(self, buf: bytearray) -> RecordState | None:
        """The run is over: what goes back with ``buf`` besides (the record state)."""
        ...


class PlainSource:
    """Plain TCP: reads of the socket, a payload's last one taking up to ``READ_AHEAD`` past it."""

    def __init__(self, io: SockIO, stopped: Stopped) -> None:
        self.io = io
        self.fd = io.sock.fileno()
        self.stopped = stopped
        self.past_end = bytearray(READ_AHEAD)

    def read_some(self, buf: bytearray, told_to_stop: Stopped) -> bool:
        since = time.monotonic()
        while True:
            if self.stopped():
                raise ThreadStopped("connection closing")
            if told_to_stop():
                return False
            try:
                data = os.read(self.fd, FRAME_READ)
            except BlockingIOError:
                wait_readable(self.fd, self.io.idle_timeout, since)
                continue
            if not data:
                return False
            buf += data
            return True

    def fill(self, dest: memoryview, have: int, wanted: Stopped, buf: bytearray) -> int:
        nothing = contextlib.nullcontext()
        try:
            got, past = fill_in_thread(
                self.io, dest, have, self.stopped, wanted, nothing, memoryview(self.past_end)
            )
        finally:
            self.io._set_lowat(1)
        if got == len(dest):
            buf += self.past_end[:past]
        return got

    def skip(self, plen: int, got: int) -> int:
        return plen - got

    def finish(self, buf: bytearray) -> RecordState | None:
        return None


class SealedSource:
    """Sealed records, the receiving direction lent for the run: frames' records are opened
    onto the frame buffer whole (one larger than the room left ends the run unopened), a
    payload's straight into its cell. A payload whose lease was stopped is read to its end
    and dropped here: a record half read cannot be handed back."""

    def __init__(self, records: SealedRecords, stopped: Stopped) -> None:
        self.records = records
        self.stopped = stopped
        self._plain = bytearray(MAX_AHEAD)
        self._drop = bytearray(READ_AHEAD)

    def read_some(self, buf: bytearray, told_to_stop: Stopped) -> bool:
        def halt() -> bool:
            if self.stopped():
                return True
            if told_to_stop():
                raise _Told
            return False

        room = memoryview(self._plain)[: MAX_AHEAD - len(buf)]
        try:
            got = self.records.read_in_thread(room, halt, MAX_BUFFERED)
        except _Told:
            return False
        finally:
            self.records.io._set_lowat(1)
        if not got:  # a clean end, or a record too large to hand back: the daemon's
            return False
        buf += room[:got]
        return True

    def fill(self, dest: memoryview, have: int, wanted: Stopped, buf: bytearray) -> int:
        nothing = contextlib.nullcontext()
        records = self.records
        try:
            got = records.fill_in_thread(dest, have, self.stopped, wanted, nothing)
            left = len(dest) - got
            drop = memoryview(self._drop)
            while left:  # stopped: the rest is read and dropped, never written to ``dest``
                k = min(left, len(drop))
                records.fill_in_thread(drop[:k], 0, self.stopped, None, nothing)
                left -= k
        finally:
            records.io._set_lowat(1)
        return got

    def skip(self, plen: int, got: int) -> int:
        return 0

    def finish(self, buf: bytearray) -> RecordState | None:
        records = self.records
        pending = records.plain_pending()
        if pending > MAX_AHEAD - len(buf):
            raise SealedError(f"a record ran {pending} bytes past its frames: too many to return")
        if pending:  # handed out first, with no wait for the socket
            self.read_some(buf, lambda: False)
        ahead = records.read_ahead()
        if ahead is None or len(ahead) > MAX_BUFFERED:
            raise SealedError("record bytes read ahead that cannot be handed back")
        return RecordState.of(records.opener, ahead)


def run_frames(
    job: Run,
    source: FrameSource,
    pool: memoryview,
    limits: Limits,
    flags: memoryview,
    take_more: Callable[[Callable[[Lease], None]], None],
    stopped: Stopped,
    report_to: Callable[[Landed], None],
) -> Done:
    """Read frames and land the first sends of leased chunks, as ``job`` says, until a frame
    is not one. Each is received at its cell (the bytes that came with its header copied
    there first), verified and reported; the daemon decides what it counts for. A lease's
    stop flag ends the run before its next frame; a chunk of that very lease half read is
    given up there (reported with no verdict). A chunk of another lease is finished first.
    A closed lease (``FLAG_CLOSED``: its request is complete) ends the run only at a chunk of
    it, which is then the daemon's, and a chunk of it half read is given up the same way.
    Under sealed records with sampled checksums (``job.sampled``) a chunk that carries none
    is verified by its records' tags alone, as on the daemon's own path.

    ``take_more(take)`` calls ``take`` with each lease the daemon added to this run since."""
    leases: dict[str, tuple[ChunkGrid, int, int]] = {}
    slots: list[int] = [] if job.stop is None else [job.stop]

    def take(lease: Lease) -> None:
        grid = ChunkGrid(lease.rid, lease.layer_sizes, lease.chunk_bytes)
        if lease.base + grid.total_bytes > len(pool):
            raise WorkerProtocolError(f"lease of {lease.rid!r} outside the pool")
        leases[lease.rid] = (grid, lease.base, lease.stop)
        slots.append(lease.stop)

    for lease in job.leases:
        take(lease)

    def told_to_stop() -> bool:
        # leases pushed since are taken first: their flags may be what says stop (a request
        # this run was given while it waited, finished on other connections and freed: the
        # daemon waits for this run before it gives the buffer back)
        take_more(take)
        return any(flags[s] == FLAG_STOP for s in slots)

    buf = bytearray(job.buffered)
    reports: list[LandedCell] = []
    landed = skip = 0
    psize = PREFIX.size

    def report() -> None:
        nonlocal reports
        if reports:
            report_to(Landed(job.job, tuple(reports)))
            reports = []

    try:
        while not (stopped() or told_to_stop()):
            if len(buf) > MAX_AHEAD - FRAME_READ:
                break  # so large a header is the daemon's to parse: what comes back is bounded
            if len(buf) < psize:
                report()
                if not source.read_some(buf, told_to_stop):
                    break
                continue
            _magic, ftype, _flags, hlen, _reserved, plen = PREFIX.unpack_from(buf)
            if ftype != FrameType.CHUNK or hlen > limits.max_header_bytes:
                break  # the daemon's parser takes it from here (and refuses what is bad)
            if len(buf) < psize + hlen:
                report()
                if not source.read_some(buf, told_to_stop):
                    break
                continue
            try:
                hdr = decode_header(ftype, buf[psize : psize + hlen], limits)
            except ProtocolError:
                break
            if not isinstance(hdr, ChunkHeader) or hdr.copy is not False:
                break
            leased = leases.get(hdr.rid)
            if leased is None:
                take_more(take)
                leased = leases.get(hdr.rid)
            if leased is None or hdr.length != plen:
                break
            grid, base, slot = leased
            if flags[slot]:
                break
            try:
                grid.cell(hdr.layer, hdr.offset, plen)
            except ProtocolError:
                break  # off its grid: the daemon refuses it
            at = base + grid.position(hdr.layer, hdr.offset)
            dest = pool[at : at + plen]
            start = psize + hlen
            have = min(len(buf) - start, plen)
            dest[:have] = buf[start : start + have]
            del buf[: start + have]
            if have < plen:
                report()  # the payload's reads may wait: what landed goes out first

                def wanted(slot: int = slot) -> bool:
                    return not flags[slot]

                got = source.fill(dest, have, wanted, buf)
                if got < plen:  # its lease was stopped: the rest is not ours to land
                    reports.append((hdr.rid, hdr.layer, hdr.offset, plen, hdr.checksum, None))
                    skip = source.skip(plen, got)
                    break
            ok = (job.sampled and not checksum_sampled(hdr.layer, hdr.offset)) or (
                chunk_checksum(dest, hdr.rid, hdr.layer, hdr.offset) == hdr.checksum
            )
            reports.append((hdr.rid, hdr.layer, hdr.offset, plen, hdr.checksum, ok))
            landed += 1
            if len(reports) >= REPORT_EVERY:
                report()
    finally:
        report()
    records = source.finish(buf)
    return Done(job.job, landed, None, records, ahead=bytes(buf), skip=skip)
