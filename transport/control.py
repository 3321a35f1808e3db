"""Engine <-> daemon control messages over a Unix socket: 4-byte length + msgpack map.

Only small control messages travel here; KV bytes stay in shared memory. The same framing is
spoken by the blocking client used inside engines and by the trio daemons.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

import msgpack
import trio

log = logging.getLogger("xdc.control")

LEN = struct.Struct("!I")
MAX_CONTROL_MESSAGE = 4 * 1024 * 1024


class ControlError(Exception):
    """The daemon answered with an error, or the control socket broke."""


def pack(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return LEN.pack(len(body)) + body


def unpack(body: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    if not isinstance(msg, dict):
        raise ControlError("control message is not a map")
    return msg


# --- blocking side (engines) -------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ControlError("daemon closed the control socket")
        got += k
    return bytes(buf)


def recv_blocking(sock: socket.socket) -> dict[str, Any]:
    (n,) = LEN.unpack(_recv_exact(sock, LEN.size))
    if n > MAX_CONTROL_MESSAGE:
        raise ControlError(f"control message of {n} bytes is over the limit")
    return unpack(_recv_exact(sock, n))


def send_blocking(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(pack(msg))


# --- trio side (daemons) -----------------------------------------------------------------


class TrioChannel:
    """One engine connection as seen by a daemon: framed receive, locked send."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self._send_lock = trio.Lock()

    async def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            data = await self.stream.receive_some(65536)
            if not data:
                return False
            self._buf += data
        return True

    async def receive(self) -> dict[str, Any] | None:
        """Next message, or None when the engine hung up."""
        if not await self._fill(LEN.size):
            return None
        (n,) = LEN.unpack_from(self._buf)
        if n > MAX_CONTROL_MESSAGE:
            raise ControlError(f"control message of {n} bytes is over the limit")
        if not await self._fill(LEN.size + n):
            return None
        body = bytes(self._buf[LEN.size : LEN.size + n])
        del self._buf[: LEN.size + n]
        return unpack(body)

    async def send(self, msg: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.stream.send_all(pack(msg))


def peer_cred(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, from SO_PEERCRED (Linux)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return int(pid), int(uid), int(gid)


def peer_uid(sock: socket.socket | trio.socket.SocketType) -> int:
    """The connecting process's uid from SO_PEERCRED (Linux)."""
    return peer_cred(sock)[1]


def engine_uids(extra: str, own_uid: int | None = None) -> frozenset[int]:
    """Uids allowed on an engine socket: the daemon's own, root, and ``node.allowed_uids``.

    File permissions (0600) already keep others out; this second check still holds when
    someone loosens the socket's mode or the directory it lives in.
    """
    own = os.getuid() if own_uid is None else own_uid
    more = {int(u) for u in (x.strip() for x in extra.split(",")) if u.isdigit()}
    return frozenset({0, own, *more})


async def accept_engines(
    ctl: trio.socket.SocketType,
    allowed: frozenset[int],
    who: str,
    serve: Any,
    nursery: trio.Nursery,
) -> None:
    """Accept engine connections on the daemon's Unix socket, refusing (and logging) peers
    whose uid SO_PEERCRED does not allow; each accepted one is served in ``nursery``."""
    while True:
        sock, _ = await ctl.accept()
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


def bind_unix_listener(path: str, *, group: bool = False) -> socket.socket:
    """Bind the engine socket owner-only (0600), replacing a stale socket file but never
    a regular file someone pointed the config at by mistake.

    ``group`` (set when node.allowed_uids names engine users) makes it 0660, so engines in
    the daemon's group can reach it at all; SO_PEERCRED then admits only the listed uids.
    """
    p = Path(path)
    if p.exists() or p.is_symlink():
        if not stat.S_ISSOCK(p.lstat().st_mode):
            raise ControlError(f"{path} exists and is not a socket; refusing to replace it")
        p.unlink()
    p.parent.mkdir(parents=True, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117 if group else 0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(64)
    sock.setblocking(False)
    return sock
