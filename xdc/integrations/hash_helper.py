"""A hash helper process: checks blocks of a shared-memory pool against expected xxh3-64s.

Started by ``hash_helpers.HashHelpers`` with one end of a socketpair. It maps the named pool
segments read-only (the two most recent), answers one check at a time, and exits when its
channel ends: its parent exited, closed it, or died. It imports neither torch nor vLLM, so
it starts in a fraction of a second and holds a GIL of its own while it hashes.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import sys
from collections import OrderedDict

import xxhash

from xdc.integrations.hash_frames import FrameReader, frame
from xdc.transport.shm import SHM_DIR

KEEP_MAPPINGS = 2  # a receiver that restarted has a new pool; the old one is let go


class _Mappings:
    """The pools this helper has mapped, by name, most recent last."""

    def __init__(self) -> None:
        self._maps: OrderedDict[str, tuple[mmap.mmap, memoryview]] = OrderedDict()

    def get(self, name: str) -> memoryview:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad shared memory name {name!r}")
        if name in self._maps:
            self._maps.move_to_end(name)
            return self._maps[name][1]
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[name] = (m, memoryview(m))
        while len(self._maps) > KEEP_MAPPINGS:
            _, (old, view) = self._maps.popitem(last=False)
            view.release()
            old.close()
        return self._maps[name][1]


def first_mismatch(
    view: memoryview, offset: int, bb: int, positions: bytes, expected: bytes
) -> int:
    """The index (into ``positions``) of the first block at ``offset + pos * bb`` whose
    xxh3-64 is not the expected one, or -1."""
    pos = memoryview(positions).cast("q")
    want = memoryview(expected).cast("Q")
    if len(pos) != len(want) or bb <= 0 or offset < 0:
        raise ValueError("positions and expected digests differ in number, or bad geometry")
    for k in range(len(pos)):
        start = offset + pos[k] * bb
        if pos[k] < 0 or start + bb > len(view):
            raise ValueError(f"block at {start} lies outside the pool")
        if xxhash.xxh3_64_intdigest(view[start : start + bb]) != want[k]:
            return k
    return -1


def serve(sock: socket.socket) -> int:
    maps = _Mappings()
    reader = FrameReader()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return 0
        for msg in reader.feed(data):
            ident = msg[0]
            try:
                name, offset, bb, positions, expected = msg[1:6]
                result = first_mismatch(maps.get(name), offset, bb, positions, expected)
                reply = [ident, result, ""]
            except (OSError, ValueError, TypeError, IndexError) as e:
                reply = [ident, -2, f"{type(e).__name__}: {e}"]
            sock.sendall(frame(reply))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="xdc hash helper (started by a GPU decode engine)")
    ap.add_argument("--fd", type=int, required=True, help="its end of the parent's socketpair")
    args = ap.parse_args(argv)
    with socket.socket(fileno=args.fd) as sock:
        try:
            return serve(sock)
        except (ConnectionError, ValueError):
            return 1  # the parent is gone, or sent what is not a frame: nothing to answer


if __name__ == "__main__":
    sys.exit(main())
