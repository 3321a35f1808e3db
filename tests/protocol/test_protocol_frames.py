"""The v1 codec: every frame round-trips, every prefix and header rule and limit is enforced."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from tests.protocol_fixtures import LIMITS
from xdc.protocol import (
    PREFIX,
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    End,
    Error,
    ErrorCode,
    Event,
    FrameType,
    Grant,
    Hello,
    LayerDone,
    Limits,
    Nack,
    Ping,
    Pong,
    ProtocolError,
    RdmaAnswer,
    RdmaClose,
    RdmaOffer,
    checksum,
    decode_header,
    encode,
    encode_chunk_header,
    validate_event,
)
from xdc.protocol.wire.frames import decode_prefix

U64 = (1 << 64) - 1

SAMPLES: list[Event] = [
    Hello(PROTOCOL_VERSION, "prefill-7", "sender", "s" * 64, 255),
    Hello(PROTOCOL_VERSION, "d" * 128, "receiver", "x", 0),
    Begin("req-1", (0, 5000, 1 << 30), 1 << 20, (1, U64, 0), 3, 30_000),
    Begin("r" * 128, (1,), 4096, (), 0, 1),
    Begin("req-2", (4096,), 4096, (), 0, 1, "model=m dtype=bfloat16 block=32 " + "x" * 480),
    Accept("req-1"),
    ChunkHeader("req-1", 1023, (1 << 34) * 3, 4 << 20, U64, False),
    ChunkHeader("req-2", 0, 0, 1, 0, True),
    Ack("req-1", 3, 1 << 20),
    Nack("req-1", 3, 0, "checksum mismatch"),
    Nack("req-1", 3, 0, "receiver busy", 60_000),
    LayerDone("req-1", 0),
    End("req-1"),
    Complete("req-1", 16 * 1024**3),
    Cancel("req-1", ""),
    Error(ErrorCode.DEADLINE, "too late", "req-1"),
    Error(999, "a code from a newer peer", None),
    Ping(0),
    Pong(U64),
    RdmaOffer("pd-a", b"q" * 1024),
    RdmaAnswer("", b"", "peer domain differs"),
    RdmaAnswer("pd-a", b"\x00", ""),
    RdmaAnswer("pd-a", b"\x00", "", 0xFFFFFF),
    Grant("req-1", b"g"),
    RdmaClose(0xFFFFFF, ""),
]


def _split(frame: bytes) -> tuple[int, bytes, int]:
    _, ftype, _, header_len, _, payload_len = PREFIX.unpack_from(frame)
    assert len(frame) == PREFIX.size + header_len
    return ftype, frame[PREFIX.size :], payload_len


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_frame_round_trips(event: Event) -> None:
    frame = encode_chunk_header(event) if isinstance(event, ChunkHeader) else encode(event)
    ftype, header, payload_len = _split(frame)
    assert decode_prefix(frame, LIMITS) == (ftype, len(header), payload_len)
    decoded = decode_header(ftype, header, LIMITS)
    assert decoded == event
    assert type(decoded) is type(event)
    validate_event(event, LIMITS)  # what we decode, we also agree to send


def test_a_chunk_from_a_sender_that_marks_no_copies_says_neither() -> None:
    """Five fields (a sender before copies were marked): ``copy`` is None, and a receiver's
    workers leave it to the books; a sixth field is a boolean or the frame is malformed."""
    assert _decode(4, ["r", 0, 0, 1, 9]) == ChunkHeader("r", 0, 0, 1, 9, None)
    assert _decode(4, ["r", 0, 0, 1, 9, True]) == ChunkHeader("r", 0, 0, 1, 9, True)
    for bad in (None, 0, 1, "yes", b"\x01", [True]):
        _expect(ErrorCode.MALFORMED, 4, ["r", 0, 0, 1, 9, bad])
    # what a sender sends carries the mark when it has one, and only then
    assert len(msgpack.unpackb(encode_chunk_header(ChunkHeader("r", 0, 0, 1, 9))[12:])) == 5
    assert (
        msgpack.unpackb(encode_chunk_header(ChunkHeader("r", 0, 0, 1, 9, False))[12:])[5] is False
    )


def test_prefix_layout_is_big_endian_12_bytes() -> None:
    hdr = ChunkHeader("r", 2, 4096, 0x010203, 7)
    frame = encode_chunk_header(hdr)
    assert PREFIX.size == 12
    assert frame[:2] == b"XD"
    assert frame[2] == 4
    assert FrameType.CHUNK.value == 4
    assert frame[3] == 0
    assert int.from_bytes(frame[4:6], "big") == len(frame) - 12
    assert frame[6:8] == b"\0\0"
    assert frame[8:12] == bytes([0, 1, 2, 3])  # payload_len = hdr.length
    assert msgpack.unpackb(frame[12:]) == ["r", 2, 4096, 0x010203, 7]


def test_encode_refuses_chunk_headers() -> None:
    with pytest.raises(TypeError):
        encode(ChunkHeader("r", 0, 0, 1, 0))


def test_begin_geometry() -> None:
    b = Begin("r", (10_000, 0, 4096, 1), 4096, (), 0, 1)
    assert b.total_bytes == 14_097
    assert b.layer_offsets == (0, 10_000, 10_000, 14_096)


def test_checksum_is_xxh3_of_a_view_without_copying() -> None:
    import numpy as np  # a dependency of xdc: always here

    arr = np.arange(1 << 16, dtype=np.float32)
    assert checksum(arr.data) == checksum(arr.tobytes())
    assert checksum(b"") == 0x2D06800538D394C2  # xxh3_64 of the empty string (reference value)
    assert checksum(b"a") != checksum(b"b")


# ---- prefix -----------------------------------------------------------------------------------


def _prefix(**kw: int | bytes) -> bytes:
    fields: dict[str, int | bytes] = dict(
        magic=b"XD", ftype=12, flags=0, header_len=2, reserved=0, payload_len=0
    )
    fields.update(kw)
    return PREFIX.pack(*fields.values())


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"magic": b"HT"}, ErrorCode.MALFORMED),
        ({"flags": 1}, ErrorCode.MALFORMED),
        ({"reserved": 0x100}, ErrorCode.MALFORMED),
        ({"ftype": 0}, ErrorCode.MALFORMED),
        ({"ftype": 19}, ErrorCode.MALFORMED),
        ({"header_len": 0}, ErrorCode.MALFORMED),
        ({"header_len": LIMITS.max_header_bytes + 1}, ErrorCode.LIMIT),
        ({"payload_len": 1}, ErrorCode.MALFORMED),  # payload on a PING
        ({"ftype": 4, "payload_len": 0}, ErrorCode.MALFORMED),  # CHUNK without payload
        ({"ftype": 4, "payload_len": LIMITS.max_chunk_bytes + 1}, ErrorCode.LIMIT),
    ],
)
def test_bad_prefix(fields: dict[str, int | bytes], code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as exc:
        decode_prefix(_prefix(**fields), LIMITS)
    assert exc.value.code == code
    assert exc.value.rid is None


def test_prefix_at_the_limits_is_accepted() -> None:
    assert decode_prefix(_prefix(header_len=LIMITS.max_header_bytes), LIMITS)[1] == 16384
    chunk = _prefix(ftype=4, payload_len=LIMITS.max_chunk_bytes)
    assert decode_prefix(chunk, LIMITS)[2] == LIMITS.max_chunk_bytes


# ---- header -----------------------------------------------------------------------------------


def _decode(ftype: int, fields: object) -> Event:
    return decode_header(ftype, msgpack.packb(fields, use_bin_type=True), LIMITS)


def _fields(event: Event) -> list[object]:
    return [getattr(event, f.name) for f in dataclasses.fields(event)]


def _expect(code: ErrorCode, ftype: int, fields: object) -> None:
    with pytest.raises(ProtocolError) as exc:
        _decode(ftype, fields)
    assert exc.value.code == code, exc.value


def _frame_type(event: Event) -> int:
    return {
        Hello: 1,
        Begin: 2,
        Accept: 3,
        ChunkHeader: 4,
        Ack: 5,
        Nack: 6,
        LayerDone: 7,
        End: 8,
        Complete: 9,
        Cancel: 10,
        Error: 11,
        Ping: 12,
        Pong: 13,
        RdmaOffer: 14,
        RdmaAnswer: 15,
        Grant: 16,
        RdmaClose: 17,
    }[type(event)]


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_wrong_arity(event: Event) -> None:
    fields = _fields(event)
    ftype = _frame_type(event)
    _expect(ErrorCode.MALFORMED, ftype, [*fields, 0])
    # a last field added later (BEGIN's layout, RDMA_ANSWER's offer_qp, NACK's
    # retry_after_ms, CHUNK's copy) is optional: one short is still that frame, two short is not
    optional_last = isinstance(event, Begin | RdmaAnswer | Nack | ChunkHeader)
    _expect(ErrorCode.MALFORMED, ftype, fields[:-2] if optional_last else fields[:-1])
    _expect(ErrorCode.MALFORMED, ftype, [])


@pytest.mark.parametrize("event", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_field_rejects_wrong_types(event: Event) -> None:
    """Swap each field for values of the wrong type: bool for int, bytes for str, etc."""
    fields = _fields(event)
    ftype = _frame_type(event)
    for i, value in enumerate(fields):
        if isinstance(value, bool):  # only CHUNK's copy is one
            assert ftype == FrameType.CHUNK and i == 5
            bad: list[object] = [0, 1, None, "true", b"\x01", [True]]
        elif isinstance(value, int):
            bad = [True, False, 1.0, "1", None, [1], -1]
        elif isinstance(value, str):
            bad = [value.encode(), 1, [value]]
            if not (ftype == FrameType.ERROR and i == 2):  # ERROR's rid may be nil
                bad.append(None)
        elif isinstance(value, bytes):
            bad = ["x", 1, None, [1]]
        elif isinstance(value, tuple):
            bad = [1, "x", None, [True], [-1], [1.5], {"a": 1}]
        else:  # Error.rid = None
            bad = [b"r", 1, ""]
        for b in bad:
            code = ErrorCode.MALFORMED
            if ftype == FrameType.HELLO and i == 0 and b == -1:
                code = ErrorCode.VERSION  # any other int version is a version mismatch
            _expect(code, ftype, [*fields[:i], b, *fields[i + 1 :]])


def test_header_must_be_one_whole_array() -> None:
    ping = msgpack.packb([5])
    for header in [
        msgpack.packb({"nonce": 5}),  # a map, not an array
        msgpack.packb(5),
        ping + b"\x00",  # trailing bytes inside the header
        ping[:-1] + b"\xcf",  # truncated uint64
        b"\x91\xc1",  # reserved msgpack byte
        b"\x91\xa1\xff",  # invalid UTF-8 in a str
        b"\x91\xd7\xff" + bytes(8),  # a timestamp ext
        b"\x91" * 3000 + b"\x01",  # absurd nesting
    ]:
        with pytest.raises(ProtocolError) as exc:
            decode_header(FrameType.PING, header, LIMITS)
        assert exc.value.code == ErrorCode.MALFORMED, header[:8]


def test_integers_must_be_unsigned_64() -> None:
    assert _decode(12, [U64]) == Ping(U64)
    _expect(ErrorCode.MALFORMED, 12, [-1])
    _expect(ErrorCode.MALFORMED, 12, [-(1 << 63)])
    # msgpack cannot carry more than 64 bits, so > u64 can only come from our own side
    for event in (Ping(U64 + 1), Ack("r", 0, U64 + 1), ChunkHeader("r", 0, 0, 1, 1 << 64)):
        with pytest.raises(ProtocolError) as exc:
            validate_event(event, LIMITS)
        assert exc.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize(
    ("ftype", "fields"),
    [
        (1, [PROTOCOL_VERSION, "", "sender", "s", 0]),  # empty peer_id
        (1, [PROTOCOL_VERSION, "p" * 129, "sender", "s", 0]),
        (1, [PROTOCOL_VERSION, "p", "sender", "s" * 65, 0]),
        (1, [PROTOCOL_VERSION, "p", "sender", "", 0]),
        (1, [PROTOCOL_VERSION, "p", "decoder", "s", 0]),  # unknown role
        (1, [PROTOCOL_VERSION, "p", "sender", "s", 256]),  # conn_index > 255
        (2, ["", [1], 4096, [], 0, 1]),  # empty rid
        (2, ["r" * 129, [1], 4096, [], 0, 1]),
        (2, ["r", [], 4096, [], 0, 1]),  # no layers
        (2, ["r", [0, 0], 4096, [], 0, 1]),  # no bytes
        (2, ["r", [1], 4095, [], 0, 1]),  # chunk_bytes below 4096
        (2, ["r", [1], 4096, [1, 2], 3, 1]),  # cached_blocks > len(block_hashes)
        (2, ["r", [1], 4096, [], 0, 0]),  # deadline_ms must be > 0
        (4, ["r", 0, 0, 0, 1]),  # zero-length chunk
        (9, ["r", 0]),  # COMPLETE of nothing
        (11, [1, "m" * 1025, None]),
        (6, ["r", 0, 0, "x" * 1025]),
        (6, ["r", 0, 0, "busy", 60_001]),  # "resend no sooner than" over a minute
        (10, ["r", "x" * 1025]),
        (11, [1, "m", ""]),  # empty rid is not nil
        (14, ["", b"q"]),  # an offer names its domain
        (14, ["d" * 65, b"q"]),
        (14, ["d", b""]),  # and carries QP info
        (14, ["d", b"q" * 1025]),
        (15, ["d", b"", ""]),  # a refusal says why
        (16, ["", b"g"]),
        (16, ["r", b""]),
        (17, [1, "x" * 1025]),
        (17, [0, "x"]),  # QP 0 is no queue pair of ours
        (17, [1 << 24, "x"]),
        (18, [""]),  # KEEP names a request
        (18, ["r\n"]),
    ],
)
def test_out_of_range_values_are_malformed(ftype: int, fields: list[object]) -> None:
    _expect(ErrorCode.MALFORMED, ftype, fields)


def test_hello_version_is_checked_before_the_rest() -> None:
    newer = PROTOCOL_VERSION + 1
    _expect(ErrorCode.VERSION, 1, [newer, "p", "sender", "s", 0])
    _expect(ErrorCode.VERSION, 1, [PROTOCOL_VERSION - 1, "p", "sender", "s", 0])
    _expect(ErrorCode.VERSION, 1, [0, "p", "sender", "s", 0])
    # a newer peer's HELLO may have a different shape; it still learns "wrong version"
    _expect(ErrorCode.VERSION, 1, [newer, "p", "sender", "s", 0, {"new": "field"}])
    with pytest.raises(ProtocolError) as exc:
        validate_event(Hello(newer, "p", "sender", "s", 0), LIMITS)
    assert exc.value.code == ErrorCode.VERSION


# ---- limits -----------------------------------------------------------------------------------

SMALL = Limits(
    max_header_bytes=512,
    max_chunk_bytes=8192,
    max_layers=4,
    max_request_bytes=100_000,
    max_block_hashes=3,
)


@pytest.mark.parametrize(
    ("ftype", "ok", "over"),
    [
        # layers
        (2, ["r", [1] * 4, 4096, [], 0, 1], ["r", [1] * 5, 4096, [], 0, 1]),
        # request bytes
        (2, ["r", [50_000, 50_000], 4096, [], 0, 1], ["r", [50_000, 50_001], 4096, [], 0, 1]),
        # chunk_bytes
        (2, ["r", [1], 8192, [], 0, 1], ["r", [1], 8193, [], 0, 1]),
        # block hashes
        (2, ["r", [1], 4096, [1, 2, 3], 3, 1], ["r", [1], 4096, [1, 2, 3, 4], 4, 1]),
        # layer index in every frame that names one
        (4, ["r", 3, 0, 1, 0], ["r", 4, 0, 1, 0]),
        (5, ["r", 3, 0], ["r", 4, 0]),
        (6, ["r", 3, 0, ""], ["r", 4, 0, ""]),
        (7, ["r", 3], ["r", 4]),
        # chunk length
        (4, ["r", 0, 0, 8192, 0], ["r", 0, 0, 8193, 0]),
        # COMPLETE total
        (9, ["r", 100_000], ["r", 100_001]),
    ],
)
def test_every_limit(ftype: int, ok: list[object], over: list[object]) -> None:
    decode_header(ftype, msgpack.packb(ok), SMALL)
    with pytest.raises(ProtocolError) as exc:
        decode_header(ftype, msgpack.packb(over), SMALL)
    assert exc.value.code == ErrorCode.LIMIT


def test_header_size_limit_both_ways() -> None:
    begin = Begin("r", (1,), 4096, tuple(range(1 << 40, (1 << 40) + 3)), 0, 1)
    big = Limits(max_header_bytes=32, max_block_hashes=3)
    header = encode(begin)[PREFIX.size :]
    assert len(header) > 32
    with pytest.raises(ProtocolError) as exc:
        decode_header(FrameType.BEGIN, header, big)
    assert exc.value.code == ErrorCode.LIMIT
    with pytest.raises(ProtocolError) as exc:
        validate_event(begin, big)
    assert exc.value.code == ErrorCode.LIMIT
    validate_event(begin, Limits(max_header_bytes=len(header), max_block_hashes=3))


def test_limits_mirror_config() -> None:
    from xdc.config import LimitsConfig

    assert LimitsConfig().limits() == Limits()
    assert Limits().max_chunk_bytes == 4 * 1024 * 1024
    assert Limits().max_request_bytes == 16 * 1024**3


def _begin_header(fields: list[object]) -> bytes:
    return bytes(msgpack.packb(fields, use_bin_type=True))


def test_a_nack_from_a_peer_without_retry_after_means_resend_at_once() -> None:
    header = bytes(msgpack.packb(["r", 2, 4096, "checksum mismatch"], use_bin_type=True))
    ev = decode_header(FrameType.NACK, header, LIMITS)
    assert ev == Nack("r", 2, 4096, "checksum mismatch", 0)


def test_a_begin_from_a_peer_without_the_layout_field_decodes_with_no_layout() -> None:
    ev = decode_header(FrameType.BEGIN, _begin_header(["r", [4096], 4096, [], 0, 10]), LIMITS)
    assert isinstance(ev, Begin) and ev.layout == ""


@pytest.mark.parametrize(
    "fields",
    [
        ["r", [4096], 4096, [], 0, 10, "x" * 513],  # layout over 512 characters
        ["r", [4096], 4096, [], 0, 10, "a\nb"],  # layout with a line break
        ["r", [4096], 4096, [], 0, 10, 7],  # layout not a string
        ["r", [4096], 4096, [], 0, 10, "", "extra"],  # 8 fields
        ["line\nbreak", [4096], 4096, [], 0, 10],  # rid that would forge a log line
        ["nul\x00", [4096], 4096, [], 0, 10],
        ["del\x7f", [4096], 4096, [], 0, 10],
    ],
)
def test_a_begin_with_a_bad_layout_or_an_unprintable_rid_is_malformed(fields: list[object]) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_header(FrameType.BEGIN, _begin_header(fields), LIMITS)
    assert e.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize(
    ("ftype", "fields"),
    [
        (1, [PROTOCOL_VERSION, "peer\n2026-11-27 rx WARNING forged", "sender", "s", 0]),
        (1, [PROTOCOL_VERSION, "p", "sender", "sess\r\x1b[2J", 0]),
        (14, ["dom\nain", b"q"]),
    ],
)
def test_peer_ids_sessions_and_domains_with_control_characters_are_malformed(
    ftype: int, fields: list[object]
) -> None:
    """They reach log lines as they are: a line break in one forged a log line."""
    _expect(ErrorCode.MALFORMED, ftype, fields)


@pytest.mark.parametrize(
    ("ftype", "fields", "attr"),
    [
        (10, ["r", "bye\n2026-11-27 rx INFO xdc.receiver: request r complete"], "reason"),
        (11, [3, "oops\r\nINFO forged\x00", None], "message"),
        (6, ["r", 0, 0, "bad\nline"], "reason"),
        (17, [1, "gone\n"], "reason"),
    ],
)
def test_free_text_from_a_peer_arrives_with_its_control_characters_escaped(
    ftype: int, fields: list[object], attr: str
) -> None:
    ev = _decode(ftype, fields)
    text = getattr(ev, attr)
    assert text.isprintable() and ("\\n" in text or "\\r" in text), text
