"""The engine control socket's I/O: a Unix socket carrying ``xdc.protocol.engine_control`` frames.

Only small control messages travel here; KV bytes stay in shared memory. The protocol (what
may be said, and every check on it) is ``xdc.protocol.engine_control``; this module only moves its
frames, for the blocking client inside engines and for the trio daemons.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import trio
from xdc.transport.fd_budget import ACCEPT_EXHAUSTED

from xdc.errors import ControlError, ResultCode, StartupError, TransferError
from xdc.protocol.engine_control import (
    LEN,
    MAX_MESSAGE,
    Framer,
    Op,
    Request,
    decode_request,
    failure,
    reply,
)

log = logging.getLogger("xdc.control")

# the byte that carries a passed descriptor, after the hello reply that announced it
FD_BYTE = b"F"
# how long a reply may take to go out once its call was carried out (see serve_engine)
REPLY_GRACE_S = 2.0
# a handle() result may name a descriptor under this key: sent after the reply, then closed
PASS_FD = "_pass_fd"

__all__ = [
    "ControlError",
    "EngineSession",
    "EngineSocket",
    "TrioChannel",
    "recv_blocking",
    "send_blocking",
    "serve_engine",
]


# --- blocking side (engines) -------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ControlError(ResultCode.PROTOCOL, "daemon closed the control socket")
        got += k
    return bytes(buf)


def recv_fd_blocking(sock: socket.socket) -> int:
    """The descriptor a daemon passes after a hello reply that says ``pool_fd``."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    if data != FD_BYTE or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ControlError(ResultCode.PROTOCOL, "daemon announced a pool descriptor but sent none")
    return fds[0]


def recv_blocking(sock: socket.socket) -> bytes:
    """One message body (the decoder checks what is in it)."""
    (n,) = LEN.unpack(_recv_exact(sock, LEN.size))
    if n > MAX_MESSAGE:
        raise ControlError(ResultCode.LIMIT, f"control message of {n} bytes is over the limit")
    return _recv_exact(sock, n)


def send_blocking(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(frame)


# --- trio side (daemons) -----------------------------------------------------------------


class TrioChannel:
    """One engine connection as seen by a daemon: framed receive, locked send."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._framer = Framer()
        self._send_lock = trio.Lock()

    async def receive(self) -> bytes | None:
        """Next message body, or None when the engine hung up. A length over the limit is a
        ControlError: the stream cannot be resynchronised, so the connection must close."""
        while True:
            body = self._framer.next_body()
            if body is not None:
                return body
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self._framer.feed(data)

    async def send(self, frame: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(frame)

    async def send_bounded(
        self, frame: bytes | None, grace_s: float, fd: int | None = None
    ) -> bool:
        """Send ``frame`` whole, then the byte carrying ``fd`` (SCM_RIGHTS) when one is given,
        whatever cancels the caller meanwhile; False when the engine did not take them within
        ``grace_s`` of the socket being full (the stream may then be torn: the caller must
        close the connection).

        Only a send that waits for the engine is bounded. What the socket takes at once is
        written with no checkpoint, and waiting for another send to finish is not bounded
        either (every other send ends when the daemon stops: pushes are cancelled, replies
        bounded like this one). A deadline taken before the write ran out across a pause of
        this process (SIGSTOP, a stalled VM) and closed a connection whose engine was reading
        (the CI failure of test_a_receiver_paused_under_traffic_loses_no_request). The reply
        and its descriptor go out under one hold of the send lock, so no push can come
        between them: the engine reads the descriptor's byte right after the reply."""
        with trio.CancelScope(shield=True) as scope:
            await self._send_lock.acquire()
            try:
                sock = self.stream.socket
                if frame is not None:
                    sent = _write_now(sock.fileno(), frame)
                    if sent < len(frame):
                        scope.deadline = trio.current_time() + grace_s
                        await self.stream.send_all(memoryview(frame)[sent:])
                if fd is not None:
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))]
                    if not _sendmsg_now(sock.fileno(), ancillary):
                        if scope.deadline == math.inf:
                            scope.deadline = trio.current_time() + grace_s
                        await sock.sendmsg([FD_BYTE], ancillary)
            finally:
                self._send_lock.release()
        return not scope.cancelled_caught


