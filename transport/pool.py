"""The daemon's bounded buffer pool: one shared-memory segment carved by an Allocator.

``alloc`` waits while the pool is full (that wait *is* the backpressure the producer feels) and
refuses at once a size that could never fit, so an oversized transfer gets a clear error
instead of waiting forever or growing memory.
"""

from __future__ import annotations

import math

import trio
from xdc.transport.allocator import Allocator
from xdc.transport.shm import Segment

from xdc.errors import LocalRequestError


class PoolTooSmall(LocalRequestError):
    """The request is larger than the whole pool: waiting would never help."""


class BufferPool:
    def __init__(self, size: int, *, prefix: str = "xdc", align: int = 4096) -> None:
        self.segment = Segment.create(size, prefix=prefix)
        self.allocator = Allocator(size, align=align)
        self._freed = trio.Event()
        self.waiters = 0

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def view(self) -> memoryview:
        return self.segment.view

    def try_alloc(self, size: int) -> int | None:
        if not self.allocator.fits_ever(size):
            raise PoolTooSmall(
                f"{size} bytes can never fit in a pool of {self.allocator.capacity} bytes"
            )
        return self.allocator.try_alloc(size)

    async def alloc(self, size: int, timeout: float = math.inf) -> int:
        """Wait for room; raise PoolTooSmall at once, trio.TooSlowError after ``timeout``."""
        with trio.fail_after(timeout):
            while True:
                off = self.try_alloc(size)
                if off is not None:
                    return off
                self.waiters += 1
                try:
                    await self._freed.wait()
                finally:
                    self.waiters -= 1

    def free(self, offset: int) -> None:
        self.allocator.free(offset)
        self._freed.set()
        self._freed = trio.Event()

    def close(self) -> None:
        self.segment.close()
