"""A daemon's data worker processes: started, lent connections, asked to move payloads, ended.

The daemon side of ``transport.data_worker`` (docs/data_workers.md). Each worker is a child
process with a control socketpair; a connection is *adopted* by one worker (a descriptor of its
socket travels as SCM_RIGHTS), and then each payload move is one job on that channel whose
reply gives the lent record state back. Owned by the daemon's nursery (``serve``); a worker
that dies, or writes anything its protocol does not allow, fails every job in flight on it
with ``WorkerLost`` (the connections it held are then lost, their chunks resent elsewhere,
as after any connection loss) and takes no new connection.

A job is never abandoned while the worker may still write into its buffers: a cancelled
caller first asks the worker to stop (DROP; the job ends within ``sockio.THREAD_POLL_S``) and
waits for the reply, and kills the worker if none comes in ``STOP_GRACE_S``.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import json
import logging
import mmap
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import trio
from xdc.transport.shm import Segment

from xdc.errors import LocalConnectionError
from xdc.protocol import Limits
from xdc.protocol.worker_jobs import (
    FLAG_CLOSED,
    FLAG_STOP,
    STOP_SLOTS,
    AddLease,
    Adopt,
    Done,
    Drop,
    JobReader,
    Landed,
    Lease,
    Recv,
    Run,
    Send,
    WorkerProtocolError,
    encode,
)

log = logging.getLogger("xdc.data_workers")
# what a RUN's caller does with its reports (settle them in the books, answer the sender)
OnLanded = Callable[[list[Landed]], Awaitable[None]]
STOP_GRACE_S = 5.0  # a worker asked to stop a job, or to exit, has this long
START_TIMEOUT_S = 30.0


class WorkerLost(LocalConnectionError):
    """The data worker holding this connection died or broke its protocol."""


@dataclass
class _Call:
    done: trio.Event = field(default_factory=trio.Event)
    reply: Done | None = None
    # a RUN's reports not handed to its caller yet, and an event set when one comes (or the
    # reply, or the worker's end)
    reports: list[Landed] = field(default_factory=list)
    news: trio.Event = field(default_factory=trio.Event)


@dataclass(eq=False)
class _Proc:
    index: int
    process: trio.Process
    ctrl: trio.socket.SocketType
    send_lock: trio.Lock = field(default_factory=trio.Lock)
    calls: dict[int, _Call] = field(default_factory=dict)
    conns: set[int] = field(default_factory=set)
    alive: bool = True
    why: str = ""
    drops: list[int] = field(default_factory=list)  # connections closed, DROP not yet sent
    dropping: trio.Event = field(default_factory=trio.Event)


@dataclass(frozen=True, eq=False)
class WorkerConn:
    """One connection as lent to one worker: the handle its ``WireConn`` sends jobs through."""

    workers: DataWorkers
    proc: _Proc
    conn: int
    sealed: bool

    @property
    def alive(self) -> bool:
        return self.proc.alive

    async def run(self, job: Recv | Send) -> Done:
        return await self.workers.call(self, job)

    async def run_frames(self, job: Run, on_landed: OnLanded) -> Done:
        """A RUN: ``on_landed`` is awaited with its reports, in order, as they come (never
        two at once), and every report comes before the reply."""
        return await self.workers.call(self, job, on_landed)

    def next_job(self) -> int:
        return next(self.workers.job_ids)

    async def add_lease(self, job: int, lease: Lease) -> None:
        """One more lease for RUN ``job`` on this connection (dropped by the worker if that
        run is over; the run's caller lets go of it either way when the run ends)."""
        await self.workers.send_quietly(self.proc, AddLease(self.conn, job, lease))

    async def release(self) -> None:
        """The connection is closing: the worker closes its copy of the socket."""
        self.proc.conns.discard(self.conn)
        await self.workers.send_quietly(self.proc, Drop(self.conn))

    def release_soon(self) -> None:
        """``release`` from synchronous code (``WireConn.close``): the DROP goes out from the
        worker's flusher task."""
        if self.conn in self.proc.conns:
            self.proc.conns.discard(self.conn)
            self.proc.drops.append(self.conn)
            self.proc.dropping.set()


@dataclass(eq=False)
class StopFlag:
    """One byte of the stop flags the daemon and its workers map (``worker_jobs.STOP_SLOTS``):
    a RECV that names it ends early once it is set. A thread can be told mid-payload that a
    resend of its chunk was verified (it asks ``still_wanted``); a process is told by this
    byte, which its reading thread looks at between reads and between waits of at most
    ``sockio.THREAD_POLL_S``. Held by one in-place read at a time, then released."""

    workers: DataWorkers
    slot: int

    def set(self) -> None:
        self.workers._flags[self.slot] = FLAG_STOP

    def close(self) -> None:
        """A run's lease only: land nothing more in its buffer, but do not end the run."""
        if not self.workers._flags[self.slot]:
            self.workers._flags[self.slot] = FLAG_CLOSED

    def is_set(self) -> bool:
        return self.workers._flags[self.slot] != 0

    def release(self) -> None:
        self.workers._release_slot(self.slot)


class DataWorkers:
    """``count`` worker processes sharing the daemon's pool (``segment``)."""

    def __init__(self, count: int, segment: Segment, limits: Limits) -> None:
        if count < 1:
            raise ValueError("at least one data worker")
        self.count = count
        self.segment = segment
        self.limits = limits
        self.procs: list[_Proc] = []
        self.job_ids = itertools.count(1)
        # where the pool starts in this process (an address, not a buffer export: the pool
        # must stay free to unmap)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(segment.view))
        self._conn_ids = itertools.count(1)
        self.lost = 0  # workers that died or were killed while the daemon ran
        # the stop flags: anonymous shared memory (a memfd, passed to each worker as its
        # pool is), so nothing named is left behind whatever ends the daemon
        self._flags_fd = os.memfd_create("xdc-stop-flags", os.MFD_CLOEXEC)
        os.ftruncate(self._flags_fd, STOP_SLOTS)
        self._flags = mmap.mmap(self._flags_fd, STOP_SLOTS, mmap.MAP_SHARED)
        self._free_slots: list[int] = []
        self._next_slot = 0

    def stop_flag(self) -> StopFlag | None:
        """A cleared stop flag for one in-place read; None when all are held (that read then
        runs to its end, as before there were flags)."""
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._next_slot < STOP_SLOTS:
            slot = self._next_slot
            self._next_slot += 1
        else:
            return None
        self._flags[slot] = 0
        return StopFlag(self, slot)

    def _release_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    # --- lifecycle ---------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers and keep them until cancelled; then end them (EOF on their
        channel, a grace period, SIGKILL) and reap them, so none outlives the daemon."""
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(START_TIMEOUT_S):
                    for i in range(self.count):
                        proc = await self._start(i)
                        self.procs.append(proc)
                        nursery.start_soon(self._read, proc)
                        nursery.start_soon(self._flush_drops, proc)
                task_status.started()
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await self._end_all()
            os.close(self._flags_fd)  # (the daemon's mapping of the flags stays valid)

    async def _start(self, index: int) -> _Proc:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pool_fd = self.segment.open_descriptor()
        flags_fd = os.dup(self._flags_fd)
        try:
            os.set_inheritable(theirs.fileno(), True)
            os.set_inheritable(pool_fd, True)
            os.set_inheritable(flags_fd, True)
            cmd = [
                sys.executable,
                "-m",
                "xdc.transport.data_worker",
                "--ctrl-fd",
                str(theirs.fileno()),
                "--pool-fd",
                str(pool_fd),
                "--flags-fd",
                str(flags_fd),
                "--limits",
                json.dumps(asdict(self.limits)),
                "--parent-pid",
                str(os.getpid()),
            ]
            process = await trio.lowlevel.open_process(
                cmd, pass_fds=(theirs.fileno(), pool_fd, flags_fd), start_new_session=False
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(pool_fd)
            os.close(flags_fd)
        return _Proc(index, process, trio.socket.from_stdlib_socket(ours))

    async def _end_all(self) -> None:
        for p in self.procs:
            p.alive = False
            p.ctrl.close()  # EOF: the worker drops its connections and exits
        for p in self.procs:
            with trio.move_on_after(STOP_GRACE_S):
                await p.process.wait()
            if p.process.returncode is None:
                p.process.kill()
                await p.process.wait()
            self._fail_calls(p, "the daemon is stopping")

    async def _read(self, proc: _Proc) -> None:
        reader = JobReader()
        why = "its channel closed"
        try:
            while True:
                data = await proc.ctrl.recv(1 << 16)
                if not data:
                    why = f"exited ({await self._exit_status(proc)})"
                    break
                for msg in reader.feed(data):
                    if isinstance(msg, Landed):
                        call = proc.calls.get(msg.job)
                        if call is None or call.done.is_set():
                            raise WorkerProtocolError(f"LANDED for job {msg.job}, not running")
                        call.reports.append(msg)
                        call.news.set()
                        continue
                    if not isinstance(msg, Done):
                        raise WorkerProtocolError(f"a worker sent {type(msg).__name__}")
                    call = proc.calls.pop(msg.job, None)
                    if call is None:
                        raise WorkerProtocolError(
                            f"a reply to job {msg.job}, which it does not hold"
                        )
                    call.reply = msg
                    call.done.set()
                    call.news.set()
        except WorkerProtocolError as e:
            why = f"broke its protocol: {e}"
        except (OSError, trio.ClosedResourceError) as e:
            why = f"channel failed: {e!r}"
        self._lose(proc, why)
        # its jobs fail only once it is reaped: until then a thread of it may still write
        with trio.CancelScope(shield=True):
            await proc.process.wait()
        self._fail_calls(proc, why)

    async def _flush_drops(self, proc: _Proc) -> None:
        while proc.alive:
            await proc.dropping.wait()
            proc.dropping = trio.Event()
            drops, proc.drops = proc.drops, []
            for conn in drops:
                await self.send_quietly(proc, Drop(conn))

    async def _exit_status(self, proc: _Proc) -> str:
        with trio.move_on_after(STOP_GRACE_S):
            await proc.process.wait()
        rc = proc.process.returncode
        if rc is None:
            return "still running"
        if rc < 0:
            return f"killed by {signal.Signals(-rc).name}"
        return f"status {rc}"

    def _lose(self, proc: _Proc, why: str) -> None:
        """Take no new work to ``proc`` and kill it; its reader fails the jobs it held once
        the process is reaped."""
        if proc.alive:  # (the daemon stopping marks them all not alive first: not counted)
            self.lost += 1
            log.warning("xdc: data worker %d %s; its connections are lost", proc.index, why)
        proc.alive = False
        proc.why = proc.why or why
        if proc.process.returncode is None:
            proc.process.kill()

    def _fail_calls(self, proc: _Proc, why: str) -> None:
        calls, proc.calls = proc.calls, {}
        for call in calls.values():
            call.done.set()  # reply None: WorkerLost
            call.news.set()
        proc.why = proc.why or why

    # --- connections and jobs ----------------------------------------------------------------

    def pool_offset(self, view: memoryview) -> int | None:
        """Where ``view`` starts in the pool, or None if it is not wholly inside it (a worker
        can only reach the pool)."""
        if not len(view) or view.readonly or not view.c_contiguous:
            return None
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        except (TypeError, ValueError):
            return None
        off = addr - self._base
        if off < 0 or off + view.nbytes > len(self.segment.view):
            return None
        return off

    async def adopt(
        self, sock: trio.socket.SocketType, *, sealed: bool, idle_timeout: float | None
    ) -> WorkerConn:
        """Lend ``sock``'s data phase to the live worker holding the fewest connections."""
        live = [p for p in self.procs if p.alive]
        if not live:
            raise WorkerLost("no data worker is running")
        proc = min(live, key=lambda p: len(p.conns))
        conn = next(self._conn_ids)
        # counted before the first await: connections that come up together (a sender opens
        # all of its at once) are spread over the workers, not all given to the one that
        # looked least loaded before any of them was counted
        proc.conns.add(conn)
        frame = encode(Adopt(conn, sealed, idle_timeout or 0.0))
        fds = array.array("i", [sock.fileno()])
        try:
            async with proc.send_lock:
                sent = await proc.ctrl.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                )
                if sent < len(frame):
                    await self._send_rest(proc, frame[sent:], begun=sent > 0)
        except (OSError, trio.ClosedResourceError) as e:
            proc.conns.discard(conn)
            self._lose(proc, f"channel failed: {e!r}")
            raise WorkerLost(f"data worker {proc.index}: {e!r}") from e
        except BaseException:  # cancelled mid-send: the worker may hold a half frame
            proc.conns.discard(conn)
            raise
        return WorkerConn(self, proc, conn, sealed)

    async def _send_frame(self, proc: _Proc, frame: bytes) -> None:
        """One whole frame to ``proc``. When no other task is mid-frame and the channel takes
        it all (a small frame, a worker that drains its channel: the usual case) it is
        written at once, with no trip through the scheduler: a job's sender waits for the
        reply next anyway, and a trio send or a free trio lock would yield once more per
        job. Otherwise under the send lock, waiting for room."""
        await trio.lowlevel.checkpoint_if_cancelled()  # (no yield unless cancelled)
        lock = proc.send_lock
        if lock.locked():
            async with lock:
                await self._send_rest(proc, frame)
            return
        lock.acquire_nowait()
        try:
            try:
                sent = os.write(proc.ctrl.fileno(), frame)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                await self._send_rest(proc, frame[sent:], begun=sent > 0)
        finally:
            lock.release()

    async def _send_rest(self, proc: _Proc, data: bytes, *, begun: bool = False) -> None:
        """The rest of a frame (``begun``: its first bytes already went). A frame cut short
        (cancelled between two writes) would make the worker read the next one from its
        middle: the worker is lost instead (its connections go, as when it dies)."""
        view = memoryview(data)
        try:
            while view:
                n = await proc.ctrl.send(view)
                view = view[n:]
                begun = True
        except BaseException:
            if begun and view:
                self._lose(proc, "was sent a frame cut short (cancelled mid-write)")
            raise

    async def send_quietly(self, proc: _Proc, msg: Drop | AddLease) -> None:
        if not proc.alive:
            return
        try:
            await self._send_frame(proc, encode(msg))
        except (OSError, trio.ClosedResourceError) as e:
            self._lose(proc, f"channel failed: {e!r}")

    async def call(
        self, wc: WorkerConn, job: Recv | Send | Run, on_landed: OnLanded | None = None
    ) -> Done:
        """Run ``job`` on ``wc``'s worker; its reply. WorkerLost if the worker is gone or dies
        first (reports that came before are still handed over). Cancelled only after the
        worker let go of the job's buffers."""
        proc = wc.proc
        if not proc.alive:
            raise WorkerLost(f"data worker {proc.index} {proc.why}")
        call = proc.calls[job.job] = _Call()
        try:
            await self._send_frame(proc, encode(job))
        except (OSError, trio.ClosedResourceError) as e:
            self._lose(proc, f"channel failed: {e!r}")
        try:
            while True:
                await call.news.wait()
                call.news = trio.Event()
                while call.reports:
                    batch, call.reports = call.reports, []
                    if on_landed is not None:
                        await on_landed(batch)
                if call.done.is_set() and not call.reports:
                    break
        except BaseException:
            # cancelled, or the reports' handler failed (its connection died): the worker
            # lets go of the job's buffers before this returns
            if not call.done.is_set():
                with trio.CancelScope(shield=True):
                    await self._stop(wc, call)
            raise
        if call.reply is None:
            raise WorkerLost(f"data worker {proc.index} {proc.why}")
        return call.reply

    async def _stop(self, wc: WorkerConn, call: _Call) -> None:
        """A cancelled job: the worker drops the connection (the job ends at its next check)
        and answers; one that does not within the grace period is killed and reaped."""
        await wc.release()
        with trio.move_on_after(STOP_GRACE_S):
            await call.done.wait()
        if not call.done.is_set():
            self._lose(wc.proc, "did not stop a cancelled job")
            await call.done.wait()  # set by its reader once the process is reaped

    def status(self) -> dict[str, object]:
        return {
            "workers": self.count,
            "alive": sum(p.alive for p in self.procs),
            "lost": self.lost,
            "connections": sum(len(p.conns) for p in self.procs if p.alive),
            # how evenly the connections are spread (a dead worker holds none)
            "per_worker": [len(p.conns) if p.alive else 0 for p in self.procs],
            # stop flags held by in-place reads and runs' leases: 0 at rest (one held with
            # nothing under way is a leak)
            "stop_flags_held": self._next_slot - len(self._free_slots),
        }
