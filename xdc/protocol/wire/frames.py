"""The v1 frame codec: a 12-byte prefix, a msgpack array header, and (CHUNK only) a payload.

Decoding is strict on purpose: a peer that sends a bool where an int belongs, a negative
offset or an extra field is buggy or hostile, and either way it is cheaper to drop the
connection than to reason about what it meant. Values bounded by :class:`Limits` fail with
``LIMIT`` (the peer may be configured differently), every other bad value with ``MALFORMED``.
The same checks run on the way out (:func:`validate_event`), so we never send a frame our
own decoder would reject.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack

from xdc.errors import ErrorCode, ProtocolError
from xdc.protocol.wire.events import (
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    End,
    Error,
    Event,
    Grant,
    Hello,
    Keep,
    LayerDone,
    Nack,
    Ping,
    Pong,
    RdmaAnswer,
    RdmaClose,
    RdmaOffer,
)
from xdc.protocol.wire.limits import Limits

# magic, frame type, flags, header_len, reserved, payload_len
PREFIX: Final = struct.Struct("!2sBBHHI")
MAGIC: Final = b"XD"
U64_MAX: Final = (1 << 64) - 1
MIN_CHUNK_BYTES: Final = 4096
MAX_RID_CHARS: Final = 128
MAX_LAYOUT_CHARS: Final = 512
MAX_PEER_ID_CHARS: Final = 128
MAX_SESSION_CHARS: Final = 64
MAX_TEXT_CHARS: Final = 1024  # ERROR message; also NACK and CANCEL reasons
ROLES: Final = ("sender", "receiver")
MAX_DOMAIN_CHARS: Final = 64
MAX_RETRY_AFTER_MS: Final = 60_000  # a NACK's longest "resend no sooner than"
MAX_RDMA_BLOB: Final = 1024  # an encoded QpInfo or SlotGrant (their codec's own bound)


class FrameType(enum.IntEnum):
    HELLO = 1
    BEGIN = 2
    ACCEPT = 3
    CHUNK = 4
    ACK = 5
    NACK = 6
    LAYER_DONE = 7
    END = 8
    COMPLETE = 9
    CANCEL = 10
    ERROR = 11
    PING = 12
    PONG = 13
    RDMA_OFFER = 14
    RDMA_ANSWER = 15
    GRANT = 16
    RDMA_CLOSE = 17
    KEEP = 18


EVENT_TYPES: Final[dict[type[Any], FrameType]] = {
    Hello: FrameType.HELLO,
    Begin: FrameType.BEGIN,
    Accept: FrameType.ACCEPT,
    ChunkHeader: FrameType.CHUNK,
    Ack: FrameType.ACK,
    Nack: FrameType.NACK,
    LayerDone: FrameType.LAYER_DONE,
    End: FrameType.END,
    Complete: FrameType.COMPLETE,
    Cancel: FrameType.CANCEL,
    Error: FrameType.ERROR,
    Ping: FrameType.PING,
    Pong: FrameType.PONG,
    RdmaOffer: FrameType.RDMA_OFFER,
    RdmaAnswer: FrameType.RDMA_ANSWER,
    Grant: FrameType.GRANT,
    RdmaClose: FrameType.RDMA_CLOSE,
    Keep: FrameType.KEEP,
}


def _field_getter(cls: type[Any]) -> Callable[[Any], tuple[Any, ...]]:
    names = tuple(f.name for f in dataclasses.fields(cls))
    return lambda event: tuple(getattr(event, name) for name in names)


_FIELDS: Final = {cls: _field_getter(cls) for cls in EVENT_TYPES}


def frame_type_of(event: Event) -> FrameType:
    try:
        return EVENT_TYPES[type(event)]
    except KeyError:
        raise TypeError(f"not a protocol event: {event!r}") from None


def header_fields(event: Event) -> tuple[Any, ...]:
    """The event's header array in wire order."""
    return _FIELDS[type(event)](event)


def _pack(fields: tuple[Any, ...]) -> bytes:
    try:
        packed: bytes = msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"cannot encode header: {exc}") from None
    return packed


