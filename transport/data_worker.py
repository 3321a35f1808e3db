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
)
from xdc.transport.wire import joined_small
from xdc.transport.worker_run import FrameSource, PlainSource, SealedSource, run_frames

from xdc.errors import LocalConnectionError
from xdc.protocol import ChunkHeader, Limits
from xdc.protocol.aead_records import Cipher, Opener, SealedError, Sealer
from xdc.protocol.wire.checksum import chunk_checksum
from xdc.protocol.wire.frames import encode_chunk_header_checked
from xdc.protocol.worker_jobs import (
    STOP_SLOTS,
    AddLease,
    Adopt,
    Done,
    Drop,
    Failure,
    JobReader,
    Landed,
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
        # run's thread before it looks at its stop flags and when a chunk's request is not
        # among its leases yet
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
        """A run (``worker_run``) on this connection, plain or with its records lent."""
        source: FrameSource
        if self.sealed:
            records = self._sealed_records(job.records, receiving=True)
            source = SealedSource(records, self.stopped)
        elif job.records is not None:
            raise WorkerProtocolError("record state given for a plain connection")
        else:
            io = SockIO(self.sock)  # type: ignore[arg-type]
            io.idle_timeout = self.idle
            source = PlainSource(io, self.stopped)
        more = self.more_leases

        def take_more(take: Callable[[Lease], None]) -> None:
            """Leases the daemon added since (for requests it accepted after the run began);
            those of earlier runs are dropped, a later run's stay (job ids grow)."""
            while more and more[0][0] <= job.job:
                for_job, lease = more.popleft()
                if for_job == job.job:
                    take(lease)

        w = self.worker
        return run_frames(
            job, source, w.pool, w.limits, w.flags, take_more, self.stopped, w.send_msg
        )

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
