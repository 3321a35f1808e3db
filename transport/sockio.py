"""Data-path socket calls made directly; trio is asked to wait only when the kernel says EAGAIN.

Why not trio's socket methods on the hot path: each of them ends in a checkpoint (a trip
through the scheduler even when the call succeeded at once), and each receive ran inside its
own idle-timeout cancel scope. On a 10 Gbit/s link that was about a third of each daemon's
Python time per 1 MiB chunk (``py-spy --gil``: trio's wrappers, ``fail_after`` and cancel
scopes). Here a call that succeeds costs one syscall and nothing else; the timeout scope and
the SO_RCVLOWAT a wait needs are set up only when there is something to wait for; and the
caller yields once per frame or chunk (``pace``), so a connection whose data never runs dry
still lets the other tasks run and still sees cancellation.

The calls go through ``os.readv`` / ``os.writev`` on the socket's descriptor, read afresh on
every call: once trio closed the socket ``fileno()`` is -1 and the call fails cleanly with
EBADF instead of touching a reused descriptor. (A socket write to a reset peer is EPIPE, not
SIGPIPE: CPython ignores SIGPIPE, and the daemons are CPython processes.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import time
from collections.abc import Callable, Sequence

import trio

from xdc.errors import LocalConnectionError, RemoteConnectionError

# SO_RCVLOWAT bounds for a wait on a large pending read: a payload or record of up to 2 MiB
# costs one wake-up, not one per segment train (a 2 MiB cap instead of 512 KiB: 10 Gbit/s link,
# 4 MiB chunks, 0.92 -> 0.86 CPU s/GB side by side). The kernel still wakes a reader whose
# receive window closed or whose buffer is under pressure, so a mark can delay a wake-up but
# never stall one.
LOWAT_MIN = 64 * 1024
LOWAT_MAX = 2048 * 1024


# Bytes past a payload's end that a payload read also takes, in readv's second buffer: the
# next frame's header, when it has arrived, so that the event loop need not read it in a call
# of its own (with data threads each such call is a GIL hand-over: bench/README.md, issue 30).
# The kernel fills the payload first, so nothing lands here before the payload is complete;
# the few next-payload bytes it may hold are copied once more from the frame buffer.
READ_AHEAD = 4096


# How long a data-path thread sleeps in poll() before it looks again at cancellation and at
# whether its connection was closed under it.
THREAD_POLL_S = 0.1


class IdleTimeout(RemoteConnectionError):
    """Nothing arrived for ``SockIO.idle_timeout`` seconds while a read waited."""


def _advance(bufs: list[memoryview], sent: int) -> None:
    """Drop the ``sent`` bytes a partial writev took off the front of ``bufs``."""
    while sent:
        if sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][sent:]
            sent = 0


def lowat_for(missing: int) -> int:
    """The receive low-water mark for a wait that needs ``missing`` more bytes."""
    return min(missing, LOWAT_MAX) if missing >= LOWAT_MIN else 1


class SockIO:
    """Receive and send on one non-blocking TCP socket owned by trio (which closes it).

    One reader task and one sender at a time, as with trio's own methods; the low-water mark is
    this object's alone, so exactly one SockIO reads a given socket."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        # no byte at all for this long while a read waits: IdleTimeout (None = wait forever)
        self.idle_timeout: float | None = None
        self._lowat = 1
        self._waited = False  # a wait (a checkpoint) happened since the last pace()

    async def recv_into(
        self, dest: memoryview, lowat: int = 1, ahead: memoryview | None = None
    ) -> int:
        """Bytes read into ``dest`` (0 at end of stream); waits when none are there, then with
        SO_RCVLOWAT ``lowat``: the caller knows how much it still needs. With ``ahead``, bytes
        past ``dest`` go on into it in the same call (the count then covers both)."""
        bufs = [dest] if ahead is None else [dest, ahead]
        while True:
            try:
                return os.readv(self.sock.fileno(), bufs)
            except BlockingIOError:
                pass
            self._set_lowat(lowat)
            self._waited = True
            if self.idle_timeout is None:
                await trio.lowlevel.wait_readable(self.sock)
            else:
                with trio.move_on_after(self.idle_timeout) as scope:
                    await trio.lowlevel.wait_readable(self.sock)
                if scope.cancelled_caught:
                    raise IdleTimeout(f"nothing received for {self.idle_timeout}s")

    async def send_all(self, buffers: Sequence[memoryview]) -> int:
        """Write every byte of ``buffers`` (gathered: header and payload leave in one call
        when the socket takes them); the byte count."""
        bufs = [b for b in buffers if len(b)]
        total = 0
        while bufs:
            try:
                sent = os.writev(self.sock.fileno(), bufs)
            except BlockingIOError:
                self._waited = True
                await trio.lowlevel.wait_writable(self.sock)
                continue
            total += sent
            _advance(bufs, sent)
        return total

    async def pace(self) -> None:
        """Yield to the scheduler unless this socket waited since the last call: the end of
        one frame or chunk is where a busy connection gives the others their turn. The yield
        never raises Cancelled (what was read or written must reach the caller); callers
        check for cancellation before they start (``trio.lowlevel.checkpoint_if_cancelled``),
        as trio's own socket methods do."""
        if self._waited:
            self._waited = False
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()

    def _set_lowat(self, n: int) -> None:
        if n != self._lowat:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
                self._lowat = n


