"""Frames of a 4-byte big-endian length and a body, split out of a byte stream: the framing
of the channels between a process and the helpers it starts (data workers, hash helpers).
Sans-IO: bytes in, bodies out; what a body means is the caller's protocol."""

from __future__ import annotations

import struct

from xdc.errors import RemoteConnectionError

PREFIX = struct.Struct("!I")


class FrameTooLarge(RemoteConnectionError, ValueError):
    """A length prefix over the channel's limit: the other side is broken or hostile."""


def prefixed(body: bytes) -> bytes:
    return PREFIX.pack(len(body)) + body


class FrameSplitter:
    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """The whole bodies in what has come so far."""
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= PREFIX.size:
            (n,) = PREFIX.unpack_from(self._buf)
            if n > self.max_frame:
                raise FrameTooLarge(f"frame of {n} bytes (at most {self.max_frame})")
            if len(self._buf) < PREFIX.size + n:
                break
            out.append(bytes(self._buf[PREFIX.size : PREFIX.size + n]))
            del self._buf[: PREFIX.size + n]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame (a channel that ends with some was cut mid-frame)."""
        return len(self._buf)
