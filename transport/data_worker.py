"""A data worker process: moves chunk payloads between its connections' sockets and the pool.

Started by a daemon (``transport.data_workers``) with one end of a socketpair (its control
channel) and a descriptor of the daemon's pool; it maps the pool and then does what the jobs
on the channel say (``xdc.protocol.worker_jobs``), one thread per adopted connection, each job
the same work a data thread does today (``sockio.fill_in_thread``, ``send_all_in_thread``,
``SealedRecords``' threaded paths), but under this process's own GIL. It decides nothing: a job
names the bytes and lends the record state, the reply gives the state back.

It exits when its control channel ends (the daemon exited, closed it, or died): every socket
it holds is its own copy, so closing them touches nothing the daemon still uses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import mmap
import os
import queue
import secrets
import select
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from xdc.transport.sealed_records import SealedRecords
from xdc.transport.sockio import (
    READ_AHEAD,
    IdleTimeout,
    SockIO,
    ThreadStopped,
    fill_in_thread,
    send_all_in_thread,
    wait_readable,
)
from xdc.transport.wire import joined_small

from xdc.errors import LocalConnectionError, ProtocolError
from xdc.protocol import ChunkHeader, Limits
from xdc.protocol.aead_records import Cipher, Opener, SealedError, Sealer
from xdc.protocol.books.grid import ChunkGrid
from xdc.protocol.wire.checksum import chunk_checksum
from xdc.protocol.wire.frames import PREFIX, FrameType, decode_header, encode_chunk_header_checked
from xdc.protocol.worker_jobs import (
    MAX_AHEAD,
    STOP_SLOTS,
    AddLease,
    Adopt,
    Done,
    Drop,
    Failure,
    JobReader,
    Landed,
    LandedCell,
    Lease,
    RecordState,
    Recv,
    Run,
    Send,
    WorkerProtocolError,
    encode,
)

log = logging.getLogger("xdc.data_worker")


class Superseded(LocalConnectionError):
    """A sealed read's stop flag was set: the connection is given up (its record state is
    mid-record, which cannot be handed back)."""


MAX_FDS = 16  # descriptors accepted with one read of the control channel
FRAME_READ = 16 * 1024  # a run's reads between payloads (frames, and what follows them)
REPORT_EVERY = 16  # a run reports its landed chunks at least this often (and before a wait)
PARENT_POLL_S = 0.5  # without pidfds: how often to look whether the daemon is gone


class _Conn:
    """One adopted connection: its socket copy, a job queue and the thread that works it."""

    def __init__(self, worker: Worker, adopt: Adopt, fd: int) -> None:
        self.worker = worker
        self.conn = adopt.conn
        self.sealed = adopt.sealed
        self.idle = adopt.idle_timeout or None
        self.sock = socket.socket(fileno=fd)
        self.jobs: queue.SimpleQueue[Recv | Send | Run | None] = queue.SimpleQueue()
        self.dropped = False
        # leases for a run under way, from the control thread: (RUN job, lease), taken by the
        # run's thread when a chunk's request is not among its leases yet
        self.more_leases: deque[tuple[int, Lease]] = deque()
        # sealed records: the record layer and each direction, made at their first job and
        # then brought up to date by every job that lends them (their buffers are reused)
        self._records: SealedRecords | None = None
        self._opener: Opener | None = None
        self._sealer: Sealer | None = None
        self.thread = threading.Thread(target=self._run, name=f"conn-{adopt.conn}", daemon=True)
        self.thread.start()

    def stopped(self) -> bool:
        return self.dropped or self.worker.ending

    def drop(self) -> None:
        self.dropped = True
        self.jobs.put(None)

    def _run(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                self.worker.reply(self._do(job))
        finally:
            self.sock.close()

    def _do(self, job: Recv | Send | Run) -> Done:
        try:
            if isinstance(job, Run):
                return self._run_frames(job)
            if isinstance(job, Recv):
                return self._recv(job)
            return self._send(job)
        except SealedError as e:
            return Done(job.job, 0, None, None, Failure.SEALED, str(e))
        except EOFError as e:
            return Done(job.job, 0, None, None, Failure.EOF, str(e))
        except IdleTimeout as e:
            return Done(job.job, 0, None, None, Failure.IDLE, str(e))
        except (OSError, ThreadStopped) as e:
            return Done(job.job, 0, None, None, Failure.CLOSED, repr(e))
        except (ValueError, WorkerProtocolError) as e:
            return Done(job.job, 0, None, None, Failure.BAD_JOB, str(e))
        except Superseded as e:
            return Done(job.job, 0, None, None, Failure.SUPERSEDED, str(e))

    def _sealed_records(self, st: RecordState | None, receiving: bool) -> SealedRecords:
        """The connection's record layer with the lent direction brought to ``st``."""
        if not self.sealed or st is None:
            raise WorkerProtocolError("record state given for a plain connection or missing")
        cipher = Cipher.from_label(st.cipher)
        if receiving:
            if self._opener is None:
                self._opener = Opener.resumed(st.key(), st.rekey_bytes, cipher)
            else:
                self._opener.resume(st.key())
        elif self._sealer is None:
            self._sealer = Sealer.resumed(st.key(), st.rekey_bytes, cipher)
        else:
            self._sealer.resume(st.key())
        if self._records is None:
            # a direction not lent yet gets a throwaway key until its first job
            opener = self._opener or Opener(secrets.token_bytes(32), st.rekey_bytes, cipher)
            sealer = self._sealer or Sealer(secrets.token_bytes(32), st.rekey_bytes, cipher)
            self._records = SealedRecords(self.sock, sealer, opener, None)  # type: ignore[arg-type]
            self._records.io.idle_timeout = self.idle
        if self._opener is not None:
            self._records.opener = self._opener
        if self._sealer is not None:
            self._records.sealer = self._sealer
        if receiving:
            self._records.resume_receive(st.key(), st.buffered)
        return self._records

    def _recv(self, job: Recv) -> Done:
        pool = self.worker.pool
        if not (job.start <= job.length and job.offset + job.length <= len(pool)):
            raise WorkerProtocolError(
                f"payload {job.offset}+{job.length} (start {job.start}) outside the pool"
            )
        dest = pool[job.offset : job.offset + job.length]
        flags, slot = self.worker.flags, job.stop  # (its range: worker_jobs.decode)
        wanted = None if slot is None else (lambda: not flags[slot])
        out: RecordState | None = None
        read_ahead = b""
        nothing = contextlib.nullcontext()
        if job.records is not None or self.sealed:
            records = self._sealed_records(job.records, receiving=True)

            def stopped() -> bool:
                if wanted is not None and not wanted():
                    raise Superseded("a resend of this chunk was verified first")
                return self.stopped()

            try:
                got = records.fill_in_thread(dest, job.start, stopped, None, nothing)
            finally:
                records.io._set_lowat(1)  # the daemon's reads expect small frames at once
            ahead = records.read_ahead()
            if ahead is None:
                raise SealedError("a payload record was larger than its payload")
            out = RecordState.of(records.opener, ahead)
        else:
            io = SockIO(self.sock)  # type: ignore[arg-type]
            io.idle_timeout = self.idle
            past_end = bytearray(READ_AHEAD)
            try:
                got, past = fill_in_thread(
                    io, dest, job.start, self.stopped, wanted, nothing, memoryview(past_end)
                )
            finally:
                io._set_lowat(1)
            if got < job.length:  # told to stop: the daemon skips the rest of the payload
                return Done(job.job, got, None, None)
            read_ahead = bytes(past_end[:past])
        ok = True if job.expect is None else chunk_checksum(dest, *job.cell) == job.expect
        return Done(job.job, got, ok, out, ahead=read_ahead)

    def _run_frames(self, job: Run) -> Done:
        """Read frames and land the first sends of leased chunks, as ``Run`` says, until a
        frame is not one. Each is received at its cell (the bytes that came with its header
        copied there first), hashed and reported; the daemon decides what it counts for. A
        lease's stop flag ends the run before its next frame; a chunk of that very lease half
        read is given up there (reported with no verdict) and the daemon is told how much of
        its payload it still has to skip. A chunk of another lease is finished first."""
        if self.sealed:
            raise WorkerProtocolError("a run on a connection with sealed records")
        pool, limits = self.worker.pool, self.worker.limits
        leases: dict[str, tuple[ChunkGrid, int, int]] = {}
        slots: list[int] = [] if job.stop is None else [job.stop]

        def take(lease: Lease) -> None:
            grid = ChunkGrid(lease.rid, lease.layer_sizes, lease.chunk_bytes)
            if lease.base + grid.total_bytes > len(pool):
                raise WorkerProtocolError(f"lease of {lease.rid!r} outside the pool")
            leases[lease.rid] = (grid, lease.base, lease.stop)
            slots.append(lease.stop)

        def take_more() -> None:
            """Leases the daemon added since (for requests it accepted after the run began);
            those of earlier runs are dropped."""
            more = self.more_leases
            while more and more[0][0] <= job.job:  # (job ids grow; a later run's stays)
                for_job, lease = more.popleft()
                if for_job == job.job:
                    take(lease)

        for lease in job.leases:
            take(lease)
        flags = self.worker.flags

        def told_to_stop() -> bool:
            # leases pushed since are taken first: their flags may be what says stop (a
            # request this run was given while it waited, finished on other connections and
            # freed: the daemon waits for this run before it gives the buffer back)
            if self.more_leases:
                take_more()
            return any(flags[s] for s in slots)

        io = SockIO(self.sock)  # type: ignore[arg-type]
        io.idle_timeout = self.idle
        fd = self.sock.fileno()
        buf = bytearray(job.buffered)
        past_end = bytearray(READ_AHEAD)
        reports: list[LandedCell] = []
        landed = skip = 0
        psize = PREFIX.size
        nothing = contextlib.nullcontext()

        def report() -> None:
            nonlocal reports
            if reports:
                self.worker.send_msg(Landed(job.job, tuple(reports)))
                reports = []

        try:
            while not (self.stopped() or told_to_stop()):
                if len(buf) > MAX_AHEAD - FRAME_READ:
                    break  # so large a header is the daemon's to parse: what comes back is bounded
                if len(buf) < psize:
                    report()
                    if not self._read_some(io, fd, buf, told_to_stop):
                        break
                    continue
                _magic, ftype, _flags, hlen, _reserved, plen = PREFIX.unpack_from(buf)
                if ftype != FrameType.CHUNK or hlen > limits.max_header_bytes:
                    break  # the daemon's parser takes it from here (and refuses what is bad)
                if len(buf) < psize + hlen:
                    report()
                    if not self._read_some(io, fd, buf, told_to_stop):
                        break
                    continue
                try:
                    hdr = decode_header(ftype, buf[psize : psize + hlen], limits)
                except ProtocolError:
                    break
                if not isinstance(hdr, ChunkHeader) or hdr.copy is not False:
                    break
                leased = leases.get(hdr.rid)
                if leased is None and self.more_leases:
                    take_more()
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

                    try:
                        got, past = fill_in_thread(
                            io, dest, have, self.stopped, wanted, nothing, memoryview(past_end)
                        )
                    finally:
                        io._set_lowat(1)
                    if got < plen:  # its lease was stopped: the rest is not ours to read
                        reports.append((hdr.rid, hdr.layer, hdr.offset, plen, hdr.checksum, None))
                        skip = plen - got
                        break
                    buf += past_end[:past]
                ok = chunk_checksum(dest, hdr.rid, hdr.layer, hdr.offset) == hdr.checksum
                reports.append((hdr.rid, hdr.layer, hdr.offset, plen, hdr.checksum, ok))
                landed += 1
                if len(reports) >= REPORT_EVERY:
                    report()
        finally:
            report()
        return Done(job.job, landed, None, None, ahead=bytes(buf), skip=skip)

    def _read_some(
        self, io: SockIO, fd: int, buf: bytearray, told_to_stop: Callable[[], bool]
    ) -> bool:
        """Bytes read onto ``buf``; False when the run is to end first (told to stop, or the
        peer closed: the daemon reads on and sees the end itself)."""
        since = time.monotonic()
        while True:
            if self.stopped():
                raise ThreadStopped("connection closing")
            if told_to_stop():
                return False
            try:
                data = os.read(fd, FRAME_READ)
            except BlockingIOError:
                wait_readable(fd, io.idle_timeout, since)
                continue
            if not data:
                return False
            buf += data
            return True

    def _send(self, job: Send) -> Done:
        pool, limits = self.worker.pool, self.worker.limits
        frames: list[list[memoryview]] = []
        for c in job.chunks:
            if c.pool_offset + c.length > len(pool):
                raise WorkerProtocolError(f"payload {c.pool_offset}+{c.length} outside the pool")
            payload = pool[c.pool_offset : c.pool_offset + c.length]
            checksum = c.checksum
            if checksum is None:
                checksum = chunk_checksum(payload, c.rid, c.layer, c.offset)
            hdr = ChunkHeader(c.rid, c.layer, c.offset, c.length, checksum, c.copy)
            frames.append([memoryview(encode_chunk_header_checked(hdr, limits)), payload])
        moved = sum(c.length for c in job.chunks)
        if job.records is not None or self.sealed:
            records = self._sealed_records(job.records, receiving=False)
            for f in frames:
                records.send_all_in_thread(joined_small(f), self.stopped)
            return Done(job.job, moved, None, RecordState.of(records.sealer))
        io = SockIO(self.sock)  # type: ignore[arg-type]
        send_all_in_thread(io, [b for f in frames for b in f], self.stopped)
        return Done(job.job, moved, None, None)