class ThreadStopped(LocalConnectionError):
    """A data-path thread gave up because its connection was closed or its task cancelled."""


def _wait_fd(fd: int, events: int, timeout_s: float) -> None:
    poller = select.poll()
    poller.register(fd, events)
    poller.poll(max(0, int(timeout_s * 1000)))


def send_all_in_thread(io: SockIO, buffers: list[memoryview], stopped: Callable[[], bool]) -> int:
    """``SockIO.send_all`` for a worker thread: the same writes, waiting in ``poll()`` (the GIL
    released) instead of in trio. ``stopped`` is asked before every write and after every wait
    of at most THREAD_POLL_S, so a closed connection or a cancelled task ends it promptly.
    The caller keeps the socket open until this returns (``WireConn`` defers its close)."""
    bufs = [b for b in buffers if len(b)]
    total = 0
    fd = io.sock.fileno()
    while bufs:
        if stopped():
            raise ThreadStopped("connection closing")
        try:
            sent = os.writev(fd, bufs)
        except BlockingIOError:
            _wait_fd(fd, select.POLLOUT, THREAD_POLL_S)
            continue
        total += sent
        _advance(bufs, sent)
    return total


def recv_in_thread(io: SockIO, dest: memoryview, lowat: int, stopped: Callable[[], bool]) -> int:
    """``SockIO.recv_into`` for a worker thread: bytes read into ``dest`` (0 at end of
    stream), waiting in ``poll()`` with SO_RCVLOWAT ``lowat``, asking ``stopped`` after every
    wait of at most THREAD_POLL_S; IdleTimeout after ``io.idle_timeout`` without a byte."""
    fd = io.sock.fileno()
    idle = io.idle_timeout
    since = time.monotonic()
    while True:
        if stopped():
            raise ThreadStopped("connection closing")
        try:
            return os.readv(fd, [dest])
        except BlockingIOError:
            pass
        io._set_lowat(lowat)
        wait_readable(fd, idle, since)


def fill_in_thread(
    io: SockIO,
    dest: memoryview,
    start: int,
    stopped: Callable[[], bool],
    still_wanted: Callable[[], bool] | None,
    guard: contextlib.AbstractContextManager[object],
    ahead: memoryview | None = None,
) -> tuple[int, int]:
    """Receive into ``dest[start:]`` from a worker thread until it is full: the byte count
    reached (short of ``len(dest)`` only when ``still_wanted`` said no), and how many bytes
    past the payload the last read put into ``ahead`` (``READ_AHEAD``). Waits set SO_RCVLOWAT
    as ``SockIO.recv_into`` does. ``still_wanted`` and the read that follows it run under
    ``guard``, so whoever takes the guard (the receiver, before it copies a verified resend of
    the same chunk into place) knows no read of this chunk is under way while it holds it;
    bytes read ahead never go into ``dest``."""
    total = len(dest)
    fd = io.sock.fileno()
    idle = io.idle_timeout
    last = time.monotonic()
    n = start
    while n < total:
        if stopped():
            raise ThreadStopped("connection closing")
        with guard:
            if still_wanted is not None and not still_wanted():
                return n, 0
            try:
                k = os.readv(fd, [dest[n:]] if ahead is None else [dest[n:], ahead])
            except BlockingIOError:
                k = -1
        if k == 0:
            raise EOFError("peer closed the connection mid-payload")
        if k > 0:
            if n + k > total:  # the payload is complete and the next frame has begun
                return total, n + k - total
            n += k
            last = time.monotonic()
            continue
        io._set_lowat(lowat_for(total - n))
        wait_readable(fd, idle, last)
    return n, 0


def wait_readable(fd: int, idle: float | None, since: float) -> None:
    """Wait in poll() for bytes, at most THREAD_POLL_S; IdleTimeout once ``idle`` seconds
    have passed ``since`` the last byte."""
    wait = THREAD_POLL_S
    if idle is not None:
        left = since + idle - time.monotonic()
        if left <= 0:
            raise IdleTimeout(f"nothing received for {idle}s")
        wait = min(wait, left)
    _wait_fd(fd, select.POLLIN, wait)


def zeroed(n: int) -> mmap.mmap:
    """``n`` zero bytes whose pages the kernel supplies when first written, for a
    connection's receive and record buffers: they cost nothing until bytes come.
    ``bytearray(n)`` writes every byte (CPython zero-fills it), so each idle connection was
    resident at full size (300 idle sealed connections: +421 MiB; TLS records: +90 MiB).
    Private: a process forked later gets its own copy, never a view of this one."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
