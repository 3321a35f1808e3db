"""POSIX shared memory segments under /dev/shm, mapped with mmap.

Not ``multiprocessing.shared_memory``: on Python < 3.13 every process that *attaches* registers
the segment with its resource tracker, which unlinks it when that process exits, pulling the
pool out from under the daemon. Here only the creator owns (and unlinks) a segment.

Two things the creator does so that nothing is guessed later:

- **The pages are reserved at creation** (``posix_fallocate``). A sparse file larger than
  the free space of /dev/shm (Docker's default is 64 MiB) maps fine and then kills the
  process with SIGBUS the first time a page cannot be backed; reserving up front turns that
  into a clear error when the daemon starts.
- **The creator holds an exclusive ``flock`` on the segment for its whole life.** Whether a
  segment's owner is alive is then a question the kernel answers (the lock goes with the
  process, whatever PID namespace it ran in), instead of a guess from the PID in its name.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import time
from pathlib import Path

from xdc.errors import StartupError

SHM_DIR = Path("/dev/shm")
# a hidden (still being created) segment younger than this may not be locked yet
SWEEP_MIN_AGE_S = 10.0


class Segment:
    """A mapped segment; ``view`` is a writable memoryview over all of it."""

    def __init__(self, name: str, size: int, *, create: bool, fd: int | None = None) -> None:
        """``fd``: attach through this descriptor (passed by the daemon; taken over and
        closed) instead of opening the segment by name."""
        if "/" in name or not name:
            raise ValueError(f"bad shared memory name {name!r}")
        self.name = name
        self.path = SHM_DIR / name
        self.owner = create
        self._lock_fd: int | None = None
        if create:
            # Born under a hidden name, locked, then renamed into place: a sweeper never sees
            # a segment under its real name that its live owner has not locked yet.
            hidden = SHM_DIR / f".{name}"
            fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours, until we exit
                os.rename(hidden, self.path)
            except BaseException:
                os.close(fd)
                hidden.unlink(missing_ok=True)
                raise
        elif fd is None:
            fd = os.open(self.path, os.O_RDWR)
        try:
            if create:
                _reserve(fd, size, self.path)
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                self.path.unlink(missing_ok=True)
            raise
        if create:
            self._lock_fd = fd  # kept open: closing it would drop the owner's lock
        else:
            os.close(fd)
        self.view = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, prefix: str = "xdc") -> Segment:
        return cls(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    @classmethod
    def attach(cls, name: str, fd: int | None = None) -> Segment:
        return cls(name, 0, create=False, fd=fd)

    def open_descriptor(self) -> int:
        """A new descriptor of this segment, to pass to an engine over its socket. A new
        open, not a dup of ours: ours carries the owner's flock, which must not travel."""
        return os.open(self.path, os.O_RDWR | os.O_CLOEXEC)

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
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reserve(fd: int, size: int, path: Path) -> None:
    """Size the segment and back every page now, or say plainly why it cannot be."""
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise
        try:
            st = os.statvfs(path.parent)
            free = f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        raise StartupError(
            f"a shared-memory pool of {size / 2**20:.0f} MiB does not fit {path.parent} "
            f"({free}): lower the pool size (sender.pool_bytes / receiver.pool_bytes) or give "
            f"the host or container more shared memory (e.g. docker run --shm-size)"
        ) from None


def count_segments(prefix: str = "xdc") -> int:
    """How many xdc segments exist: tests compare it before and after to catch leaks."""
    return sum(1 for p in SHM_DIR.glob(f"{prefix}-*"))


def owner_alive(path: Path) -> bool:
    """Whether the process that created this segment still holds it (its flock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        return False  # nobody held it: its creator is gone (we drop the lock on close)
    finally:
        os.close(fd)


def sweep_stale_segments(prefix: str = "xdc") -> list[str]:
    """Unlink segments left by xdc processes that died without cleaning up (SIGKILL, OOM).

    A live owner holds its segment's lock, in whatever PID namespace it runs; a segment
    nobody holds can never be used again. A hidden one (its creator died between creating
    and renaming it) is swept only once it is old enough not to be mid-creation.
    """
    removed = []
    now = time.time()
    for p in [*SHM_DIR.glob(f"{prefix}-*"), *SHM_DIR.glob(f".{prefix}-*")]:
        if p.name.startswith("."):
            try:
                if now - p.stat().st_mtime < SWEEP_MIN_AGE_S:
                    continue
            except OSError:
                continue
        if not owner_alive(p):
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed
