"""The connection state machine: handshake, direction, EOF, payload handling, sticky errors."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from tests.protocol_fixtures import (
    LIMITS,
    RECEIVER_HELLO,
    SENDER_HELLO,
    chunk_frame,
    drain,
    open_receiver,
    open_sender,
    raw,
    raw_frame,
)
from xdc.protocol import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    PREFIX,
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    Connection,
    End,
    Error,
    ErrorCode,
    Event,
    FrameType,
    Grant,
    Hello,
    Keep,
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
    encode,
    encode_chunk_header,
)
from xdc.protocol.wire.frames import MAX_TEXT_CHARS

BEGIN = Begin("req-1", (8192, 5000), 4096, (1, 2), 1, 5000)
ONE_OF_EACH: dict[FrameType, Event] = {
    FrameType.HELLO: SENDER_HELLO,
    FrameType.BEGIN: BEGIN,
    FrameType.ACCEPT: Accept("req-1"),
    FrameType.CHUNK: ChunkHeader("req-1", 0, 0, 4, checksum(b"abcd")),
    FrameType.ACK: Ack("req-1", 0, 0),
    FrameType.NACK: Nack("req-1", 0, 0, "checksum"),
    FrameType.LAYER_DONE: LayerDone("req-1", 0),
    FrameType.END: End("req-1"),
    FrameType.KEEP: Keep("req-1"),
    FrameType.COMPLETE: Complete("req-1", 13192),
    FrameType.CANCEL: Cancel("req-1", "user"),
    FrameType.ERROR: Error(ErrorCode.INTERNAL, "boom", None),
    FrameType.PING: Ping(7),
    FrameType.PONG: Pong(7),
    FrameType.RDMA_OFFER: RdmaOffer("pd-a", b"qp"),
    FrameType.RDMA_ANSWER: RdmaAnswer("pd-a", b"qp", ""),
    FrameType.GRANT: Grant("req-1", b"grant"),
    FrameType.RDMA_CLOSE: RdmaClose(0x12, "stall"),
}
SENDER_MAY = {1, 2, 4, 8, 10, 11, 12, 13, 14, 17, 18}
RECEIVER_MAY = {1, 3, 5, 6, 7, 9, 10, 11, 12, 13, 15, 16, 17}


def _wire(event: Event) -> bytes:
    """The frame as its peer would put it on the wire (CHUNK with its 4-byte payload)."""
    if isinstance(event, ChunkHeader):
        return encode_chunk_header(event) + b"abcd"
    return encode(event)


def _raises(conn: Connection, code: ErrorCode) -> ProtocolError:
    with pytest.raises(ProtocolError) as exc:
        conn.next_event()
    assert exc.value.code == code, exc.value
    return exc.value


# ---- handshake --------------------------------------------------------------------------------


def test_handshake_both_sides() -> None:
    sender = Connection("sender", LIMITS)
    receiver = Connection("receiver", LIMITS)
    assert sender.state == receiver.state == "handshake"
    assert sender.next_event() is NEED_DATA
    receiver.receive_data(sender.send(SENDER_HELLO))
    assert receiver.next_event() == SENDER_HELLO
    assert receiver.peer_hello == SENDER_HELLO
    assert receiver.state == "handshake"  # it has not answered yet
    sender.receive_data(receiver.send(RECEIVER_HELLO))
    assert receiver.state == "open"
    assert sender.state == "handshake"
    assert sender.next_event() == RECEIVER_HELLO
    assert sender.state == "open"
    assert sender.peer_hello == RECEIVER_HELLO


def test_sender_may_pipeline_after_its_hello() -> None:
    sender = Connection("sender", LIMITS)
    data = sender.send(SENDER_HELLO) + sender.send(BEGIN) + sender.send(Ping(1))
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(data)
    assert [receiver.next_event() for _ in range(3)] == [SENDER_HELLO, BEGIN, Ping(1)]


def test_send_order_rules() -> None:
    sender = Connection("sender", LIMITS)
    for early in (BEGIN, Ping(1), End("r")):
        with pytest.raises(ProtocolError) as exc:
            sender.send(early)
        assert exc.value.code == ErrorCode.OUT_OF_ORDER
    with pytest.raises(ProtocolError) as exc:
        sender.send_chunk_header(ChunkHeader("r", 0, 0, 1, 0))
    assert exc.value.code == ErrorCode.OUT_OF_ORDER
    with pytest.raises(ProtocolError) as exc:
        sender.send(RECEIVER_HELLO)  # a HELLO claiming the wrong role
    assert exc.value.code == ErrorCode.MALFORMED
    with pytest.raises(ProtocolError) as exc:
        sender.send(Hello(PROTOCOL_VERSION + 1, "p", "sender", "s", 0))
    assert exc.value.code == ErrorCode.VERSION
    assert sender.state == "handshake"  # send-side misuse changes nothing
    sender.send(SENDER_HELLO)
    with pytest.raises(ProtocolError) as exc:
        sender.send(SENDER_HELLO)
    assert exc.value.code == ErrorCode.OUT_OF_ORDER

    receiver = Connection("receiver", LIMITS)
    with pytest.raises(ProtocolError) as exc:
        receiver.send(RECEIVER_HELLO)  # the sender speaks first
    assert exc.value.code == ErrorCode.OUT_OF_ORDER


def test_chunk_header_only_through_send_chunk_header() -> None:
    sender = open_sender()
    with pytest.raises(ProtocolError) as exc:
        sender.send(ChunkHeader("r", 0, 0, 1, 0))
    assert exc.value.code == ErrorCode.OUT_OF_ORDER
    hdr = ChunkHeader("r", 0, 4096, 10, 5)
    assert sender.send_chunk_header(hdr) == encode_chunk_header(hdr)
    with pytest.raises(ProtocolError) as exc:
        sender.send_chunk_header(ChunkHeader("r", 0, 0, 0, 0))
    assert exc.value.code == ErrorCode.MALFORMED


@pytest.mark.parametrize("first", [BEGIN, Ping(1), End("req-1")], ids=repr)
def test_first_frame_must_be_hello(first: Event) -> None:
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(encode(first))
    _raises(receiver, ErrorCode.OUT_OF_ORDER)


def test_second_hello_is_out_of_order() -> None:
    receiver = open_receiver()
    receiver.receive_data(encode(SENDER_HELLO))
    _raises(receiver, ErrorCode.OUT_OF_ORDER)


def test_version_mismatch() -> None:
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(raw(FrameType.HELLO, [PROTOCOL_VERSION + 1, "p", "sender", "s", 0]))
    err = _raises(receiver, ErrorCode.VERSION)
    assert err.rid is None
    assert receiver.peer_hello is None


def test_peer_must_have_the_other_role() -> None:
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(encode(RECEIVER_HELLO))
    _raises(receiver, ErrorCode.OUT_OF_ORDER)


def test_receiver_may_not_speak_first() -> None:
    sender = Connection("sender", LIMITS)
    sender.receive_data(encode(RECEIVER_HELLO))
    _raises(sender, ErrorCode.OUT_OF_ORDER)


def test_error_is_accepted_before_hello_so_a_rejecting_peer_can_say_why() -> None:
    sender = Connection("sender", LIMITS)
    sender.send(SENDER_HELLO)
    rejection = Error(ErrorCode.VERSION, "we speak v1 only", None)
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(raw(FrameType.HELLO, [9, "p", "sender", "s", 0]))
    _raises(receiver, ErrorCode.VERSION)
    sender.receive_data(receiver.send(rejection))  # allowed even in state "error"
    assert sender.next_event() == rejection
    assert sender.state == "handshake"
    with pytest.raises(ProtocolError) as exc:
        receiver.send(Ping(1))
    assert exc.value.code == ErrorCode.OUT_OF_ORDER


# ---- direction --------------------------------------------------------------------------------


@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
def test_direction_on_receive(ftype: FrameType) -> None:
    event = ONE_OF_EACH[ftype]
    if ftype == FrameType.HELLO:
        return  # covered by the handshake tests
    receiver = open_receiver()
    receiver.receive_data(_wire(event))
    if ftype in SENDER_MAY:
        assert receiver.next_event() == event
    else:
        _raises(receiver, ErrorCode.OUT_OF_ORDER)
    sender = open_sender()
    sender.receive_data(_wire(event))
    if ftype in RECEIVER_MAY:
        assert sender.next_event() == event
    else:
        _raises(sender, ErrorCode.OUT_OF_ORDER)


@pytest.mark.parametrize("ftype", list(FrameType), ids=lambda t: t.name)
def test_direction_on_send(ftype: FrameType) -> None:
    event = ONE_OF_EACH[ftype]
    if ftype in (FrameType.HELLO, FrameType.CHUNK):
        return  # covered above
    for conn, allowed in ((open_sender(), SENDER_MAY), (open_receiver(), RECEIVER_MAY)):
        if ftype in allowed:
            assert conn.send(event) == encode(event)
        else:
            with pytest.raises(ProtocolError) as exc:
                conn.send(event)
            assert exc.value.code == ErrorCode.OUT_OF_ORDER
    with pytest.raises(ProtocolError) as exc:
        open_receiver().send_chunk_header(ChunkHeader("r", 0, 0, 1, 0))
    assert exc.value.code == ErrorCode.OUT_OF_ORDER


# ---- framing through the connection -----------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (raw_frame(12, b"\x91\x01", magic=b"xd"), ErrorCode.MALFORMED),
        (raw_frame(12, b"\x91\x01", flags=1), ErrorCode.MALFORMED),
        (raw_frame(12, b"\x91\x01", 2) + b"zz", ErrorCode.MALFORMED),  # payload on PING
        (raw_frame(4, b"\x91\x01", LIMITS.max_chunk_bytes + 1), ErrorCode.LIMIT),
        (raw_frame(12, b"", header_len=LIMITS.max_header_bytes + 1), ErrorCode.LIMIT),
        (raw(4, ["req-1", 0, 0, 5, 0], 4) + b"abcd", ErrorCode.MALFORMED),  # length != payload
        (raw(12, [True]), ErrorCode.MALFORMED),
    ],
)
def test_bad_frames_after_handshake(frame: bytes, code: ErrorCode) -> None:
    receiver = open_receiver()
    receiver.receive_data(frame)
    _raises(receiver, code)


def test_bad_prefix_is_rejected_before_its_header_arrives() -> None:
    receiver = open_receiver()
    receiver.receive_data(raw_frame(12, b"", header_len=LIMITS.max_header_bytes + 1))
    _raises(receiver, ErrorCode.LIMIT)  # no need to wait for 16 KiB that will never parse


def test_error_state_is_sticky() -> None:
    receiver = open_receiver()
    receiver.receive_data(raw(5, ["r", 0, 0]))  # ACK from a sender
    first = _raises(receiver, ErrorCode.OUT_OF_ORDER)
    assert receiver.state == "error"
    receiver.receive_data(encode(Ping(1)) + encode(End("r")))
    for _ in range(3):
        again = _raises(receiver, ErrorCode.OUT_OF_ORDER)
        assert again.message == first.message
    receiver.receive_data(b"")
    _raises(receiver, ErrorCode.OUT_OF_ORDER)
    assert receiver.state == "error"
    assert receiver.send(Error(first.code, first.message, None)) == encode(
        Error(first.code, first.message, None)
    )


# ---- EOF --------------------------------------------------------------------------------------


def test_eof_at_a_boundary_is_closed() -> None:
    receiver = open_receiver()
    receiver.receive_data(encode(Ping(3)))
    receiver.receive_data(b"")
    assert receiver.next_event() == Ping(3)
    assert receiver.next_event() is CLOSED
    assert receiver.next_event() is CLOSED
    assert receiver.state == "closed"
    receiver.receive_data(b"")  # repeated EOF is harmless
    assert receiver.next_event() is CLOSED
    with pytest.raises(ProtocolError) as exc:
        receiver.receive_data(b"late")
    assert exc.value.code == ErrorCode.INTERNAL


def test_eof_during_handshake_is_closed() -> None:
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(b"")
    assert receiver.next_event() is CLOSED


@pytest.mark.parametrize("cut", [1, 11, 12, 13, 30])
def test_eof_mid_frame(cut: int) -> None:
    frame = chunk_frame("req-1", 0, 0, bytes(100))  # prefix 12, header ~13, payload 100
    assert len(frame) > 30 + 12
    receiver = open_receiver()
    receiver.receive_data(frame[:cut])
    receiver.receive_data(b"")
    err = _raises(receiver, ErrorCode.MALFORMED)
    assert err.message == "connection closed mid-frame"


def test_eof_mid_payload() -> None:
    frame = chunk_frame("req-1", 0, 0, bytes(100))
    receiver = open_receiver()
    receiver.receive_data(frame[:-10])
    assert isinstance(receiver.next_event(), ChunkHeader)
    assert receiver.next_event() is PAYLOAD
    receiver.receive_data(b"")
    err = _raises(receiver, ErrorCode.MALFORMED)
    assert err.message == "connection closed mid-frame"


def test_eof_after_a_fully_buffered_payload_is_clean() -> None:
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 0, 0, b"xyz"))
    receiver.receive_data(b"")
    assert isinstance(receiver.next_event(), ChunkHeader)
    assert receiver.next_event() is PAYLOAD
    dest = bytearray(3)
    assert receiver.take_buffered_payload(memoryview(dest)) == 3
    assert dest == b"xyz"
    assert receiver.next_event() is CLOSED


def test_eof_while_skipping() -> None:
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 0, 0, bytes(100))[:-50])
    assert isinstance(receiver.next_event(), ChunkHeader)
    receiver.skip_payload()
    assert receiver.next_event() is NEED_DATA
    receiver.receive_data(b"")
    _raises(receiver, ErrorCode.MALFORMED)


# ---- payload ----------------------------------------------------------------------------------


def test_take_buffered_payload_in_pieces_into_numpy() -> None:
    payload = bytes(range(256)) * 40
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 1, 4096, payload) + encode(End("req-1")))
    hdr = receiver.next_event()
    assert hdr == ChunkHeader("req-1", 1, 4096, len(payload), checksum(payload))
    assert receiver.payload_pending == len(payload)
    dest = np.zeros(len(payload), dtype=np.uint8)
    view = dest.data
    got = 0
    while got < len(payload):
        assert receiver.next_event() is PAYLOAD
        got += receiver.take_buffered_payload(view[got : got + 1000])
        assert receiver.payload_pending == len(payload) - got
    assert dest.tobytes() == payload
    assert receiver.take_buffered_payload(view) == 0
    assert receiver.next_event() == End("req-1")


def test_take_into_a_wider_typed_view() -> None:
    payload = bytes(range(64))
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 0, 0, payload))
    receiver.next_event()
    dest = np.zeros(16, dtype=np.float32)
    assert receiver.take_buffered_payload(dest.data) == 64
    assert dest.tobytes() == payload


def test_payload_consumed_for_bytes_received_in_place() -> None:
    """The I/O layer takes the buffered part, then recv_into's the rest itself."""
    payload = random.Random(1).randbytes(10_000)
    frame = chunk_frame("req-1", 0, 0, payload)
    split = len(frame) - len(payload) + 300  # the header's read also brought 300 payload bytes
    receiver = open_receiver()
    receiver.receive_data(frame[:split])
    assert isinstance(receiver.next_event(), ChunkHeader)
    dest = bytearray(len(payload))
    view = memoryview(dest)
    assert receiver.payload_buffered == 300
    with pytest.raises(ProtocolError) as exc:
        receiver.payload_consumed(1)  # bytes are still buffered: they come first
    assert exc.value.code == ErrorCode.INTERNAL
    assert receiver.state == "error"

    receiver = open_receiver()
    receiver.receive_data(frame[:split])
    receiver.next_event()
    n = receiver.take_buffered_payload(view)
    assert n == 300
    view[n:] = frame[split:]  # what recv_into would have written
    receiver.payload_consumed(len(payload) - n)
    assert receiver.payload_pending == 0
    assert dest == payload
    assert receiver.next_event() is NEED_DATA
    receiver.receive_data(encode(Ping(9)))
    assert receiver.next_event() == Ping(9)


