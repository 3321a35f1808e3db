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
import os
import socket
from collections.abc import Sequence

import trio

# SO_RCVLOWAT bounds for a wait on a large pending read: a payload or record of up to 2 MiB
# costs one wake-up, not one per segment train (a 2 MiB cap instead of 512 KiB: 10 Gbit/s link,
# 4 MiB chunks, 0.92 -> 0.86 CPU s/GB side by side). The kernel still wakes a reader whose
# receive window closed or whose buffer is under pressure, so a mark can delay a wake-up but
# never stall one.
LOWAT_MIN = 64 * 1024
LOWAT_MAX = 2048 * 1024


class IdleTimeout(Exception):
    """Nothing arrived for ``SockIO.idle_timeout`` seconds while a read waited."""


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

    async def recv_into(self, dest: memoryview, lowat: int = 1) -> int:
        """Bytes read into ``dest`` (0 at end of stream); waits when none are there, then with
        SO_RCVLOWAT ``lowat``: the caller knows how much it still needs."""
        while True:
            try:
                return os.readv(self.sock.fileno(), [dest])
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
            while sent:
                if sent >= len(bufs[0]):
                    sent -= len(bufs[0])
                    bufs.pop(0)
                else:
                    bufs[0] = bufs[0][sent:]
                    sent = 0
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