def encode(event: Event) -> bytes:
    """Encode any non-CHUNK event as one complete frame. No validation: see validate_event."""
    ftype = frame_type_of(event)
    if ftype == FrameType.CHUNK:
        raise TypeError("CHUNK frames carry a payload: use encode_chunk_header")
    header = _pack(header_fields(event))
    return _prefix(ftype, len(header), 0) + header


def encode_chunk_header(hdr: ChunkHeader) -> bytes:
    """Prefix and header of a CHUNK; the caller sends the ``hdr.length`` payload bytes after."""
    fields: tuple[Any, ...] = (hdr.rid, hdr.layer, hdr.offset, hdr.length, hdr.checksum)
    if hdr.copy is not None:
        fields += (hdr.copy,)
    header = _pack(fields)
    return _prefix(FrameType.CHUNK, len(header), hdr.length) + header


def _prefix(ftype: FrameType, header_len: int, payload_len: int) -> bytes:
    if header_len > 0xFFFF:
        raise ProtocolError(ErrorCode.LIMIT, f"{ftype.name} header {header_len} bytes > 65535")
    if type(payload_len) is not int or not 0 <= payload_len <= 0xFFFFFFFF:
        raise ProtocolError(ErrorCode.LIMIT, f"payload length {payload_len!r:.40} not a u32")
    return PREFIX.pack(MAGIC, ftype, 0, header_len, 0, payload_len)


def decode_prefix(prefix: bytes | bytearray | memoryview, limits: Limits) -> tuple[int, int, int]:
    """Validate a 12-byte prefix; return (frame_type, header_len, payload_len)."""
    magic, ftype, flags, header_len, reserved, payload_len = PREFIX.unpack_from(prefix)
    return check_prefix(magic, ftype, flags, header_len, reserved, payload_len, limits)


def check_prefix(
    magic: bytes,
    ftype: int,
    flags: int,
    header_len: int,
    reserved: int,
    payload_len: int,
    limits: Limits,
) -> tuple[int, int, int]:
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.MALFORMED, f"bad magic {magic!r}")
    if ftype not in _BUILDERS:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown frame type {ftype}")
    if flags or reserved:
        raise ProtocolError(ErrorCode.MALFORMED, "nonzero flags/reserved in v1 prefix")
    if header_len == 0:
        raise ProtocolError(ErrorCode.MALFORMED, "empty header")
    if header_len > limits.max_header_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"header {header_len} bytes > limit {limits.max_header_bytes}"
        )
    if ftype == FrameType.CHUNK:
        if payload_len == 0:
            raise ProtocolError(ErrorCode.MALFORMED, "CHUNK without payload")
        if payload_len > limits.max_chunk_bytes:
            raise ProtocolError(
                ErrorCode.LIMIT, f"payload {payload_len} bytes > limit {limits.max_chunk_bytes}"
            )
    elif payload_len:
        raise ProtocolError(
            ErrorCode.MALFORMED, f"payload on non-CHUNK frame {FrameType(ftype).name}"
        )
    return ftype, header_len, payload_len