def test_payload_consumed_beyond_pending_is_internal_and_sticky() -> None:
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 0, 0, bytes(10))[:-10])
    receiver.next_event()
    with pytest.raises(ProtocolError) as exc:
        receiver.payload_consumed(11)
    assert exc.value.code == ErrorCode.INTERNAL
    _raises(receiver, ErrorCode.INTERNAL)


def test_skip_payload_drops_buffered_and_future_bytes() -> None:
    payload = bytes(5000)
    frame = chunk_frame("req-1", 0, 0, payload)
    rest = frame[-4000:]
    receiver = open_receiver()
    receiver.receive_data(frame[:-4000])
    assert isinstance(receiver.next_event(), ChunkHeader)
    receiver.skip_payload()
    assert receiver.payload_pending == 0
    assert receiver.next_event() is NEED_DATA
    receiver.receive_data(rest[:1000])
    assert receiver.next_event() is NEED_DATA
    receiver.receive_data(rest[1000:] + encode(Ping(5)))  # the end of the skip and a frame
    assert receiver.next_event() == Ping(5)


def test_skip_payload_entirely_buffered() -> None:
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 0, 0, b"q" * 50) + encode(Ping(1)))
    receiver.next_event()
    receiver.skip_payload()
    assert receiver.next_event() == Ping(1)


