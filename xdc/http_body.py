"""Read a whole HTTP body, but never more than a cap.

aiohttp's ``StreamReader.read(n)`` returns what has arrived so far (at most ``n`` bytes), not
the whole body: a body that arrives in more than one TCP segment came back cut short, and then
failed to parse ("answer is not JSON") or, for Prometheus text, silently parsed into fewer
series. Every capped body read in xdc goes through ``read_capped``."""

from __future__ import annotations

from typing import Protocol


class _Reader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


async def read_capped(stream: _Reader, limit: int) -> bytes:
    """The body up to its end; when it is longer than ``limit``, the first ``limit + 1``
    bytes and the rest is left unread (callers test ``len(raw) > limit``)."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await stream.read(limit + 1 - len(buf))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)
