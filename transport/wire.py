"""The I/O shell around one protocol Connection: a trio socket, a receive buffer, a send lock.

All protocol decisions stay in ``xdc.protocol``; this module only moves bytes. Payloads go
straight from shared memory to the socket with ``sendmsg`` and straight from the socket into
their final offset with ``recv_into``; the only copy is the few bytes of a chunk that happen to
arrive in the same read as its header.

With TLS on, the handshake ran on a ``trio.SSLStream`` and the data phase runs on the records
it chose (``tls.server_handshake``): sealed records of up to 1 MiB (``sealed_records``, the
default) or TLS records driven through the SSL object (``tls_records``). Either way payloads
are decrypted straight into their destination. ``sock`` stays the TCP socket either way,
because the congestion monitor reads TCP_INFO from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

import trio
from xdc.transport.data_workers import DataWorkers, OnLanded, StopFlag, WorkerConn, WorkerLost
from xdc.transport.sealed_records import SealedRecords
from xdc.transport.sockio import (
    READ_AHEAD,
    IdleTimeout,
    SockIO,
    ThreadStopped,
    fill_in_thread,
    lowat_for,
    send_all_in_thread,
)
from xdc.transport.tls_records import TlsRecords

from xdc.errors import ErrorCode, RemoteConnectionError
from xdc.protocol import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    ChunkHeader,
    Connection,
    Error,
    Event,
    Limits,
    ProtocolError,
)
from xdc.protocol.aead_records import SealedError, checksum_sampled
from xdc.protocol.wire.checksum import chunk_checksum
from xdc.protocol.worker_jobs import (
    MAX_AHEAD,
    MAX_BUFFERED,
    Done,
    Failure,
    Lease,
    RecordState,
    Recv,
    Run,
    Send,
    SendChunk,
)

# Small frame reads: a header read that grabs part of the following payload copies it once, so
# keep that part small; payload bytes then go straight to their destination.
FRAME_READ = 16 * 1024
# TLS sends: header and payload are joined (one record train, one syscall) up to this size
TLS_JOIN_MAX = 64 * 1024

T = TypeVar("T")
# fills in a CHUNK header's checksum from its payload (None: the chunk carries none)
Digest = Callable[[memoryview], int] | None


class PeerClosed(RemoteConnectionError):
    """The peer closed or reset the connection, or it went idle past its timeout."""


TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)


def tune_socket(
    sock: trio.socket.SocketType,
    *,
    sndbuf: int = 0,
    rcvbuf: int = 0,
    notsent_lowat: int = 0,
    congestion: str = "",
) -> None:
    """``notsent_lowat`` keeps a socket writable only while little of its data is unsent, so
    chunks wait in the shared striping queue (free to go to any connection) instead of
    queueing behind a connection that slowed down."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if congestion:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
    if notsent_lowat:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, notsent_lowat)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)