def test_payload_looking_like_frames_is_not_parsed() -> None:
    inner = encode(Cancel("req-1", "fake")) * 3
    receiver = open_receiver()
    receiver.receive_data(chunk_frame("req-1", 0, 0, inner) + encode(Ping(2)))
    events = drain(receiver)
    assert events[1] == inner
    assert events[2:] == [Ping(2)]


# ---- split-invariance -------------------------------------------------------------------------


def _session_bytes() -> bytes:
    rng = random.Random(7)
    parts = [encode(SENDER_HELLO), encode(BEGIN)]
    for layer, offset, size in [(0, 0, 4096), (1, 4096, 904), (0, 4096, 4096), (1, 0, 4096)]:
        parts.append(chunk_frame("req-1", layer, offset, rng.randbytes(size)))
        parts.append(encode(Ping(layer * 10 + offset)))
    parts.append(encode(Cancel("req-1", "x" * 1000)))
    big = rng.randbytes(LIMITS.max_chunk_bytes)
    parts.append(chunk_frame("req-2", 3, 0, big))
    parts.append(encode(End("req-1")))
    return b"".join(parts)


def _events(pieces: list[bytes]) -> list[Event | bytes]:
    receiver = Connection("receiver", LIMITS)
    out: list[Event | bytes] = []
    for piece in pieces:
        receiver.receive_data(piece)
        got = drain(receiver)
        last, head = (out[-1], got[0]) if got and out else (None, None)
        if isinstance(last, bytes) and isinstance(head, bytes):
            out[-1] = last + head  # payload continued across reads
            got.pop(0)
        out += got
        if receiver.peer_hello is not None and receiver.state == "handshake":
            receiver.send(RECEIVER_HELLO)
    receiver.receive_data(b"")
    assert receiver.next_event() is CLOSED
    return out