def decode_header(
    frame_type: int, header_bytes: bytes | bytearray | memoryview, limits: Limits
) -> Event:
    """Decode and fully validate one frame header (the msgpack array after the prefix)."""
    builder = _BUILDERS.get(frame_type)
    if builder is None:
        raise ProtocolError(ErrorCode.MALFORMED, f"unknown frame type {frame_type}")
    size = len(header_bytes)
    if size == 0:
        raise ProtocolError(ErrorCode.MALFORMED, "empty header")
    if size > limits.max_header_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"header {size} bytes > limit {limits.max_header_bytes}"
        )
    try:
        fields = msgpack.unpackb(header_bytes, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises a zoo of types for bad input; all mean MALFORMED
        raise ProtocolError(
            ErrorCode.MALFORMED, f"undecodable header: {type(exc).__name__}: {exc}"
        ) from None
    if type(fields) is not list:
        raise ProtocolError(ErrorCode.MALFORMED, "header is not a msgpack array")
    return builder(fields, limits)


def validate_event(event: Event, limits: Limits) -> None:
    """Apply the decoder's checks to an outgoing event, including the encoded header size."""
    if type(event) is ChunkHeader:
        encode_chunk_header_checked(event, limits)
    else:
        encode_checked(event, limits)


def encode_checked(event: Event, limits: Limits) -> bytes:
    """:func:`encode` after the checks the peer's decoder will apply (raises ProtocolError)."""
    ftype = frame_type_of(event)
    if ftype == FrameType.CHUNK:
        raise TypeError("CHUNK frames carry a payload: use encode_chunk_header")
    fields = header_fields(event)
    _BUILDERS[ftype](fields, limits)
    header = _pack(fields)
    _check_size(ftype, len(header), limits)
    return _prefix(ftype, len(header), 0) + header


# The free-text field of each frame type that has one: advisory words for a log, which a
# frame may lose the end of rather than not be sent at all (shorten_text_to_fit)
_TEXT_FIELD: Final[dict[type, str]] = {
    Error: "message",
    Nack: "reason",
    Cancel: "reason",
    RdmaAnswer: "reason",
    RdmaClose: "reason",
}
_ELLIPSIS: Final = "\u2026"


def cap_text(event: Event) -> Event:
    """``event`` with its free text cut to ``MAX_TEXT_CHARS`` characters (the last an
    ellipsis) if longer: the decoder refuses a longer text as malformed, and a daemon's reason
    may quote anything (an exception's words, a path), so the sender cuts it in one place
    instead of at each call site."""
    name = _TEXT_FIELD.get(type(event))
    if name is None:
        return event
    text = str(getattr(event, name))
    if len(text) <= MAX_TEXT_CHARS:
        return event
    kept = text[: MAX_TEXT_CHARS - len(_ELLIPSIS)] + _ELLIPSIS
    return dataclasses.replace(event, **{name: kept})  # type: ignore[arg-type]


def shorten_text_to_fit(event: Event, limits: Limits) -> Event | None:
    """``event`` with its free text cut short (ending in an ellipsis) so that its header fits
    ``limits.max_header_bytes``, or None if it has no such text or cutting it cannot make it
    fit. A peer may accept headers as small as 256 bytes, and a reason may be 1,024
    characters: an ERROR or NACK whose words are longer than the frame allows still says
    what it must (its code, its request), where refusing to encode it would drop the
    connection as a protocol error."""
    name = _TEXT_FIELD.get(type(event))
    if name is None:
        return None
    body = str(getattr(event, name)).encode()  # the part of the text kept, in UTF-8
    cut = False
    for _ in range(4):  # msgpack's string prefix may shrink too: converges in one or two
        over = len(_pack(header_fields(event))) - limits.max_header_bytes
        if over <= 0:
            return event
        keep = len(body) - over - (0 if cut else len(_ELLIPSIS.encode()))
        if keep <= 0:
            return None
        kept = body[:keep].decode(errors="ignore")  # never half a character
        body, cut = kept.encode(), True
        event = dataclasses.replace(event, **{name: kept + _ELLIPSIS})  # type: ignore[arg-type]
    return None


def encode_chunk_header_checked(hdr: ChunkHeader, limits: Limits) -> bytes:
    fields: tuple[Any, ...] = (hdr.rid, hdr.layer, hdr.offset, hdr.length, hdr.checksum)
    if hdr.copy is not None:
        fields += (hdr.copy,)
    _chunk(fields, limits)
    header = _pack(fields)
    _check_size(FrameType.CHUNK, len(header), limits)
    return _prefix(FrameType.CHUNK, len(header), hdr.length) + header


def _check_size(ftype: FrameType, size: int, limits: Limits) -> None:
    if size > limits.max_header_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"{ftype.name} header {size} bytes > limit {limits.max_header_bytes}"
        )


# ---- field checks ---------------------------------------------------------------------------


def _malformed(msg: str) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, msg)


def _arity(f: Sequence[Any], n: int, name: str) -> None:
    if len(f) != n:
        raise _malformed(f"{name} header has {len(f)} fields, expected {n}")


def _is_int(v: Any) -> bool:
    """An int but not a bool. Decoded values are exact ints; outgoing ones may be IntEnums."""
    return type(v) is int or (isinstance(v, int) and not isinstance(v, bool))


def _u64(v: Any, what: str) -> int:
    if not _is_int(v) or not 0 <= v <= U64_MAX:
        raise _malformed(f"{what}: expected an unsigned 64-bit int, got {v!r:.40}")
    return int(v)


