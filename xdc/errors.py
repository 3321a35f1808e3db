"""One error tree and the result codes every part of xdc speaks.

:class:`ErrorCode` numbers the wire's ERROR frames (part of wire protocol v1: never
renumber). :class:`ResultCode` is the one enum for how anything an engine asked for turned
out: both daemons answer with it, the client library raises it, and every wire code has a
result code of the same name (:func:`result_of_wire`), so a receiver's refusal reaches the
prefill engine unchanged.

Every error xdc raises on purpose is an :class:`XdcError`, and its type says two things a
handler needs (as h11's LocalProtocolError / RemoteProtocolError do):

- **scope**: what is lost. ``CONFIGURATION``: what an operator or caller gave is wrong and
  nothing ran (fix the input; a command prints one line). ``CONNECTION``: a connection,
  socket or link is unusable (reconnect; its requests go elsewhere). ``REQUEST``: one request
  failed or was refused; the connection and the daemon go on.
- **origin**: who did it. ``LOCAL``: this process (its state, its limits, a bug).
  ``REMOTE``: the peer, the engine, the client or the router on the other side.

The branches: :class:`ConfigurationError`; :class:`LocalConnectionError` and
:class:`RemoteConnectionError`; :class:`LocalRequestError` and :class:`RemoteRequestError`.
Each module's own errors subclass one of them (and keep a standard base, e.g. ValueError,
where callers catch that). Every XdcError has ``code``, ``message`` and ``rid`` (None when
not about one request), so no handler needs ``getattr``.
"""

from __future__ import annotations

import enum
from typing import ClassVar


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


def result_of_wire(code: ErrorCode) -> ResultCode:
    """The result code of a wire error code: the one of the same name (every wire code has
    one; tests/protocol/test_errors.py checks it)."""
    return ResultCode(code.name)


class Scope(enum.StrEnum):
    CONFIGURATION = "configuration"
    CONNECTION = "connection"
    REQUEST = "request"


class Origin(enum.StrEnum):
    LOCAL = "local"
    REMOTE = "remote"


class XdcError(Exception):
    """Base of every error xdc raises on purpose (see the module doc)."""

    code: ErrorCode | ResultCode = ResultCode.FAILED
    message: str = ""
    rid: str | None = None
    scope: ClassVar[Scope] = Scope.REQUEST
    origin: ClassVar[Origin] = Origin.LOCAL

    def __str__(self) -> str:
        return super().__str__() or self.message


class ConfigurationError(XdcError):
    """What an operator or caller gave (a config, a profile, a trace, flags) cannot run."""

    scope = Scope.CONFIGURATION


class LocalConnectionError(XdcError):
    """A connection or link is unusable because of this side (no device, a stopped worker)."""

    scope = Scope.CONNECTION


class RemoteConnectionError(XdcError):
    """A connection or link is unusable because of the other side (it closed, went silent,
    refused our certificate, or broke its protocol)."""

    scope = Scope.CONNECTION
    origin = Origin.REMOTE


class LocalRequestError(XdcError):
    """One request cannot be served because of this side (its pool, its limits)."""


class RemoteRequestError(XdcError):
    """One request was refused or failed on the other side, or asked for what cannot be
    (a client's bad field, an engine's bad answer, a peer's refusal)."""

    origin = Origin.REMOTE


class ProtocolError(RemoteConnectionError):
    """A protocol violation, carrying what the I/O layer needs to answer with an ERROR frame.

    ``rid`` is None for connection-scoped problems (answer ``ERROR(code, msg, nil)`` and close)
    and names the request for request-scoped ones (answer ``ERROR(code, msg, rid)``, keep the
    connection): ``request_scoped`` says which. The peer broke the protocol: origin REMOTE.
    """

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str, rid: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}" + (f" (rid={rid})" if rid is not None else ""))
        self.code = code
        self.message = message
        self.rid = rid

    @property
    def request_scoped(self) -> bool:
        return self.rid is not None


class ControlError(RemoteConnectionError):
    """The engine control protocol was broken (a malformed message, a framing error) or its
    socket broke. ``id`` is the offending request's id when it had a usable one."""

    code: ResultCode

    def __init__(self, code: ResultCode, message: str, id: int | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.id = id


class StartupError(ConfigurationError):
    """A daemon cannot start as configured (its pool does not fit shared memory, another
    daemon holds its socket, its port is taken): a message for the operator, no traceback."""

    code: ResultCode

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.code = ResultCode.FAILED
        self.message = message


class TransferError(RemoteRequestError):
    """A request was refused or failed (by the daemon an engine asked, or the peer behind
    it); ``code`` says why (NO_SPACE, DEADLINE, ...), and ``rid`` which request when a call
    was about several."""

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