class WireConn:
    """Plain TCP goes through ``SockIO`` (direct syscalls, one yield per frame or chunk);
    with TLS the record layer moves the bytes (sealed records through their own SockIO).

    ``threaded`` (plain TCP and sealed records): chunk payloads, and their checksums, move in
    a worker thread instead of on trio's thread. A daemon's event loop is one thread, and on
    loopback it is the ceiling: the copies into and out of the kernel and the hashes are most
    of its time, and all of them release the GIL, so in threads they run on other cores.
    Sealed records also seal and open a payload's records there (that AEAD call holds the GIL,
    the socket calls and waits around it do not). Frames,
    decisions and every piece of shared state stay on trio's thread; a thread only moves one
    payload at a time per connection while its task waits for it, and the socket is closed
    only after the thread is done with it."""

    def __init__(
        self,
        sock: trio.socket.SocketType,
        role: str,
        limits: Limits,
        tls: TlsRecords | SealedRecords | None = None,
        *,
        threaded: bool = False,
    ) -> None:
        self.sock = sock
        self.tls = tls
        self.io: SockIO | None = SockIO(sock) if tls is None else None
        # TLS records stay on trio's thread: their record layer is not made for another
        self.threaded = threaded and (self.io is not None or isinstance(tls, SealedRecords))
        self._thread_limiter = trio.CapacityLimiter(1)
        self._thread_ops = 0  # worker-thread calls in flight on this socket
        self._close_pending = False
        # the SockIO that paces this connection and carries its idle timeout, if any
        self._paced: SockIO | None = tls.io if isinstance(tls, SealedRecords) else self.io
        self.proto = Connection(role, limits)
        self._rbuf = bytearray(FRAME_READ)
        self._rview = memoryview(self._rbuf)
        self._send_lock = trio.Lock()
        self.last_rx = trio.current_time()
        self._idle_timeout: float | None = None
        self.closed = False
        # set when a data worker process moves this connection's payloads (data_workers.py)
        self.worker: WorkerConn | None = None

    async def take_worker(self, workers: DataWorkers, idle_timeout: float | None) -> None:
        """Lend this connection's payload moves to one of ``workers``, where its record layer
        can be lent (plain TCP, sealed records; TLS records stay here). WorkerLost when no
        worker is running: the connection then moves its own bytes."""
        if self.tls is None or isinstance(self.tls, SealedRecords):
            sealed = self.tls is not None
            self.worker = await workers.adopt(self.sock, sealed=sealed, idle_timeout=idle_timeout)

    @property
    def records(self) -> str:
        """What carries this connection's frames, for status: "plain", "tls" (TLS records),
        or "sealed/<cipher>" (e.g. "sealed/aegis-128l")."""
        if self.tls is None:
            return "plain"
        if isinstance(self.tls, SealedRecords):
            return f"sealed/{self.tls.sealer.cipher.label}"
        return "tls"

    @property
    def idle_timeout(self) -> float | None:
        """No byte at all for this long means the peer or the path is gone (None = wait
        forever)."""
        return self._idle_timeout

    @idle_timeout.setter
    def idle_timeout(self, seconds: float | None) -> None:
        self._idle_timeout = seconds
        if self._paced is not None:
            self._paced.idle_timeout = seconds

    def checksummed(self, layer: int, offset: int) -> bool:
        """Whether this chunk's checksum is computed and verified on this connection: always,
        except under sealed records version 2, where AEAD authenticates every byte and only
        the sampled chunks are also hashed (``xdc.protocol.aead_records.checksum_sampled``)."""
        tls = self.tls
        if isinstance(tls, SealedRecords) and tls.sampled_checksums:
            return checksum_sampled(layer, offset)
        return True

    async def _pace(self) -> None:
        if self._paced is not None:
            await self._paced.pace()

    # --- receive --------------------------------------------------------------------------

    async def _recv_into(
        self, dest: memoryview, lowat: int = 1, ahead: memoryview | None = None
    ) -> int:
        try:
            if self.io is not None:
                n = await self.io.recv_into(dest, lowat, ahead)
            elif isinstance(self.tls, SealedRecords):
                n = await self.tls.recv_into(dest, lowat)
            else:
                assert self.tls is not None
                with trio.fail_after(self._idle_timeout if self._idle_timeout else math.inf):
                    n = await self.tls.recv_into(dest)
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError) as e:
            raise PeerClosed(f"receive failed: {e!r}") from e
        except SealedError as e:  # a forged, replayed or cut-short record: drop the connection
            raise PeerClosed(f"bad sealed record: {e}") from e
        except (IdleTimeout, trio.TooSlowError):
            raise PeerClosed(f"nothing received for {self._idle_timeout}s (idle timeout)") from None
        self.last_rx = trio.current_time()
        return n

    async def next_event(self) -> Event:
        """Next protocol event; raises PeerClosed on EOF, ProtocolError on bad bytes. Cancelled
        only before anything was consumed."""
        await trio.lowlevel.checkpoint_if_cancelled()
        received = False
        while True:
            ev = self.proto.next_event()
            if ev is NEED_DATA:
                n = await self._recv_into(self._rview)
                received = True
                self.proto.receive_data(self._rview[:n] if n else b"")
                continue
            if ev is CLOSED:
                raise PeerClosed("peer closed the connection")
            if ev is PAYLOAD:  # caller forgot to consume a payload: a bug, not the peer's fault
                raise ProtocolError(ErrorCode.INTERNAL, "payload left unconsumed")
            assert not isinstance(ev, type(NEED_DATA) | type(CLOSED) | type(PAYLOAD))
            if received:  # frames served from the buffer alone are bounded by its size
                await self._pace()
            return ev

    async def read_payload(
        self, dest: memoryview, still_wanted: Callable[[], bool] | None = None
    ) -> bool:
        """Fill ``dest`` (exactly the pending payload length) with the current chunk's bytes.

        While a large part of the payload is still missing, a wait for it sets SO_RCVLOWAT
        (``sockio.lowat_for``), so a chunk of up to 2 MiB costs one wake-up instead of one
        per segment train; a wait for anything else sets it back to 1 first,
        so small frames are never held back. Under TLS the socket holds records, not payload:
        sealed records take the same hint (ciphertext is never shorter than its plaintext)
        and set their own marks; TLS records ignore it.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        n = self.proto.take_buffered_payload(dest)
        total = len(dest)
        ahead = self._read_ahead()
        while n < total:
            if still_wanted is not None and not still_wanted():
                self.proto.skip_payload()  # the rest is dropped as it arrives, uncopied
                return False
            k = await self._recv_into(dest[n:], lowat_for(total - n), ahead)
            if k == 0:
                raise PeerClosed("peer closed the connection mid-payload")
            past = max(0, n + k - total)
            self._payload_read(k - past, self._rview[:past])
            n += k - past
        await self._pace()
        return True

    def _payload_read(self, n: int, ahead: bytes | memoryview) -> None:
        """``n`` payload bytes were received straight into their destination, and ``ahead``
        are the bytes the same read took past the payload's end (``sockio.READ_AHEAD``): the
        next frame's start, for the parser."""
        self.proto.payload_consumed(n)
        if ahead:
            self.proto.receive_data(ahead)

    def _read_ahead(self) -> memoryview | None:
        """Where a plain-TCP payload read puts the bytes that follow the payload (the next
        frame's header, when it has come: ``sockio.READ_AHEAD``). It is the frame buffer,
        which only ``next_event`` reads into, and never while a payload is being read."""
        return self._rview[:READ_AHEAD] if self.io is not None else None

    async def read_payload_checked(
        self,
        dest: memoryview,
        check: Callable[[memoryview], bool],
        still_wanted: Callable[[], bool] | None = None,
        guard: contextlib.AbstractContextManager[object] | None = None,
        placed: tuple[tuple[str, int, int], int | None] | None = None,
        stop: StopFlag | None = None,
    ) -> bool | None:
        """``read_payload``, then ``check(dest)``: its verdict, or None when the rest of the
        payload was skipped (``still_wanted`` said no). Threaded, both run in the worker
        thread, the check under ``guard`` too (see ``sockio.fill_in_thread``).

        ``placed``: ``dest`` is the chunk's place in the pool, with its cell and the checksum
        ``check`` compares with (None: not checked). With a data worker process, the worker
        then receives and checks it: ``still_wanted`` is not asked, the worker watches
        ``stop`` instead (set by the receiver when a resend of the chunk was verified; the
        receiver orders its copy into place after such a read has ended)."""
        if self.worker is not None and placed is not None:
            lent, verdict = await self._read_in_worker(self.worker, dest, check, placed, stop)
            if lent:
                return verdict
        if not self.threaded:
            if not await self.read_payload(dest, still_wanted):
                return None
            return check(dest)
        await trio.lowlevel.checkpoint_if_cancelled()
        held = guard if guard is not None else contextlib.nullcontext()
        start = self.proto.take_buffered_payload(dest)
        io, sealed = self.io, self.tls if isinstance(self.tls, SealedRecords) else None
        stopped = self._thread_stopped
        ahead = self._read_ahead()

        def work() -> tuple[int, int, bool | None]:
            past = 0
            if sealed is not None:
                got = sealed.fill_in_thread(dest, start, stopped, still_wanted, held)
            else:
                assert io is not None
                got, past = fill_in_thread(io, dest, start, stopped, still_wanted, held, ahead)
            if got < len(dest):
                return got, past, None
            with held:
                return got, past, check(dest)

        try:
            got, past, verdict = await self._in_thread(work)
        except SealedError as e:  # a forged, replayed or cut-short record: drop the connection
            raise PeerClosed(f"bad sealed record: {e}") from e
        except (OSError, EOFError, ThreadStopped) as e:
            raise PeerClosed(f"receive failed: {e!r}") from e
        except IdleTimeout:
            raise PeerClosed(f"nothing received for {self._idle_timeout}s (idle timeout)") from None
        self._payload_read(got - start, self._rview[:past])
        if got > start:
            self.last_rx = trio.current_time()
        if verdict is None:
            self.proto.skip_payload()
        return verdict

    async def _read_in_worker(
        self,
        worker: WorkerConn,
        dest: memoryview,
        check: Callable[[memoryview], bool],
        placed: tuple[tuple[str, int, int], int | None],
        stop: StopFlag | None,
    ) -> tuple[bool, bool | None]:
        """The payload received by the connection's worker process: (True, its verdict; None
        when ``stop`` ended it early and the rest is skipped), or (False, None) when this
        payload cannot be lent (outside the pool, plaintext of an earlier record still
        buffered here) and is read here instead."""
        offset = worker.workers.pool_offset(dest)
        sealed = self.tls if isinstance(self.tls, SealedRecords) else None
        ahead = sealed.read_ahead() if sealed is not None else None
        if offset is None or (sealed is not None and ahead is None):
            return False, None
        await trio.lowlevel.checkpoint_if_cancelled()
        start = self.proto.take_buffered_payload(dest)
        if start == len(dest):  # all of it came with its header: nothing to lend
            return True, check(dest)
        records = None
        if sealed is not None and ahead is not None:
            records = RecordState.of(sealed.opener, ahead)
        cell, expect = placed
        job = Recv(
            worker.next_job(),
            worker.conn,
            offset,
            len(dest),
            start,
            cell,
            expect,
            records,
            stop.slot if stop is not None else None,
        )
        done, back = await _worker_job(worker, job, "receive", sealed is not None)
        if sealed is not None and back is not None:
            sealed.resume_receive(back.key(), back.buffered)
        whole = done.moved == len(dest)
        if whole == (done.verdict is None) or (not whole and (stop is None or sealed)):
            raise PeerClosed("data worker's reply does not match its job")
        if done.ahead and (not whole or sealed is not None):
            raise PeerClosed("data worker read past a payload it did not finish")
        self._payload_read(done.moved - start, done.ahead)
        if done.moved > start:
            self.last_rx = trio.current_time()
        if not whole:  # stopped: a verified resend is waiting; the rest goes unread
            self.proto.skip_payload()
        return True, done.verdict

    @property
    def can_run(self) -> bool:
        """Whether this connection's worker process can read its frames itself (``run``):
        plain TCP or sealed records, lent to a live worker (TLS records stay here)."""
        return (
            self.worker is not None
            and self.worker.alive
            and (self.io is not None or isinstance(self.tls, SealedRecords))
        )

    async def run(
        self,
        leases: tuple[Lease, ...],
        stop: StopFlag | None,
        on_landed: OnLanded,
        job_id: int,
    ) -> int:
        """Lend this connection's reading to its worker process: it reads the frames that
        come and lands the first sends of the leased requests' chunks itself, reporting
        them to ``on_landed``, until a frame is anything else (or ``stop`` is set); then
        this side parses on from that frame. How many chunks it landed; 0 without a start
        (nothing can be lent now: a payload under way, more buffered than a run takes,
        plaintext of a record not handed out yet). Sealed records lend their receiving
        direction for the run and take it back from the reply.
        ``job_id``: the RUN's (``worker.next_job()``, taken by the caller, which adds
        leases to the run by it while it runs)."""
        worker = self.worker
        if worker is None or self.closed or not self.can_run:
            return 0
        sealed = self.tls if isinstance(self.tls, SealedRecords) else None
        records = None
        if sealed is not None:
            ahead = sealed.read_ahead()
            if ahead is None or len(ahead) > MAX_BUFFERED:
                return 0
            records = RecordState.of(sealed.opener, ahead)
        buffered = self.proto.hand_over()
        if buffered is None:
            return 0
        if len(buffered) > MAX_AHEAD:
            self.proto.receive_data(buffered)
            return 0
        await trio.lowlevel.checkpoint_if_cancelled()
        sampled = sealed is not None and sealed.sampled_checksums
        job = Run(
            job_id, worker.conn, leases, buffered, stop.slot if stop else None, records, sampled
        )
        try:
            done = await worker.run_frames(job, on_landed)
        except WorkerLost as e:
            raise PeerClosed(f"run failed: {e}") from e
        if done.failure is not Failure.NONE:
            raise PeerClosed(f"run failed in data worker: {done.failure.name}: {done.detail}")
        if len(done.ahead) > MAX_AHEAD or (done.skip and done.ahead):
            raise PeerClosed("data worker's run handed back more than it could have read")
        if sealed is not None:
            if done.records is None or done.skip:
                raise PeerClosed("data worker's run did not give the record state back")
            try:
                sealed.resume_receive(done.records.key(), done.records.buffered)
            except SealedError as e:
                raise PeerClosed(f"record state from a run: {e}") from e
        if done.ahead:
            self.proto.receive_data(done.ahead)
        if done.skip:
            self.proto.skip_bytes(done.skip)
        if done.moved or done.ahead != buffered:
            self.last_rx = trio.current_time()
        return done.moved

    def _thread_stopped(self) -> bool:
        """Asked by a worker thread between its waits: True once the connection was closed;
        raises ``trio.Cancelled`` (which reaches the waiting task as its own cancellation)
        once that task was cancelled."""
        trio.from_thread.check_cancelled()
        return self.closed

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a worker thread; the task waits for it even when cancelled (the thread
        notices within ``sockio.THREAD_POLL_S``), so buffers and the socket outlive its use."""
        self._thread_ops += 1
        try:
            return await trio.to_thread.run_sync(
                fn, abandon_on_cancel=False, limiter=self._thread_limiter
            )
        finally:
            self._thread_ops -= 1
            if self._close_pending and not self._thread_ops:
                self._close_pending = False
                self.sock.close()

    def skip_payload(self) -> None:
        self.proto.skip_payload()

    # --- send -----------------------------------------------------------------------------

    async def _send_vectored(self, buffers: Sequence[bytes | memoryview]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        bufs = [memoryview(b).cast("B") for b in buffers if len(b)]
        if self.io is None:
            await self._send_tls(bufs)
        else:
            try:
                await self.io.send_all(bufs)
            except (OSError, trio.ClosedResourceError) as e:
                raise PeerClosed(f"send failed: {e!r}") from e
        # no pace(): every send already yielded once, taking the send lock

    async def _send_tls(self, bufs: list[memoryview]) -> None:
        assert self.tls is not None
        try:
            await self.tls.send_all(joined_small(bufs))
        except (OSError, trio.ClosedResourceError, trio.BrokenResourceError) as e:
            raise PeerClosed(f"send failed: {e!r}") from e

    async def send(self, event: Event) -> None:
        await self.send_events((event,))

    async def send_events(self, events: Sequence[Event]) -> None:
        """Several frames in one write (an ACK and the LAYER_DONE it completes): one syscall
        here, one wake-up for the peer."""
        await self._take_send_lock()
        try:
            await self._send_vectored([self.proto.send(ev) for ev in events])
        finally:
            self._send_lock.release()

    async def _take_send_lock(self) -> None:
        """The send lock. A free trio lock still costs a trip through the scheduler (its
        acquire yields once), one per ACK and per hand-off of chunks; a connection whose
        payloads move in a data thread or worker process takes a free one without it, since
        each of its chunks waits for its mover anyway and the others get their turn there.
        A busy connection on trio's thread alone keeps the yield: it is where it gives way."""
        lock = self._send_lock
        if (self.worker is not None or self.threaded) and not lock.locked():
            lock.acquire_nowait()
        else:
            await lock.acquire()

    async def send_chunk(
        self,
        hdr: ChunkHeader,
        payload: memoryview,
        digest: Digest = None,
    ) -> None:
        """A CHUNK frame; ``digest`` (if given) fills in the header's checksum from the
        payload first, in the worker thread when threaded."""
        await self.send_chunks([(hdr, payload, digest)])

    async def send_chunks(self, chunks: Sequence[tuple[ChunkHeader, memoryview, Digest]]) -> None:
        """CHUNK frames in order, each as ``send_chunk`` describes; with data threads, all in
        one hand-off to the worker thread (plain TCP: one gathered write of every header and
        payload; sealed records: each chunk's records in turn)."""

        def frame(hdr: ChunkHeader, payload: memoryview, digest: Digest) -> list[memoryview]:
            if digest is not None:
                hdr = dataclasses.replace(hdr, checksum=digest(payload))
            return [memoryview(self.proto.send_chunk_header(hdr)), payload]

        await self._take_send_lock()
        try:
            await self._send_chunks_locked(chunks, frame)
        finally:
            self._send_lock.release()

    async def _send_chunks_locked(
        self,
        chunks: Sequence[tuple[ChunkHeader, memoryview, Digest]],
        frame: Callable[[ChunkHeader, memoryview, Digest], list[memoryview]],
    ) -> None:
        if self.worker is not None and await self._send_in_worker(self.worker, chunks):
            return
        if not self.threaded:
            for chunk in chunks:
                await self._send_vectored(frame(*chunk))
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        io, sealed = self.io, self.tls if isinstance(self.tls, SealedRecords) else None

        def work() -> int:
            frames = [frame(*chunk) for chunk in chunks]
            if sealed is not None:
                return sum(
                    sealed.send_all_in_thread(joined_small(f), self._thread_stopped) for f in frames
                )
            assert io is not None
            return send_all_in_thread(io, [b for f in frames for b in f], self._thread_stopped)

        try:
            await self._in_thread(work)
        except (OSError, ThreadStopped) as e:
            raise PeerClosed(f"send failed: {e!r}") from e

    async def _send_in_worker(
        self, worker: WorkerConn, chunks: Sequence[tuple[ChunkHeader, memoryview, Digest]]
    ) -> bool:
        """The chunks framed, checksummed and sent by the connection's worker process; False
        (nothing sent) when one is not in the pool or its checksum is not the chunk's own."""
        out: list[SendChunk] = []
        for hdr, payload, digest in chunks:
            offset = worker.workers.pool_offset(payload)
            if offset is None or not _is_chunk_checksum(digest, hdr):
                return False
            self.proto.send_chunk_header(hdr)  # may this side send a CHUNK now (raises if not)
            checksum = None if digest is not None else hdr.checksum
            out.append(
                SendChunk(hdr.rid, hdr.layer, hdr.offset, hdr.length, offset, checksum, hdr.copy)
            )
        sealed = self.tls if isinstance(self.tls, SealedRecords) else None
        records = RecordState.of(sealed.sealer) if sealed is not None else None
        await trio.lowlevel.checkpoint_if_cancelled()
        job = Send(worker.next_job(), worker.conn, tuple(out), records)
        _done, back = await _worker_job(worker, job, "send", sealed is not None)
        if sealed is not None and back is not None:
            sealed.sealer.resume(back.key())
        return True

    async def send_quietly(self, event: Event, timeout: float) -> bool:
        """Best effort, for frames whose loss the protocol already tolerates (notices, errors,
        replies to a peer that may be gone): True if sent; a dead or stalled peer, or a frame
        the state machine refuses, only returns False. Never raises for those."""
        with trio.move_on_after(timeout):
            try:
                await self.send(event)
                return True
            except (PeerClosed, ProtocolError, trio.ClosedResourceError, trio.BusyResourceError):
                return False
        return False

    async def send_error_and_close(self, code: int, message: str, rid: str | None = None) -> None:
        """Best effort: tell the peer why, then close. Never raises."""
        await self.send_quietly(Error(int(code), message[:1024], rid), timeout=1.0)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.worker is not None:
                # the worker's copy keeps the socket open: shut it down for both (the peer
                # sees the end now, a job under way ends), then the worker drops its copy
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)
                self.worker.release_soon()
            if self._thread_ops:
                self._close_pending = True  # _in_thread closes it once the thread is done
            else:
                self.sock.close()


