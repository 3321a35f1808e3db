"""POSIX shared memory segments under /dev/shm, mapped with mmap.

Not ``multiprocessing.shared_memory``: on Python < 3.13 every process that *attaches* registers
the segment with its resource tracker, which unlinks it when that process exits, pulling the
pool out from under the daemon. Here only the creator owns (and unlinks) a segment.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")


class Segment:
    """A mapped segment; ``view`` is a writable memoryview over all of it."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if "/" in name or not name:
            raise ValueError(f"bad shared memory name {name!r}")
        self.name = name
        self.path = SHM_DIR / name
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.view = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, prefix: str = "xdc") -> Segment:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        return cls(name, 0, create=False)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Views handed out must be released first."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:
            # A numpy array or memoryview still exports the buffer; the mapping goes away
            # with the process. Unlinking below still frees the name.
            pass
        if self.owner:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_segments(prefix: str = "xdc") -> int:
    """How many xdc segments exist: tests compare it before and after to catch leaks."""
    return sum(1 for p in SHM_DIR.glob(f"{prefix}-*"))


def sweep_stale_segments(prefix: str = "xdc") -> list[str]:
    """Unlink segments left by xdc processes that died without cleaning up (SIGKILL, OOM).

    Segment names carry the creator's pid (``prefix-kind-PID-random``); a segment whose
    creator is gone can never be used again, so a daemon sweeps them when it starts.
    """
    removed = []
    for p in SHM_DIR.glob(f"{prefix}-*"):
        pid = next((int(part) for part in p.name.split("-") if part.isdigit()), None)
        if pid is None or pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
            removed.append(p.name)
        except PermissionError:
            pass  # alive, someone else's
    return removed