class Worker:
    """The control loop: read jobs, hand them to their connection's thread, write replies."""

    def __init__(
        self, ctrl: socket.socket, pool: memoryview, limits: Limits, flags: memoryview
    ) -> None:
        self.ctrl = ctrl
        self.pool = pool
        self.flags = flags  # the stop flags (``worker_jobs.STOP_SLOTS``), set by the daemon
        self.limits = limits
        self.conns: dict[int, _Conn] = {}
        self.ending = False
        self._reply_lock = threading.Lock()
        self._fds: deque[int] = deque()

    def reply(self, done: Done) -> None:
        self.send_msg(done)

    def send_msg(self, msg: Done | Landed) -> None:
        data = encode(msg)
        with self._reply_lock, contextlib.suppress(OSError):
            self.ctrl.sendall(data)

    def run(self) -> int:
        reader = JobReader()
        try:
            while True:
                try:
                    data, fds, _flags, _addr = socket.recv_fds(self.ctrl, 1 << 16, MAX_FDS)
                except OSError:
                    return 0
                self._fds.extend(fds)
                if not data:
                    return 0
                for msg in reader.feed(data):
                    self._dispatch(msg)
        except WorkerProtocolError as e:
            log.error("xdc data worker: bad frame from the daemon: %s", e)
            return 2
        finally:
            self.ending = True
            for c in list(self.conns.values()):
                c.drop()
            for fd in self._fds:
                os.close(fd)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, Adopt):
            if not self._fds:
                raise WorkerProtocolError("ADOPT without a descriptor")
            old = self.conns.pop(msg.conn, None)
            if old is not None:
                old.drop()
            self.conns[msg.conn] = _Conn(self, msg, self._fds.popleft())
        elif isinstance(msg, Recv | Send | Run):
            conn = self.conns.get(msg.conn)
            if conn is None:
                self.reply(Done(msg.job, 0, None, None, Failure.BAD_JOB, "unknown connection"))
            else:
                conn.jobs.put(msg)
        elif isinstance(msg, AddLease):
            conn = self.conns.get(msg.conn)
            if conn is not None:
                conn.more_leases.append((msg.job, msg.lease))
        elif isinstance(msg, Drop):
            conn = self.conns.pop(msg.conn, None)
            if conn is not None:
                conn.drop()
        else:
            raise WorkerProtocolError(f"a worker does not take {type(msg).__name__}")


