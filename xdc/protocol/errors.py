"""Error codes shared by the wire (ERROR frames) and the in-process exception.

One enum serves both so a code raised locally is exactly the number the peer sees; the
values are part of wire protocol v1 and must never be renumbered.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    MALFORMED = 1
    VERSION = 2
    LIMIT = 3
    UNKNOWN_REQUEST = 4
    OUT_OF_ORDER = 5
    NO_SPACE = 6
    DUPLICATE_REQUEST = 7
    DEADLINE = 8
    CANCELLED = 9
    INTERNAL = 10
    TOO_BUSY = 11
    CHECKSUM = 12
    PEER_GONE = 13
    LAYOUT_MISMATCH = 14  # the decode engine expects KV of another model, dtype or layout


class ProtocolError(Exception):
    """A protocol violation, carrying what the I/O layer needs to answer with an ERROR frame.

    ``rid`` is None for connection-scoped problems (answer ``ERROR(code, msg, nil)`` and close)
    and names the request for request-scoped ones (answer ``ERROR(code, msg, rid)``, keep the
    connection).
    """

    def __init__(self, code: ErrorCode, message: str, rid: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}" + (f" (rid={rid})" if rid is not None else ""))
        self.code = code
        self.message = message
        self.rid = rid