def _text(v: Any, what: str, lo: int, hi: int) -> str:
    if not isinstance(v, str):
        raise _malformed(f"{what}: expected str, got {type(v).__name__}")
    if not lo <= len(v) <= hi:
        raise _malformed(f"{what}: length {len(v)} not in {lo}..{hi}")
    return str(v)


def _name(v: Any, what: str, lo: int, hi: int) -> str:
    """An identifier a daemon logs (peer id, session, RDMA domain): printable or malformed,
    like a rid, so a peer cannot forge or cut log lines with it."""
    name = _text(v, what, lo, hi)
    if not name.isprintable():
        raise _malformed(f"{what} {name!r:.60} has non-printable characters")
    return name


def _message(v: Any, what: str) -> str:
    """Free text from the peer (a reason, an error message): kept, but with every
    non-printable character escaped, so a line break in it cannot start a forged log line."""
    text = _text(v, what, 0, MAX_TEXT_CHARS)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)[:MAX_TEXT_CHARS]


def _rid(v: Any) -> str:
    rid = _text(v, "rid", 1, MAX_RID_CHARS)
    if not rid.isprintable():  # a newline or NUL in an id would forge or cut log lines
        raise _malformed(f"rid {rid!r:.60} has non-printable characters")
    return rid


def _layer(v: Any, limits: Limits) -> int:
    layer = _u64(v, "layer")
    if layer >= limits.max_layers:
        raise ProtocolError(ErrorCode.LIMIT, f"layer {layer} >= max_layers {limits.max_layers}")
    return layer


def _int_list(v: Any, what: str) -> list[int]:
    if type(v) is not list and type(v) is not tuple:
        raise _malformed(f"{what}: expected an array")
    if v and not (all(_is_int(x) for x in v) and min(v) >= 0 and max(v) <= U64_MAX):
        raise _malformed(f"{what}: every element must be an unsigned 64-bit int")
    return [int(x) for x in v]


# ---- per-frame builders ---------------------------------------------------------------------


def _hello(f: Sequence[Any], limits: Limits) -> Hello:
    # Version first, before arity: a newer peer's HELLO may carry more fields, and it should
    # learn "wrong version", not "malformed".
    if f and _is_int(f[0]) and f[0] != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION, f"peer speaks version {f[0]}, we speak {PROTOCOL_VERSION}"
        )
    _arity(f, 5, "HELLO")
    version = _u64(f[0], "version")
    role = _text(f[2], "role", 1, 16)
    if role not in ROLES:
        raise _malformed(f"role {role!r} is not 'sender' or 'receiver'")
    conn_index = _u64(f[4], "conn_index")
    if conn_index > 255:
        raise _malformed(f"conn_index {conn_index} > 255")
    return Hello(
        version=version,
        peer_id=_name(f[1], "peer_id", 1, MAX_PEER_ID_CHARS),
        role=role,
        session=_name(f[3], "session", 1, MAX_SESSION_CHARS),
        conn_index=conn_index,
    )


def _begin(f: Sequence[Any], limits: Limits) -> Begin:
    if len(f) != 6:  # the 7th field (layout) is optional: peers before it send 6
        _arity(f, 7, "BEGIN")
    rid = _rid(f[0])
    sizes = _int_list(f[1], "layer_sizes")
    if not sizes:
        raise _malformed("layer_sizes is empty")
    if len(sizes) > limits.max_layers:
        raise ProtocolError(
            ErrorCode.LIMIT, f"{len(sizes)} layers > max_layers {limits.max_layers}"
        )
    total = sum(sizes)
    if total == 0:
        raise _malformed("request has no bytes")
    if total > limits.max_request_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"request {total} bytes > max_request_bytes {limits.max_request_bytes}"
        )
    chunk_bytes = _u64(f[2], "chunk_bytes")
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise _malformed(f"chunk_bytes {chunk_bytes} < {MIN_CHUNK_BYTES}")
    if chunk_bytes > limits.max_chunk_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"chunk_bytes {chunk_bytes} > max_chunk_bytes {limits.max_chunk_bytes}"
        )
    hashes = _int_list(f[3], "block_hashes")
    if len(hashes) > limits.max_block_hashes:
        raise ProtocolError(
            ErrorCode.LIMIT,
            f"{len(hashes)} block hashes > max_block_hashes {limits.max_block_hashes}",
        )
    cached = _u64(f[4], "cached_blocks")
    if cached > len(hashes):
        raise _malformed(f"cached_blocks {cached} > {len(hashes)} block hashes")
    deadline_ms = _u64(f[5], "deadline_ms")
    if deadline_ms == 0:
        raise _malformed("deadline_ms must be > 0")
    layout = _text(f[6], "layout", 0, MAX_LAYOUT_CHARS) if len(f) == 7 else ""
    if not layout.isprintable():
        raise _malformed("layout has non-printable characters")
    return Begin(rid, tuple(sizes), chunk_bytes, tuple(hashes), cached, deadline_ms, layout)