def _write_now(fileno: int, data: bytes) -> int:
    """What a non-blocking socket takes of ``data`` at once (no trio checkpoint)."""
    try:
        return os.write(fileno, data)
    except BlockingIOError:
        return 0
    except OSError as e:
        raise trio.BrokenResourceError(f"send failed: {e!r}") from e


def _sendmsg_now(fileno: int, ancillary: list[tuple[int, int, bytes]]) -> bool:
    """Send the descriptor's byte if the non-blocking socket takes it at once (no trio
    checkpoint); False when it is full. The stdlib socket only borrows the descriptor."""
    sock = socket.socket(fileno=fileno)
    try:
        return sock.sendmsg([FD_BYTE], ancillary) == 1
    except BlockingIOError:
        return False
    except OSError as e:
        raise trio.BrokenResourceError(f"send failed: {e!r}") from e
    finally:
        sock.detach()


class EngineSession(Protocol):
    """What a daemon keeps per engine connection: it answers typed requests and cleans up
    when the connection ends (for whatever reason)."""

    async def handle(self, request: Request) -> dict[str, Any]:
        """The reply's fields; TransferError for a refusal the engine should see."""
        ...

    def closed(self) -> None: ...


async def _say(chan: TrioChannel, frame: bytes | None, fd: int | None, who: str) -> bool:
    """Send one call's answer (and the descriptor it passes); False when the engine did not
    take it within REPLY_GRACE_S of the socket being full.

    An answer goes out also when the daemon is stopping meanwhile: a drain that sees an
    engine's RELEASE done may end the daemon before this task sent the reply, and the engine
    would read a closed socket for a call that was carried out (or, for a refusal, would not
    learn why). Bounded, so that an engine that stopped reading cannot hold up the shutdown
    (``TrioChannel.send_bounded`` says what the bound counts)."""
    if frame is None and fd is None:
        return True
    ok = await chan.send_bounded(frame, REPLY_GRACE_S, fd)
    if not ok:
        log.warning("%s engine: no room for a reply in %ss: closed", who, REPLY_GRACE_S)
    return ok


async def serve_engine(
    chan: TrioChannel, serves: frozenset[Op], session: EngineSession, who: str
) -> None:
    """Serve one engine connection until it closes. Nothing an engine sends can end more
    than its own connection: a message that does not decode is answered BAD_REQUEST (or
    pushed as an error event when it had no id) and the next one is read; only a framing
    error, which leaves no way to find the next message, closes the connection."""
    try:
        while True:
            body = await chan.receive()
            if body is None:
                return
            try:
                env = decode_request(body, serves)
            except ControlError as e:
                log.info("%s engine: refused a message: %s", who, e.message)
                if not await _say(chan, failure(e.id, e.code, e.message), None, who):
                    return
                continue
            rid = getattr(env.request, "rid", None)
            try:
                fields = await session.handle(env.request)
            except TransferError as e:
                answer = failure(env.id, e.code, e.message, e.rid or rid)
            except Exception:  # a bug of ours: say so loudly, but keep serving everyone else
                log.exception("%s engine: internal error handling %r", who, env.request)
                answer = failure(env.id, ResultCode.INTERNAL, "internal error", rid)
            else:
                fd = fields.pop(PASS_FD, None)
                try:
                    frame = reply(env.id, **fields) if env.id is not None else None
                    sent = await _say(chan, frame, fd if isinstance(fd, int) else None, who)
                finally:
                    if isinstance(fd, int):
                        os.close(fd)
                if not sent:
                    return
                continue
            if not await _say(chan, answer, None, who):
                return
    except ControlError as e:
        log.warning("%s engine connection closed: %s", who, e)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
        log.info("%s engine connection ended: %s", who, e or "closed")
    finally:
        session.closed()
        await chan.stream.aclose()


