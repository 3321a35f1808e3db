"""First-fit range allocator over one contiguous pool, with coalescing on free.

Pure bookkeeping (no memory, no I/O): both daemons use it to carve request and layer buffers
out of one shared-memory segment, so the configured pool size is a hard bound on KV bytes held,
whatever the traffic does.
"""

from __future__ import annotations

import bisect


class Allocator:
    """Ranges are aligned to ``align`` bytes so numpy views of KV layers stay aligned."""

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if capacity <= 0 or align <= 0 or align & (align - 1):
            raise ValueError("capacity must be > 0 and align a power of two")
        self.capacity = capacity - capacity % align
        self.align = align
        # Free list as parallel sorted lists of (start, length), never adjacent (always merged).
        self._starts: list[int] = [0]
        self._lengths: list[int] = [self.capacity]
        self._used: dict[int, int] = {}
        self._used_bytes = 0  # kept, not summed: read after every free on the data path

    def rounded(self, size: int) -> int:
        return max(self.align, -(-size // self.align) * self.align)

    def fits_ever(self, size: int) -> bool:
        """Whether a request of this size could be served by an empty pool."""
        return self.rounded(size) <= self.capacity

    def try_alloc(self, size: int) -> int | None:
        need = self.rounded(size)
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i]
                    del self._lengths[i]
                else:
                    self._starts[i] = start + need
                    self._lengths[i] = length - need
                self._used[start] = need
                self._used_bytes += need
                return start
        return None

    def free(self, start: int) -> None:
        length = self._used.pop(start)  # KeyError on double free: a bug worth failing loudly on
        self._used_bytes -= length
        i = bisect.bisect_left(self._starts, start)
        # merge with the following free range
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths[i]
            del self._starts[i]
            del self._lengths[i]
        # merge with the preceding free range
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += length
            return
        self._starts.insert(i, start)
        self._lengths.insert(i, length)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    @property
    def allocations(self) -> int:
        return len(self._used)