def _accept(f: Sequence[Any], limits: Limits) -> Accept:
    _arity(f, 1, "ACCEPT")
    return Accept(_rid(f[0]))


def _chunk(f: Sequence[Any], limits: Limits) -> ChunkHeader:
    n = len(f)
    if n == 6 or n == 5:  # fast path for the hot frame; any doubt falls through to precise checks
        rid, layer, offset, length, digest = f[:5]
        copy = f[5] if n == 6 else None
        if (
            type(rid) is str
            and 0 < len(rid) <= MAX_RID_CHARS
            and type(layer) is int
            and 0 <= layer < limits.max_layers
            and type(offset) is int
            and 0 <= offset <= U64_MAX
            and type(length) is int
            and 0 < length <= limits.max_chunk_bytes
            and type(digest) is int
            and 0 <= digest <= U64_MAX
            and (n == 5 or type(copy) is bool)
        ):
            return ChunkHeader(rid, layer, offset, length, digest, copy)
    if n != 6:
        _arity(f, 5, "CHUNK")
    elif type(f[5]) is not bool:
        raise _malformed(f"CHUNK copy must be a boolean, got {f[5]!r:.40}")
    length = _u64(f[3], "length")
    if length == 0:
        raise _malformed("CHUNK length must be > 0")
    if length > limits.max_chunk_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"chunk {length} bytes > max_chunk_bytes {limits.max_chunk_bytes}"
        )
    return ChunkHeader(
        _rid(f[0]),
        _layer(f[1], limits),
        _u64(f[2], "offset"),
        length,
        _u64(f[4], "checksum"),
        f[5] if n == 6 else None,
    )


def _ack(f: Sequence[Any], limits: Limits) -> Ack:
    if len(f) == 3:  # fast path, as for CHUNK
        rid, layer, offset = f
        if (
            type(rid) is str
            and 0 < len(rid) <= MAX_RID_CHARS
            and type(layer) is int
            and 0 <= layer < limits.max_layers
            and type(offset) is int
            and 0 <= offset <= U64_MAX
        ):
            return Ack(rid, layer, offset)
    _arity(f, 3, "ACK")
    return Ack(_rid(f[0]), _layer(f[1], limits), _u64(f[2], "offset"))


def _nack(f: Sequence[Any], limits: Limits) -> Nack:
    if len(f) != 4:  # the 5th field (retry_after_ms) is optional: peers before it send 4
        _arity(f, 5, "NACK")
    retry = _u64(f[4], "retry_after_ms") if len(f) == 5 else 0
    if retry > MAX_RETRY_AFTER_MS:
        raise _malformed(f"NACK retry_after_ms {retry} > {MAX_RETRY_AFTER_MS}")
    return Nack(
        _rid(f[0]),
        _layer(f[1], limits),
        _u64(f[2], "offset"),
        _message(f[3], "reason"),
        retry,
    )


def _layer_done(f: Sequence[Any], limits: Limits) -> LayerDone:
    _arity(f, 2, "LAYER_DONE")
    return LayerDone(_rid(f[0]), _layer(f[1], limits))


def _end(f: Sequence[Any], limits: Limits) -> End:
    _arity(f, 1, "END")
    return End(_rid(f[0]))


def _keep(f: Sequence[Any], limits: Limits) -> Keep:
    _arity(f, 1, "KEEP")
    return Keep(_rid(f[0]))