def peer_cred(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, from SO_PEERCRED (Linux)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return int(pid), int(uid), int(gid)


def engine_uids(extra: tuple[int, ...], own_uid: int | None = None) -> frozenset[int]:
    """Uids allowed on an engine socket: the daemon's own, root, and ``node.allowed_uids``.

    File permissions (0600) already keep others out; this second check still holds when
    someone loosens the socket's mode or the directory it lives in.
    """
    own = os.getuid() if own_uid is None else own_uid
    return frozenset({0, own, *extra})


async def accept_engines(
    ctl: trio.socket.SocketType,
    allowed: frozenset[int],
    who: str,
    serve: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    """Accept engine connections on the daemon's Unix socket, refusing (and logging) peers
    whose uid SO_PEERCRED does not allow; each accepted one is served in ``nursery``.

    Running out of descriptors (or kernel memory) is a reason to wait, never to end: the
    pending engine stays in the backlog and is accepted once a connection closes."""
    failures = 0
    while True:
        try:
            sock, _ = await ctl.accept()
        except OSError as e:
            if e.errno not in ACCEPT_EXHAUSTED:
                raise
            failures += 1
            if failures in (1, 10, 100) or failures % 1000 == 0:
                log.warning(
                    "%s engine socket: cannot accept: %s (%d times); retrying",
                    who,
                    os.strerror(e.errno or 0),
                    failures,
                )
            await trio.sleep(0.1)
            continue
        why = engine_refusal(sock, allowed)
        if why:
            log.warning("%s engine connection refused: %s", who, why)
            sock.close()
            continue
        nursery.start_soon(serve, trio.SocketStream(sock))


def engine_refusal(sock: socket.socket | trio.socket.SocketType, allowed: frozenset[int]) -> str:
    """Why an engine connection must be closed ("" = it may stay)."""
    try:
        pid, uid, _gid = peer_cred(sock)
    except OSError as e:
        return f"no peer credentials ({e})"
    if uid in allowed:
        return ""
    return f"pid {pid} runs as uid {uid}, not one of {sorted(allowed)} (node.allowed_uids)"


class EngineSocket:
    """A daemon's engine socket, held for the daemon's life.

    A lock file beside it (``PATH.lock``, flock) says which daemon serves it: a second daemon
    started with the same config is refused before it touches anything (it used to replace
    the socket, fail later on its status port, and unlink the socket on the way out,
    orphaning the first daemon's engines). Only a socket file with no live holder is
    replaced, and never a regular file someone pointed the config at by mistake.
    """

    def __init__(self, path: str, sock: socket.socket, lock_fd: int) -> None:
        self.path = path
        self.sock = sock
        self._lock_fd = lock_fd
        self._ino = os.stat(path).st_ino

    @classmethod
    def bind(cls, path: str, *, group: bool = False) -> EngineSocket:
        """``group`` (set when node.allowed_uids names engine users) makes the socket 0660,
        so engines in the daemon's group can reach it at all; SO_PEERCRED then admits only
        the listed uids. Otherwise it is owner-only (0600)."""
        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise StartupError(f"engine socket {path}: {e.strerror or e}") from None
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip()
                raise StartupError(
                    f"another xdc daemon{f' (pid {holder})' if holder else ''} serves {path}; "
                    "stop it first, or give this one another control_socket"
                ) from None
            os.ftruncate(lock_fd, 0)
            os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
            if p.exists() or p.is_symlink():
                if not stat.S_ISSOCK(p.lstat().st_mode):
                    raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
                p.unlink()  # a socket nobody holds the lock of: left by a dead daemon
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o117 if group else 0o177)
            try:
                sock.bind(path)
            except OSError as e:
                sock.close()
                raise StartupError(f"engine socket {path}: {e.strerror or e}") from None
            finally:
                os.umask(old)
            sock.setblocking(False)
            return cls(path, sock, lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise

    def listen(self) -> None:
        """Engines may connect from now on (until then a connect is refused, so nobody
        mistakes a daemon that is still starting for one that serves)."""
        self.sock.listen(64)

    def close(self) -> None:
        """Close, and remove the socket file if it is still ours; then let go of the lock."""
        self.sock.close()
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        os.close(self._lock_fd)
