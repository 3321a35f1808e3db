"""The engine control protocol, sans-IO: what an inference engine and its xdc daemon say to
each other over the daemon's Unix socket (KV bytes never travel here: they stay in shared
memory; these messages carry offsets and outcomes).

Framing: a 4-byte big-endian length, then one msgpack map. An engine sends *requests*
(``op`` plus fields; an ``id`` when it wants a reply, none for one-way hand-overs); the daemon
answers each request that has an id with a *reply* carrying the same id, and pushes *events*
(a request's outcome, an error for a one-way message) at any time.

Everything an engine sends is decoded here into a typed value, and everything that does not
decode (not msgpack, trailing bytes, a non-string key, an unknown field or op, a wrong type,
NaN, a negative or absurd number, an unprintable id) is a :class:`ControlError` with code
BAD_REQUEST (or BAD_OP) that the daemon answers on that connection alone. Daemons only ever
see values that passed these checks, so no input on the socket can reach them malformed.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import msgpack

from xdc.errors import ControlError, ErrorCode, ResultCode, result_of_wire

LEN: Final = struct.Struct("!I")
MAX_MESSAGE: Final = 4 * 1024 * 1024  # a BEGIN with 65,536 block hashes is ~600 KiB
MAX_RID: Final = 128
MAX_LAYOUT: Final = 512
MAX_REASON: Final = 1024
MAX_PEER: Final = 262
MAX_LAYERS: Final = 65536  # the daemon's own limit (limits.max_layers) is checked by it
MAX_HASHES: Final = 1 << 20
MAX_ALLOC_AHEAD: Final = 64
MAX_READERS: Final = 1024  # connections that share each request (an engine's ranks)
MAX_WAIT_S: Final = 86400.0
U63: Final = (1 << 63) - 1
U64: Final = (1 << 64) - 1


class Op(enum.StrEnum):
    HELLO = "hello"
    STATUS = "status"
    ADMIT = "admit"
    BEGIN = "begin"
    ALLOC = "alloc"
    READY = "ready"
    CANCEL = "cancel"
    AWAIT = "await"
    AWAIT_LAYER = "await_layer"
    LOOK = "look"
    RELEASE = "release"
    DISCARD = "discard"


SENDER_OPS: Final = frozenset(
    {Op.HELLO, Op.STATUS, Op.ADMIT, Op.BEGIN, Op.ALLOC, Op.READY, Op.CANCEL}
)
RECEIVER_OPS: Final = frozenset(
    {Op.HELLO, Op.STATUS, Op.AWAIT, Op.AWAIT_LAYER, Op.LOOK, Op.RELEASE, Op.DISCARD}
)
MAX_AWAIT_RIDS: Final = 1024


# --- requests (engine -> daemon) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineHello:
    """First call of a connection; ``layout`` (decode engines): the KV layout it accepts.
    ``pool_fd``: send the pool's descriptor over the socket (SCM_RIGHTS) right after the
    reply, so an engine of another uid (``node.allowed_uids``) maps a pool whose file it
    may not open (0600, the daemon's). ``readers`` (decode engines): how many of its
    connections read each request, one per tensor-parallel rank, when every rank holds the
    same bytes (MLA's latent): the receiver frees a request once all of them released it."""

    layout: str | None = None
    pool_fd: bool | None = None
    readers: int | None = None


@dataclass(frozen=True, slots=True)
class Status:
    pass


@dataclass(frozen=True, slots=True)
class Admit:
    """Would a request for ``peer`` (None: the sender's own receiver) be shipped now? Asked
    by a prefill engine's scheduler before it computes a request for a remote decode, so
    that one that can not hand over says so in its answer at once (the gateway then has the
    decode prefill by itself) instead of leaving the decode to wait out its arrival timeout.
    The reply: ``admitted``, and when not, a ``reason`` word and a ``why`` sentence."""

    peer: str | None = None


@dataclass(frozen=True, slots=True)
class BeginRequest:
    rid: str
    layer_sizes: tuple[int, ...]
    block_hashes: tuple[int, ...] = ()
    cached_blocks: int = 0
    deadline_s: float | None = None
    peer: str | None = None
    layout: str = ""


@dataclass(frozen=True, slots=True)
class Alloc:
    """Buffers for ``layers[0]`` (waited for: backpressure) and, if they fit right now, the
    rest (a look-ahead that saves round trips)."""

    rid: str
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Ready:
    """Bytes [0, upto) of the layer are final; None: all of it (the hand-over ends)."""

    rid: str
    layer: int
    upto: int | None = None


@dataclass(frozen=True, slots=True)
class CancelRequest:
    rid: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Await:
    """The next complete request (``rid`` None), that one, or (``rids``) the first of those;
    0 s only looks. A named request the receiver never heard of is UNKNOWN_REQUEST (TIMEOUT
    means it is arriving but not complete)."""

    rid: str | None
    timeout_s: float
    rids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AwaitLayer:
    rid: str
    layer: int
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Look:
    """Where each of ``rids`` stands, claiming nothing: a decode engine's scheduler asks
    before it gives a request KV blocks, so a request whose prefill is still queued or
    running elsewhere holds none. The reply: ``states``, one ``RxState`` value per rid
    (``allocating``, ``receiving``, ``complete``, ``claimed``, ``done``, ``failed``), or
    ``discarded`` (given up before it began) or ``unknown`` (never heard of, recently)."""

    rids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Release:
    rid: str


@dataclass(frozen=True, slots=True)
class Discard:
    """The decode engine will never use ``rid``: free it now, or refuse it when it comes."""

    rid: str


Request: TypeAlias = (
    EngineHello
    | Status
    | Admit
    | BeginRequest
    | Alloc
    | Ready
    | CancelRequest
    | Await
    | AwaitLayer
    | Look
    | Release
    | Discard
)


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded request and its id (None: one-way, answered only if it fails)."""

    id: int | None
    request: Request


# --- replies and events (daemon -> engine) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended, pushed to the prefill engine that began it."""

    rid: str
    ok: bool
    code: str
    error: str
    bytes: int
    elapsed_s: float
    tail_s: float | None
    resent_chunks: int


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """Where a received request's layers are in the receive pool (zero-copy views)."""

    rid: str
    offset: int
    layer_sizes: tuple[int, ...]
    layer_offsets: tuple[int, ...]
    block_hashes: tuple[int, ...]
    cached_blocks: int
    layout: str
    complete: bool
    transfer_s: float | None


# --- framing ---------------------------------------------------------------------------------


def frame(msg: Mapping[str, Any]) -> bytes:
    body: bytes = msgpack.packb(dict(msg), use_bin_type=True)
    if len(body) > MAX_MESSAGE:
        raise ControlError(ResultCode.LIMIT, f"control message of {len(body)} bytes > limit")
    return LEN.pack(len(body)) + body


class Framer:
    """Bytes in, message bodies out. A length over the limit is fatal for the connection
    (we cannot find the next frame), everything else is the decoder's business."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._buf += data

    def next_body(self) -> bytes | None:
        if len(self._buf) < LEN.size:
            return None
        (n,) = LEN.unpack_from(self._buf)
        if n > MAX_MESSAGE:
            raise ControlError(ResultCode.LIMIT, f"control message of {n} bytes > limit")
        if len(self._buf) < LEN.size + n:
            return None
        body = bytes(self._buf[LEN.size : LEN.size + n])
        del self._buf[: LEN.size + n]
        return body

    @property
    def pending(self) -> int:
        return len(self._buf)


def unpack_map(body: bytes) -> dict[str, Any]:
    """One msgpack map with string keys and nothing after it, or BAD_REQUEST."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ...)
        raise ControlError(
            ResultCode.BAD_REQUEST, f"not one msgpack message: {type(exc).__name__}: {exc}"[:300]
        ) from None
    if not isinstance(msg, dict):
        raise ControlError(ResultCode.BAD_REQUEST, "a control message must be a map")
    if not all(isinstance(k, str) for k in msg):
        raise ControlError(ResultCode.BAD_REQUEST, "control message keys must be strings")
    return msg


# --- decoding requests -----------------------------------------------------------------------


def _bad(msg: str, mid: int | None = None) -> ControlError:
    return ControlError(ResultCode.BAD_REQUEST, msg, mid)


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _bad(f"{what} must be an integer in {lo}..{hi}, got {_show(v)}")
    return v


def _number(v: Any, what: str, lo: float, hi: float) -> float:
    if type(v) not in (int, float) or not (lo <= v <= hi):  # NaN fails the range test
        raise _bad(f"{what} must be a number in {lo:g}..{hi:g}, got {_show(v)}")
    return float(v)


def _text(v: Any, what: str, lo: int, hi: int) -> str:
    if type(v) is not str or not lo <= len(v) <= hi:
        raise _bad(f"{what} must be a string of {lo}..{hi} characters, got {_show(v)}")
    if not v.isprintable():
        raise _bad(f"{what} must not contain control characters")
    return v


def _ints(v: Any, what: str, max_len: int, hi: int) -> tuple[int, ...]:
    if type(v) is not list or len(v) > max_len:
        raise _bad(f"{what} must be a list of at most {max_len} integers")
    if not all(type(x) is int and 0 <= x <= hi for x in v):
        raise _bad(f"{what} must hold integers in 0..{hi}")
    return tuple(v)


def _show(v: Any) -> str:
    return f"{type(v).__name__} {v!r:.40}"


def check_rid(v: Any) -> str:
    return _text(v, "rid", 1, MAX_RID)


def check_layout(v: Any) -> str:
    return _text(v, "layout", 1, MAX_LAYOUT)


def check_timeout(v: Any) -> float:
    """Every wait is bounded: 0 only looks, at most a day."""
    return _number(v, "timeout_s", 0.0, MAX_WAIT_S)


def check_peer(v: Any) -> str:
    peer = _text(v, "peer", 3, MAX_PEER)
    host, sep, port = peer.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _bad(f"peer must be HOST:PORT, got {peer!r:.60}")
    return peer


_FIELDS: Final[dict[Op, frozenset[str]]] = {
    Op.HELLO: frozenset({"layout", "pool_fd", "readers"}),
    Op.STATUS: frozenset(),
    Op.ADMIT: frozenset({"peer"}),
    Op.BEGIN: frozenset(
        {"rid", "layer_sizes", "block_hashes", "cached_blocks", "deadline_s", "peer", "layout"}
    ),
    Op.ALLOC: frozenset({"rid", "layer", "layers"}),
    Op.READY: frozenset({"rid", "layer", "upto"}),
    Op.CANCEL: frozenset({"rid", "reason"}),
    Op.AWAIT: frozenset({"rid", "rids", "timeout_s"}),
    Op.AWAIT_LAYER: frozenset({"rid", "layer", "timeout_s"}),
    Op.LOOK: frozenset({"rids"}),
    Op.RELEASE: frozenset({"rid"}),
    Op.DISCARD: frozenset({"rid"}),
}
_REQUIRED: Final[dict[Op, frozenset[str]]] = {
    Op.BEGIN: frozenset({"rid", "layer_sizes"}),
    Op.ALLOC: frozenset({"rid"}),
    Op.READY: frozenset({"rid", "layer"}),
    Op.CANCEL: frozenset({"rid"}),
    Op.AWAIT: frozenset({"timeout_s"}),
    Op.AWAIT_LAYER: frozenset({"rid", "layer", "timeout_s"}),
    Op.LOOK: frozenset({"rids"}),
    Op.RELEASE: frozenset({"rid"}),
    Op.DISCARD: frozenset({"rid"}),
}


def decode_request(body: bytes, serves: frozenset[Op]) -> Envelope:
    """Decode one engine message for a daemon that serves ``serves``; ControlError (code
    BAD_REQUEST or BAD_OP, with the message's id when it had a usable one) otherwise."""
    msg = unpack_map(body)
    raw_id = msg.pop("id", None)
    mid = raw_id if type(raw_id) is int and 1 <= raw_id <= U63 else None
    if raw_id is not None and mid is None:
        raise _bad(f"id must be an integer in 1..{U63}, got {_show(raw_id)}")
    raw_op = msg.pop("op", None)
    try:
        op = Op(raw_op)
    except ValueError:
        raise ControlError(ResultCode.BAD_OP, f"unknown op {raw_op!r:.40}", mid) from None
    if op not in serves:
        raise ControlError(ResultCode.BAD_OP, f"op {op.value!r} is not served here", mid)
    fields = {k: v for k, v in msg.items() if v is not None}  # None = absent
    unknown = set(fields) - _FIELDS[op]
    if unknown:
        raise _bad(f"unknown field(s) for {op.value}: {', '.join(sorted(unknown))[:200]}", mid)
    missing = _REQUIRED.get(op, frozenset()) - set(fields)
    if missing:
        raise _bad(f"{op.value} needs {', '.join(sorted(missing))}", mid)
    try:
        return Envelope(mid, _build(op, fields))
    except ControlError as exc:
        raise ControlError(exc.code, exc.message, mid) from None


def _build(op: Op, f: dict[str, Any]) -> Request:
    if op is Op.HELLO:
        fd = f.get("pool_fd")
        if fd is not None and type(fd) is not bool:
            raise _bad(f"pool_fd must be a boolean, got {_show(fd)}")
        readers = f.get("readers")
        return EngineHello(
            check_layout(f["layout"]) if "layout" in f else None,
            fd,
            None if readers is None else _int(readers, "readers", 1, MAX_READERS),
        )
    if op is Op.STATUS:
        return Status()
    if op is Op.ADMIT:
        return Admit(check_peer(f["peer"]) if "peer" in f else None)
    if op is Op.BEGIN:
        sizes = _ints(f["layer_sizes"], "layer_sizes", MAX_LAYERS, U63)
        if not sizes:
            raise _bad("layer_sizes must not be empty")
        hashes = _ints(f.get("block_hashes", []), "block_hashes", MAX_HASHES, U64)
        cached = _int(f.get("cached_blocks", 0), "cached_blocks", 0, len(hashes))
        deadline = f.get("deadline_s")
        return BeginRequest(
            rid=check_rid(f["rid"]),
            layer_sizes=sizes,
            block_hashes=hashes,
            cached_blocks=cached,
            deadline_s=None if deadline is None else _positive(deadline, "deadline_s"),
            peer=check_peer(f["peer"]) if "peer" in f else None,
            layout=check_layout(f["layout"]) if f.get("layout") else "",
        )
    if op is Op.ALLOC:
        if "layers" in f:
            layers = _ints(f["layers"], "layers", MAX_ALLOC_AHEAD, MAX_LAYERS)
        elif "layer" in f:
            layers = (_int(f["layer"], "layer", 0, MAX_LAYERS),)
        else:
            raise _bad("alloc needs layers")
        if not layers:
            raise _bad("layers must not be empty")
        return Alloc(check_rid(f["rid"]), layers)
    if op is Op.READY:
        upto = f.get("upto")
        return Ready(
            check_rid(f["rid"]),
            _int(f["layer"], "layer", 0, MAX_LAYERS),
            None if upto is None else _int(upto, "upto", 0, U63),
        )
    if op is Op.CANCEL:
        reason = f.get("reason", "")
        if type(reason) is not str or len(reason) > MAX_REASON:
            raise _bad(f"reason must be a string of at most {MAX_REASON} characters")
        return CancelRequest(check_rid(f["rid"]), reason)
    if op is Op.AWAIT:
        rids: tuple[str, ...] = ()
        if "rids" in f:
            if "rid" in f:
                raise _bad("await takes rid or rids, not both")
            rids = _rids(f["rids"])
        rid = check_rid(f["rid"]) if "rid" in f else None
        return Await(rid, check_timeout(f["timeout_s"]), rids)
    if op is Op.LOOK:
        return Look(_rids(f["rids"]))
    if op is Op.AWAIT_LAYER:
        return AwaitLayer(
            check_rid(f["rid"]),
            _int(f["layer"], "layer", 0, MAX_LAYERS),
            check_timeout(f["timeout_s"]),
        )
    if op is Op.DISCARD:
        return Discard(check_rid(f["rid"]))
    assert op is Op.RELEASE
    return Release(check_rid(f["rid"]))


def _rids(raw: Any) -> tuple[str, ...]:
    if type(raw) is not list or not 1 <= len(raw) <= MAX_AWAIT_RIDS:
        raise _bad(f"rids must be a list of 1..{MAX_AWAIT_RIDS} request ids")
    return tuple(check_rid(r) for r in raw)


def _positive(v: Any, what: str) -> float:
    value = _number(v, what, 0.0, MAX_WAIT_S)
    if value <= 0:
        raise _bad(f"{what} must be > 0")
    return value


def encode_request(request: Request, mid: int | None) -> bytes:
    """The client side of :func:`decode_request` (None fields are left out)."""
    op = _OPS[type(request)]
    msg: dict[str, Any] = {"op": op.value}
    if mid is not None:
        msg["id"] = mid
    for name in request.__slots__:
        value = getattr(request, name)
        if value is None or (name == "layout" and value == "") or value == ():
            continue
        msg[name] = list(value) if isinstance(value, tuple) else value
    return frame(msg)


_OPS: Final[dict[type[Any], Op]] = {
    EngineHello: Op.HELLO,
    Status: Op.STATUS,
    Admit: Op.ADMIT,
    BeginRequest: Op.BEGIN,
    Alloc: Op.ALLOC,
    Ready: Op.READY,
    CancelRequest: Op.CANCEL,
    Await: Op.AWAIT,
    AwaitLayer: Op.AWAIT_LAYER,
    Look: Op.LOOK,
    Release: Op.RELEASE,
    Discard: Op.DISCARD,
}


# --- replies and events ----------------------------------------------------------------------


def reply(mid: int, **fields: Any) -> bytes:
    return frame({"id": mid, "ok": True, **fields})


def failure(mid: int | None, code: ResultCode, error: str, rid: str | None = None) -> bytes:
    """A refused or failed call; a one-way message's failure is pushed as an error event."""
    msg: dict[str, Any] = {"ok": False, "code": code.value, "error": error[:MAX_REASON]}
    if rid is not None or mid is None:
        msg["rid"] = rid  # which request it is about (an await over several names it)
    if mid is None:
        msg["event"] = "error"
    else:
        msg["id"] = mid
    return frame(msg)


def outcome_event(o: Outcome) -> bytes:
    return frame(
        {
            "event": "outcome",
            "rid": o.rid,
            "ok": o.ok,
            "code": o.code,
            "error": o.error[:MAX_REASON],
            "bytes": o.bytes,
            "elapsed_s": o.elapsed_s,
            "tail_s": o.tail_s,
            "resent_chunks": o.resent_chunks,
        }
    )


def request_info_fields(info: RequestInfo) -> dict[str, Any]:
    return {
        "rid": info.rid,
        "offset": info.offset,
        "layer_sizes": list(info.layer_sizes),
        "layer_offsets": list(info.layer_offsets),
        "block_hashes": list(info.block_hashes),
        "cached_blocks": info.cached_blocks,
        "layout": info.layout,
        "complete": info.complete,
        "transfer_s": info.transfer_s,
    }


# --- decoding on the engine side (a daemon's messages are checked too) ------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    id: int
    ok: bool
    code: ResultCode
    error: str
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    rid: str | None
    code: ResultCode
    error: str


Pushed: TypeAlias = Outcome | ErrorEvent


def decode_daemon_message(body: bytes) -> Reply | Pushed:
    """A daemon's reply or pushed event, checked enough that a broken daemon becomes a clear
    ControlError in the engine instead of a KeyError deep inside it."""
    msg = unpack_map(body)
    try:
        event = msg.get("event")
        if event == "outcome":
            tail = msg.get("tail_s")
            return Outcome(
                rid=check_rid(msg["rid"]),
                ok=bool(msg["ok"]),
                code=str(msg.get("code") or ""),
                error=str(msg.get("error") or ""),
                bytes=_int(msg.get("bytes", 0), "bytes", 0, U63),
                elapsed_s=_number(msg.get("elapsed_s", 0.0), "elapsed_s", 0.0, math.inf),
                tail_s=None if tail is None else _number(tail, "tail_s", 0.0, math.inf),
                resent_chunks=_int(msg.get("resent_chunks", 0), "resent_chunks", 0, U63),
            )
        if event == "error":
            rid = msg.get("rid")
            return ErrorEvent(
                None if rid is None else str(rid),
                result_code(msg.get("code")),
                str(msg.get("error", "")),
            )
        if event is not None:
            raise _bad(f"unknown event {event!r:.40}")
        mid = _int(msg.pop("id"), "id", 1, U63)
        ok = msg.pop("ok")
        if type(ok) is not bool:
            raise _bad("ok must be a boolean")
        code = ResultCode.OK if ok else result_code(msg.pop("code", None))
        error = str(msg.pop("error", "")) if not ok else ""
        return Reply(mid, ok, code, error, msg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ControlError(
            ResultCode.PROTOCOL, f"daemon sent a bad message: {exc!r:.200}"
        ) from None


def result_code(v: Any) -> ResultCode:
    """A code name from the wire, as the one enum (unknown names: FAILED)."""
    try:
        return ResultCode(v)
    except ValueError:
        return ResultCode.FAILED


def request_info(fields: Mapping[str, Any]) -> RequestInfo:
    try:
        sizes = _ints(fields["layer_sizes"], "layer_sizes", MAX_LAYERS, U63)
        offsets = _ints(fields["layer_offsets"], "layer_offsets", MAX_LAYERS, U63)
        if len(sizes) != len(offsets):
            raise _bad("layer_sizes and layer_offsets differ in length")
        transfer = fields.get("transfer_s")
        return RequestInfo(
            rid=check_rid(fields["rid"]),
            offset=_int(fields["offset"], "offset", 0, U63),
            layer_sizes=sizes,
            layer_offsets=offsets,
            block_hashes=_ints(fields.get("block_hashes", []), "block_hashes", MAX_HASHES, U64),
            cached_blocks=_int(fields.get("cached_blocks", 0), "cached_blocks", 0, U63),
            layout=str(fields.get("layout") or ""),
            complete=bool(fields.get("complete")),
            transfer_s=None if transfer is None else float(transfer),
        )
    except (KeyError, TypeError, ValueError, ControlError) as exc:
        raise ControlError(ResultCode.PROTOCOL, f"daemon sent a bad request info: {exc}") from None


def wire_result(code: int) -> ResultCode:
    """The one result code for an ERROR frame's wire code."""
    try:
        return result_of_wire(ErrorCode(code))
    except ValueError:
        return ResultCode.PROTOCOL