def _complete(f: Sequence[Any], limits: Limits) -> Complete:
    _arity(f, 2, "COMPLETE")
    total = _u64(f[1], "total_bytes")
    if total == 0:
        raise _malformed("COMPLETE total_bytes must be > 0")
    if total > limits.max_request_bytes:
        raise ProtocolError(
            ErrorCode.LIMIT, f"total_bytes {total} > max_request_bytes {limits.max_request_bytes}"
        )
    return Complete(_rid(f[0]), total)


def _cancel(f: Sequence[Any], limits: Limits) -> Cancel:
    _arity(f, 2, "CANCEL")
    return Cancel(_rid(f[0]), _message(f[1], "reason"))


def _error(f: Sequence[Any], limits: Limits) -> Error:
    _arity(f, 3, "ERROR")
    rid = None if f[2] is None else _rid(f[2])
    return Error(_u64(f[0], "code"), _message(f[1], "message"), rid)


def _ping(f: Sequence[Any], limits: Limits) -> Ping:
    _arity(f, 1, "PING")
    return Ping(_u64(f[0], "nonce"))


def _pong(f: Sequence[Any], limits: Limits) -> Pong:
    _arity(f, 1, "PONG")
    return Pong(_u64(f[0], "nonce"))


def _blob(v: Any, what: str, lo: int) -> bytes:
    if type(v) is not bytes:
        raise _malformed(f"{what}: expected bin, got {type(v).__name__}")
    if not lo <= len(v) <= MAX_RDMA_BLOB:
        raise _malformed(f"{what}: {len(v)} bytes not in {lo}..{MAX_RDMA_BLOB}")
    return v


def _rdma_offer(f: Sequence[Any], limits: Limits) -> RdmaOffer:
    _arity(f, 2, "RDMA_OFFER")
    return RdmaOffer(_name(f[0], "domain", 1, MAX_DOMAIN_CHARS), _blob(f[1], "info", 1))


def _rdma_answer(f: Sequence[Any], limits: Limits) -> RdmaAnswer:
    if len(f) != 3:  # the 4th field (offer_qp) is optional: peers before it send 3
        _arity(f, 4, "RDMA_ANSWER")
    info = _blob(f[1], "info", 0)
    reason = _message(f[2], "reason")
    if not info and not reason:
        raise _malformed("RDMA_ANSWER refuses without a reason")
    offer_qp = _u64(f[3], "offer_qp") if len(f) == 4 else 0
    if offer_qp > 0xFFFFFF:
        raise _malformed(f"offer_qp {offer_qp} is not a 24-bit queue pair number")
    return RdmaAnswer(_name(f[0], "domain", 0, MAX_DOMAIN_CHARS), info, reason, offer_qp)


def _grant(f: Sequence[Any], limits: Limits) -> Grant:
    _arity(f, 2, "GRANT")
    return Grant(_rid(f[0]), _blob(f[1], "grant", 1))


def _rdma_close(f: Sequence[Any], limits: Limits) -> RdmaClose:
    _arity(f, 2, "RDMA_CLOSE")
    qp_num = _u64(f[0], "qp_num")
    if not 0 < qp_num < 1 << 24:
        raise _malformed(f"qp_num {qp_num} is not a 24-bit queue pair number")
    return RdmaClose(qp_num, _message(f[1], "reason"))


_BUILDERS: Final[dict[int, Callable[[Sequence[Any], Limits], Event]]] = {
    FrameType.HELLO: _hello,
    FrameType.BEGIN: _begin,
    FrameType.ACCEPT: _accept,
    FrameType.CHUNK: _chunk,
    FrameType.ACK: _ack,
    FrameType.NACK: _nack,
    FrameType.LAYER_DONE: _layer_done,
    FrameType.END: _end,
    FrameType.COMPLETE: _complete,
    FrameType.CANCEL: _cancel,
    FrameType.ERROR: _error,
    FrameType.PING: _ping,
    FrameType.PONG: _pong,
    FrameType.RDMA_OFFER: _rdma_offer,
    FrameType.RDMA_ANSWER: _rdma_answer,
    FrameType.GRANT: _grant,
    FrameType.RDMA_CLOSE: _rdma_close,
    FrameType.KEEP: _keep,
}
