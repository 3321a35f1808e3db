"""What a WRITE_WITH_IMM's 32 bits of immediate data mean, and which chunks get checksummed.

The receiver learns *which* chunk landed only from the immediate: a request slot (granted at
accept time, so a stale or foreign write names no live request) and the chunk's index on the
request's grid (layers laid end to end, ``chunk_bytes`` cells, last cell of a layer shorter;
``xdc.protocol.books.grid.ChunkGrid``, the same grid as the TCP path's).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImmCodec:
    # 10 bits of slot (1024 concurrent requests per QP) leave 22 bits of chunk index: 4 Mi
    # chunks, i.e. the 16 GiB request limit at the 4 KiB minimum chunk size.
    slot_bits: int = 10

    @property
    def max_slots(self) -> int:
        return 1 << self.slot_bits

    @property
    def max_chunks(self) -> int:
        return 1 << (32 - self.slot_bits)

    def encode(self, slot: int, index: int) -> int:
        if not 0 <= slot < self.max_slots or not 0 <= index < self.max_chunks:
            raise ValueError(f"slot {slot} / chunk {index} does not fit the immediate")
        return (slot << (32 - self.slot_bits)) | index

    def decode(self, imm: int) -> tuple[int, int]:
        if not 0 <= imm < 1 << 32:
            raise ValueError(f"immediate {imm} is not 32 bits")
        return imm >> (32 - self.slot_bits), imm & (self.max_chunks - 1)


def sampled(index: int, every: int, phase: int) -> bool:
    """Chunk ``index`` carries a checksum. A per-request random phase keeps a fixed pattern of
    bad chunks (say, always the first of a page) from hiding between samples forever."""
    return every > 0 and index % every == phase


def sum_slots(count: int, every: int) -> int:
    """Entries of a request's u64 checksum table (slot of chunk i is i // every)."""
    return 0 if every == 0 else -(-count // every)
