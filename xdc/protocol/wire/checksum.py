"""Chunk checksum: xxh3-64 (see docs/protocol.md for why not crc32c).

xxhash hashes through the buffer protocol, so a memoryview of a numpy array or of shared
memory is hashed where it lies, without a copy.
"""

from __future__ import annotations

import struct

import xxhash


def checksum(data: bytes | bytearray | memoryview) -> int:
    """Return the unsigned 64-bit xxh3 digest of ``data`` (must be C-contiguous)."""
    result: int = xxhash.xxh3_64_intdigest(data)
    return result


_IDENT = struct.Struct("!QQ")


def chunk_checksum(data: bytes | bytearray | memoryview, rid: str, layer: int, offset: int) -> int:
    """The CHUNK frame's checksum: xxh3-64 of the payload, seeded with the chunk's identity.

    Seeding binds the bytes to (rid, layer, offset), so a header corrupted into naming another
    cell of the same length, or a payload delivered under the wrong header, fails verification
    instead of landing in the wrong place with a "valid" checksum.
    """
    seed = xxhash.xxh3_64_intdigest(rid.encode() + _IDENT.pack(layer, offset))
    result: int = xxhash.xxh3_64_intdigest(data, seed=seed)
    return result
