"""One error hierarchy and the result codes every part of xdc speaks.

:class:`ErrorCode` numbers the wire's ERROR frames (part of wire protocol v1: never
renumber). :class:`ResultCode` is the one enum for how anything an engine asked for turned
out: both daemons answer with it, the client library raises it, and every wire code has a
result code of the same name, so a receiver's refusal reaches the prefill engine unchanged.

Every error xdc raises on purpose is an :class:`XdcError` with a ``code``:
``ProtocolError`` (a peer broke the wire protocol), ``ControlError`` (an engine or daemon
broke the control protocol, or its socket broke) and ``TransferError`` (a request was
refused or failed: the engine decides what to do, e.g. prefill locally).
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
    SESSION_OWNER = 15  # the HELLO's session is bound to another peer's identity


class ResultCode(enum.StrEnum):
    OK = "OK"
    TIMEOUT = "TIMEOUT"  # nothing happened in the time the caller gave
    BAD_REQUEST = "BAD_REQUEST"  # a malformed message or an argument out of range
    BAD_OP = "BAD_OP"  # an operation this daemon does not serve
    NOT_OWNER = "NOT_OWNER"  # the request belongs to (or is claimed by) someone else
    RELEASED = "RELEASED"  # the request was already released
    SHUTTING_DOWN = "SHUTTING_DOWN"  # refused: the daemon is draining
    SHUTDOWN = "SHUTDOWN"  # failed: the daemon stopped before it finished
    PEER_RESTARTED = "PEER_RESTARTED"  # the receiver restarted; its partial copy is gone
    ENGINE_GONE = "ENGINE_GONE"  # the prefill engine disconnected before handing it all over
    PROTOCOL = "PROTOCOL"  # a peer or daemon broke its protocol
    FAILED = "FAILED"  # failed for a reason this version has no name for
    # the wire's codes, by name
    MALFORMED = "MALFORMED"
    VERSION = "VERSION"
    LIMIT = "LIMIT"
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"
    OUT_OF_ORDER = "OUT_OF_ORDER"
    NO_SPACE = "NO_SPACE"
    DUPLICATE_REQUEST = "DUPLICATE_REQUEST"
    DEADLINE = "DEADLINE"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"
    TOO_BUSY = "TOO_BUSY"
    CHECKSUM = "CHECKSUM"
    PEER_GONE = "PEER_GONE"
    LAYOUT_MISMATCH = "LAYOUT_MISMATCH"
    SESSION_OWNER = "SESSION_OWNER"


class XdcError(Exception):
    """Base of every error xdc raises on purpose; ``code`` says which kind."""

    code: ErrorCode | ResultCode


class ProtocolError(XdcError):
    """A protocol violation, carrying what the I/O layer needs to answer with an ERROR frame.

    ``rid`` is None for connection-scoped problems (answer ``ERROR(code, msg, nil)`` and close)
    and names the request for request-scoped ones (answer ``ERROR(code, msg, rid)``, keep the
    connection).
    """

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str, rid: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}" + (f" (rid={rid})" if rid is not None else ""))
        self.code = code
        self.message = message
        self.rid = rid


class ControlError(XdcError):
    """The engine control protocol was broken (a malformed message, a framing error) or its
    socket broke. ``id`` is the offending request's id when it had a usable one."""

    code: ResultCode

    def __init__(self, code: ResultCode, message: str, id: int | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.id = id


class StartupError(XdcError):
    """A daemon cannot start as configured (its pool does not fit shared memory, another
    daemon holds its socket, its port is taken): a message for the operator, no traceback."""

    code: ResultCode

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = ResultCode.FAILED
        self.message = message


class TransferError(XdcError):
    """A request was refused or failed; ``code`` says why (NO_SPACE, DEADLINE, ...), and
    ``rid`` which request when a call was about several."""

    code: ResultCode

    def __init__(self, code: ResultCode | str, message: str, rid: str | None = None) -> None:
        code = code if isinstance(code, ResultCode) else _result(code)
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.rid = rid


def _result(name: str) -> ResultCode:
    try:
        return ResultCode(name)
    except ValueError:
        return ResultCode.FAILED