def _die_with_parent(parent: int) -> None:
    """Exit this worker the moment the daemon that started it exits, whatever the cause: its
    sockets are copies of the daemon's, and a peer must see them close with the daemon.

    Not PR_SET_PDEATHSIG: that fires when the *thread* that started the child ends, and trio
    starts processes from a thread of its cache, which ends after 10 idle seconds. Every
    worker was SIGKILLed 10 s after its daemon started (and its connections lost with it).
    A pidfd of the daemon becomes readable when the daemon process exits, whichever thread
    started us; a thread here waits on it."""
    if not parent:
        return
    try:
        pidfd: int | None = os.pidfd_open(parent)
    except (OSError, AttributeError):  # a kernel before 5.3: look at the parent instead
        pidfd = None
    if os.getppid() != parent:  # the daemon died before we could watch it
        os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()
        else:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="daemon-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="xdc data worker (started by a daemon)")
    ap.add_argument("--ctrl-fd", type=int, required=True)
    ap.add_argument("--pool-fd", type=int, required=True)
    ap.add_argument("--flags-fd", type=int, required=True, help="the stop flags' memfd")
    ap.add_argument("--limits", default="{}", help="the daemon's protocol limits, as JSON")
    ap.add_argument("--parent-pid", type=int, default=0, help="the daemon's pid")
    args = ap.parse_args(argv)
    _die_with_parent(args.parent_pid)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    size = os.fstat(args.pool_fd).st_size
    pool = mmap.mmap(args.pool_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(args.pool_fd)
    flags = mmap.mmap(args.flags_fd, STOP_SLOTS, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(args.flags_fd)
    limits = Limits(**json.loads(args.limits))
    ctrl = socket.socket(fileno=args.ctrl_fd)
    return Worker(ctrl, memoryview(pool), limits, memoryview(flags)).run()


if __name__ == "__main__":
    sys.exit(main())
