"""The hash helpers' messages: msgpack arrays in length-prefixed frames
(``xdc.protocol.length_prefixed``). Sans-IO: a reader takes bytes and returns whole
messages."""

from __future__ import annotations

from typing import Any

import msgpack

from xdc.protocol.length_prefixed import FrameSplitter, prefixed

MAX_FRAME = 16 << 20  # a check of a 32K-token layer is ~33 KiB; anything near this is wrong


def frame(msg: list[Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return prefixed(body)


class FrameReader:
    def __init__(self) -> None:
        self._frames = FrameSplitter(MAX_FRAME)

    def feed(self, data: bytes) -> list[list[Any]]:
        """Whole messages in what has come so far; ValueError for a frame that is not one."""
        out: list[list[Any]] = []
        for body in self._frames.feed(data):
            try:
                msg = msgpack.unpackb(body, raw=False)
            except Exception as e:  # msgpack's own errors, not all of them ValueErrors
                raise ValueError(f"a frame that is not msgpack: {e}") from None
            if not isinstance(msg, list) or not msg:
                raise ValueError("a frame that is not a non-empty array")
            out.append(msg)
        return out