def joined_small(bufs: list[memoryview]) -> list[memoryview]:
    """Under TLS a small frame's pieces are joined (one record train, one send); a large
    payload is not worth copying just to sit next to its header."""
    if len(bufs) > 1 and sum(len(b) for b in bufs) <= TLS_JOIN_MAX:
        return [memoryview(b"".join(bufs))]
    return bufs


async def _worker_job(
    worker: WorkerConn, job: Recv | Send, what: str, sealed: bool
) -> tuple[Done, RecordState | None]:
    """Run a payload move on the connection's worker: its reply and the record state it gave
    back. Any failure, or a sealed connection's state not given back, is the connection's
    end (PeerClosed), as when a data thread fails."""
    try:
        done = await worker.run(job)
    except WorkerLost as e:
        raise PeerClosed(f"{what} failed: {e}") from e
    if done.failure is not Failure.NONE:
        raise PeerClosed(f"{what} failed in data worker: {done.failure.name}: {done.detail}")
    if sealed and done.records is None:
        raise PeerClosed("data worker gave no record state back")
    return done, done.records


def _is_chunk_checksum(digest: Digest, hdr: ChunkHeader) -> bool:
    """Whether ``digest`` is the chunk's own checksum (what a worker computes itself), or
    none: anything else stays in this process."""
    if digest is None:
        return True
    return (
        isinstance(digest, functools.partial)
        and digest.func is chunk_checksum
        and not digest.args
        and digest.keywords == {"rid": hdr.rid, "layer": hdr.layer, "offset": hdr.offset}
    )