def test_any_split_yields_identical_events() -> None:
    data = _session_bytes()
    whole = _events([data])
    assert len(whole) == 18
    assert whole[-1] == End("req-1")
    head = len(data) - LIMITS.max_chunk_bytes - 100  # byte at a time up to the big chunk
    one_by_one = [data[i : i + 1] for i in range(head)] + [data[head:]]
    assert _events(one_by_one) == whole
    rng = random.Random(3)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(data)), 200))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert _events(pieces) == whole


def test_receive_data_accepts_any_buffer() -> None:
    data = encode(SENDER_HELLO) + encode(Ping(1))
    arr = np.frombuffer(data + bytes(-len(data) % 4), dtype=np.uint32)
    receiver = Connection("receiver", LIMITS)
    receiver.receive_data(arr.data[: len(data) // 4])
    receiver.receive_data(bytearray(data[len(data) // 4 * 4 :]))
    assert receiver.next_event() == SENDER_HELLO
    receiver.send(RECEIVER_HELLO)
    assert receiver.next_event() == Ping(1)


def test_small_limits_apply_to_the_connection() -> None:
    tight = Limits(max_chunk_bytes=4096, max_layers=2)
    receiver = Connection("receiver", tight)
    receiver.receive_data(encode(SENDER_HELLO) + chunk_frame("r", 0, 0, bytes(4097)))
    assert receiver.next_event() == SENDER_HELLO
    _raises(receiver, ErrorCode.LIMIT)
    sender = Connection("sender", tight)
    sender.send(SENDER_HELLO)
    with pytest.raises(ProtocolError) as exc:
        sender.send(Begin("r", (1, 1, 1), 4096, (), 0, 1))
    assert exc.value.code == ErrorCode.LIMIT


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError):
        Connection("decoder", LIMITS)


# ---- free text under a small header limit ------------------------------------------------------

SMALL = Limits(max_header_bytes=256)
LONG_TEXT = ("a reason with accents: é, 漢字 " * 40)[:1000]


def _pair(limits: Limits) -> tuple[Connection, Connection]:
    sender, receiver = Connection("sender", limits), Connection("receiver", limits)
    receiver.receive_data(sender.send(SENDER_HELLO))
    assert receiver.next_event() == SENDER_HELLO
    sender.receive_data(receiver.send(RECEIVER_HELLO))
    assert sender.next_event() == RECEIVER_HELLO
    return sender, receiver


TEXT_FRAMES = [
    ("receiver", Error(ErrorCode.INTERNAL, LONG_TEXT, "req-1"), "message"),
    ("sender", Error(ErrorCode.LIMIT, LONG_TEXT, None), "message"),
    ("receiver", Nack("req-1", 3, 8192, LONG_TEXT, 250), "reason"),
    ("sender", Cancel("req-1", LONG_TEXT), "reason"),
    ("receiver", RdmaAnswer("pd-a", b"", LONG_TEXT, 7), "reason"),
    ("sender", RdmaClose(0x12, LONG_TEXT), "reason"),
]


def _frame_id(v: object) -> str:
    return v if isinstance(v, str) else type(v).__name__


@pytest.mark.parametrize(("side", "event", "field"), TEXT_FRAMES, ids=_frame_id)
def test_long_text_is_cut_to_the_header_limit_and_the_frame_still_goes(
    side: str, event: Event, field: str
) -> None:
    """A reason of up to 1,024 characters in a peer that accepts 256-byte headers: the frame
    goes with its text cut (whole characters, an ellipsis at the end) and every other field
    as it was, and the peer's decoder takes it; it used to be refused by our own encoder,
    which a daemon treats as a broken connection."""
    sender, receiver = _pair(SMALL)
    ours, peer = (sender, receiver) if side == "sender" else (receiver, sender)
    frame = ours.send(event)
    assert len(frame) <= PREFIX.size + SMALL.max_header_bytes
    peer.receive_data(frame)
    got = peer.next_event()
    assert type(got) is type(event)
    text = getattr(got, field)
    assert text.endswith("\u2026") and LONG_TEXT.startswith(text[:-1]) and len(text) > 100
    for name in event.__slots__:
        if name != field:
            assert getattr(got, name) == getattr(event, name), name
    # a short text is not touched
    short = dataclasses.replace(event, **{field: "short"})  # type: ignore[arg-type]
    peer.receive_data(ours.send(short))
    assert peer.next_event() == short


def test_a_frame_over_the_limit_without_text_to_cut_is_still_refused() -> None:
    """Cutting is for advisory words only: a BEGIN whose block hashes do not fit is LIMIT."""
    sender, _ = _pair(SMALL)
    begin = Begin("req-1", (8192,), 4096, tuple(range(1 << 40, (1 << 40) + 40)), 1, 8192)
    with pytest.raises(ProtocolError) as exc:
        sender.send(begin)
    assert exc.value.code == ErrorCode.LIMIT


@pytest.mark.parametrize(("side", "event", "field"), TEXT_FRAMES, ids=_frame_id)
def test_text_over_the_protocols_length_is_cut_to_it_and_the_frame_still_goes(
    side: str, event: Event, field: str
) -> None:
    """A reason longer than the protocol's MAX_TEXT_CHARS (an exception's words may be): the
    frame goes with its text cut to that many characters, the last an ellipsis, and the
    peer takes it; it used to be refused as malformed by our own encoder unless each call
    site cut it first. A text of exactly that length is not touched."""
    sender, receiver = _pair(LIMITS)
    ours, peer = (sender, receiver) if side == "sender" else (receiver, sender)
    long = ("é漢 " * 3000)[: MAX_TEXT_CHARS * 4]
    peer.receive_data(ours.send(dataclasses.replace(event, **{field: long})))  # type: ignore[arg-type]
    text = getattr(peer.next_event(), field)
    assert len(text) == MAX_TEXT_CHARS and text == long[: MAX_TEXT_CHARS - 1] + "\u2026"
    exact = dataclasses.replace(event, **{field: long[:MAX_TEXT_CHARS]})  # type: ignore[arg-type]
    peer.receive_data(ours.send(exact))
    assert peer.next_event() == exact
