"""Reading a text file an operator named (a config, a profile, a trace) without trusting it.

``Path.read_text`` reads whatever the path is until it ends: ``--config /dev/zero`` never
returns and grows without bound, a FIFO blocks forever, and a binary file fails deep inside a
decoder with a traceback. Here the path must be a regular file under a size cap, and every way
it can be unusable is one exception with a sentence an operator can act on."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from xdc.errors import ConfigurationError

# far above any config, profile or trace slice xdc ships, far below what hurts a daemon
MAX_TEXT_BYTES = 256 << 20


class UnreadableFile(ConfigurationError):
    """The file cannot be used as text; ``str(e)`` ("cannot read: ...") says why, without
    the path."""


def read_text_file(path: str | Path, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the regular file at ``path`` (at most ``limit`` bytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except FileNotFoundError:
        raise UnreadableFile("cannot read: not found") from None
    except OSError as e:
        raise UnreadableFile(f"cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise UnreadableFile(f"cannot read: {kind}")
        if st.st_size > limit:
            raise UnreadableFile(f"cannot read: {st.st_size} bytes, over the {limit}-byte limit")
        chunks = []
        got = 0
        while got <= limit:  # the size can change under us: the cap holds whatever it says
            piece = os.read(fd, min(1 << 20, limit + 1 - got))
            if not piece:
                break
            chunks.append(piece)
            got += len(piece)
    except OSError as e:
        raise UnreadableFile(f"cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise UnreadableFile(f"cannot read: over the {limit}-byte limit")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"cannot read: not UTF-8 text (byte {e.start})") from None
