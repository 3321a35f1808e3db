"""One connection's protocol state machine (sans-IO, in the manner of h11).

The I/O layer owns the socket: it feeds received bytes to :meth:`Connection.receive_data`,
pulls events with :meth:`Connection.next_event`, and writes whatever :meth:`Connection.send`
returns. Nothing here blocks, allocates per payload byte, or knows about trio, so the whole
protocol (handshake, direction rules, limits, framing errors) is testable by feeding bytes.

CHUNK payloads never become events: after a :class:`ChunkHeader` the connection reports
``PAYLOAD`` until the I/O layer has consumed ``payload_pending`` bytes, either by copying
what is already buffered (:meth:`take_buffered_payload`), by receiving straight into its
destination and reporting it (:meth:`payload_consumed`), or by discarding it
(:meth:`skip_payload`). Only payload bytes that arrive in the same read as their header
pass through this module (copied in once, out once); the rest never do.

Deliberate leniency beyond docs/protocol.md: an ERROR frame is accepted as the peer's first
frame (and may be sent at any time, even before our HELLO or after a failure), so that a peer
rejecting our HELLO, e.g. for its version, can still tell us why before it closes.
"""

from __future__ import annotations

from typing import Final, NoReturn

from xdc.errors import ErrorCode, ProtocolError
from xdc.protocol.wire.events import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    ChunkHeader,
    Closed,
    Event,
    Hello,
    NeedData,
    Payload,
)
from xdc.protocol.wire.frames import (
    PREFIX,
    ROLES,
    FrameType,
    cap_text,
    check_prefix,
    decode_header,
    encode_checked,
    encode_chunk_header_checked,
    frame_type_of,
    shorten_text_to_fit,
)
from xdc.protocol.wire.limits import Limits

_MAY_SEND: Final[dict[str, frozenset[int]]] = {
    "sender": frozenset(
        {
            FrameType.HELLO,
            FrameType.BEGIN,
            FrameType.CHUNK,
            FrameType.END,
            FrameType.KEEP,
            FrameType.CANCEL,
            FrameType.ERROR,
            FrameType.PING,
            FrameType.PONG,
            FrameType.RDMA_OFFER,
            FrameType.RDMA_CLOSE,
        }
    ),
    "receiver": frozenset(
        {
            FrameType.HELLO,
            FrameType.ACCEPT,
            FrameType.ACK,
            FrameType.NACK,
            FrameType.LAYER_DONE,
            FrameType.COMPLETE,
            FrameType.CANCEL,
            FrameType.ERROR,
            FrameType.PING,
            FrameType.PONG,
            FrameType.RDMA_ANSWER,
            FrameType.GRANT,
            FrameType.RDMA_CLOSE,
        }
    ),
}
_PREFIX_SIZE: Final = PREFIX.size
# Consumed bytes are dropped from the front of the receive buffer only once there are this
# many of them (or all of it is consumed), so small frames cost no memmove each.
_COMPACT_AT: Final = 64 * 1024


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


class Connection:
    """Protocol state for one TCP connection, from our side (``"sender"`` or ``"receiver"``)."""

    def __init__(self, our_role: str, limits: Limits) -> None:
        if our_role not in ROLES:
            raise ValueError(f"our_role must be 'sender' or 'receiver', not {our_role!r}")
        self.our_role = our_role
        self.peer_role = "receiver" if our_role == "sender" else "sender"
        self.limits = limits
        self._we_send = _MAY_SEND[our_role]
        self._they_send = _MAY_SEND[self.peer_role]
        self._buf = bytearray()
        self._off = 0  # read offset into _buf; bytes before it are consumed
        self._eof = False
        self._closed = False  # CLOSED has been returned
        self._error: ProtocolError | None = None
        self._peer_hello: Hello | None = None
        self._hello_sent = False
        self._pending = 0  # payload bytes of the current CHUNK not yet consumed
        self._skip = 0  # payload bytes not yet received that receive_data must discard

    # ---- state ----------------------------------------------------------------------------

    @property
    def state(self) -> str:
        if self._error is not None:
            return "error"
        if self._closed:
            return "closed"
        if self._peer_hello is not None and self._hello_sent:
            return "open"
        return "handshake"

    @property
    def peer_hello(self) -> Hello | None:
        return self._peer_hello

    @property
    def payload_pending(self) -> int:
        return self._pending

    @property
    def payload_buffered(self) -> int:
        """Payload bytes of the current CHUNK already buffered here (take them first)."""
        return min(self._pending, len(self._buf) - self._off)

    # ---- outgoing -------------------------------------------------------------------------

    def send(self, event: Event) -> bytes:
        """Validate and encode one outgoing non-CHUNK event; return the bytes to write.

        Misuse (a frame our role may not send, anything before our HELLO, a second HELLO, a
        receiver answering before the sender's HELLO, anything but ERROR after a failure)
        raises ``ProtocolError(OUT_OF_ORDER)``; a bad field raises MALFORMED/LIMIT/VERSION.
        Send-side errors do not change the connection's state: nothing was sent.
        """
        ftype = frame_type_of(event)
        if ftype == FrameType.CHUNK:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "CHUNK must go through send_chunk_header")
        self._check_may_send(ftype)
        if type(event) is Hello:
            if event.role != self.our_role:
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"HELLO role {event.role!r} but we are {self.our_role!r}"
                )
            if self.our_role == "receiver" and self._peer_hello is None:
                raise ProtocolError(
                    ErrorCode.OUT_OF_ORDER, "the receiver answers the sender's HELLO, never first"
                )
        event = cap_text(event)
        try:
            frame = encode_checked(event, self.limits)
        except ProtocolError as exc:
            shorter = (
                shorten_text_to_fit(event, self.limits) if exc.code == ErrorCode.LIMIT else None
            )
            if shorter is None:
                raise
            frame = encode_checked(shorter, self.limits)
        if ftype == FrameType.HELLO:
            self._hello_sent = True
        return frame

    def send_chunk_header(self, hdr: ChunkHeader) -> bytes:
        """Prefix and header of a CHUNK; the caller writes exactly ``hdr.length`` bytes next."""
        self._check_may_send(FrameType.CHUNK)
        return encode_chunk_header_checked(hdr, self.limits)

    def _check_may_send(self, ftype: int) -> None:
        if ftype not in self._we_send:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"a {self.our_role} may not send {FrameType(ftype).name}",
            )
        if ftype == FrameType.ERROR:
            return
        if self._error is not None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER, f"connection failed ({self._error}); only ERROR may follow"
            )
        if not self._hello_sent:
            if ftype != FrameType.HELLO:
                raise ProtocolError(
                    ErrorCode.OUT_OF_ORDER, f"{FrameType(ftype).name} before our HELLO"
                )
        elif ftype == FrameType.HELLO:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "HELLO sent twice")

    # ---- incoming -------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes read from the socket; an empty buffer means the peer sent EOF."""
        if self._error is not None:
            return
        view = _byte_view(data)
        if not view.nbytes:
            self._eof = True
            return
        if self._eof:
            self._fail(ErrorCode.INTERNAL, "receive_data after EOF")
        if self._skip:
            dropped = min(self._skip, view.nbytes)
            self._skip -= dropped
            if dropped == view.nbytes:
                return
            view = view[dropped:]
        if self._off:
            if self._off == len(self._buf):
                self._buf.clear()
                self._off = 0
            elif self._off >= _COMPACT_AT:
                del self._buf[: self._off]
                self._off = 0
        self._buf += view

    def next_event(self) -> Event | NeedData | Payload | Closed:
        """Return the next event, or NEED_DATA, PAYLOAD (consume it first) or CLOSED.

        Raises ProtocolError on any violation; from then on the connection is in state
        "error" and every call raises that same error again.
        """
        if self._error is not None:
            raise self._error.with_traceback(None)
        if self._pending:
            if self._eof and len(self._buf) - self._off < self._pending:
                self._fail(ErrorCode.MALFORMED, "connection closed mid-frame")
            return PAYLOAD
        if self._skip:
            if self._eof:
                self._fail(ErrorCode.MALFORMED, "connection closed mid-frame")
            return NEED_DATA
        if self._closed:
            return CLOSED
        buf = self._buf
        start = self._off
        avail = len(buf) - start
        if avail < _PREFIX_SIZE:
            if not self._eof:
                return NEED_DATA
            if avail:
                self._fail(ErrorCode.MALFORMED, "connection closed mid-frame")
            self._closed = True
            return CLOSED
        try:
            magic, ftype, flags, header_len, reserved, payload_len = PREFIX.unpack_from(buf, start)
            check_prefix(magic, ftype, flags, header_len, reserved, payload_len, self.limits)
            self._check_may_receive(ftype)
            header_start = start + _PREFIX_SIZE
            header_end = header_start + header_len
            if len(buf) < header_end:
                if self._eof:
                    raise ProtocolError(ErrorCode.MALFORMED, "connection closed mid-frame")
                return NEED_DATA
            event = decode_header(ftype, buf[header_start:header_end], self.limits)
            if type(event) is ChunkHeader:
                if event.length != payload_len:
                    raise ProtocolError(
                        ErrorCode.MALFORMED,
                        f"CHUNK length {event.length} != payload length {payload_len}",
                    )
                self._pending = payload_len
            elif type(event) is Hello:
                self._accept_hello(event)
        except ProtocolError as exc:
            self._error = exc
            raise
        self._off = header_end
        return event

    def _check_may_receive(self, ftype: int) -> None:
        if ftype not in self._they_send:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER,
                f"a {self.peer_role} may not send {FrameType(ftype).name}",
            )
        if self._peer_hello is None:
            if ftype != FrameType.HELLO and ftype != FrameType.ERROR:
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"{FrameType(ftype).name} before HELLO")
        elif ftype == FrameType.HELLO:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "second HELLO")

    def _accept_hello(self, hello: Hello) -> None:
        # decode_header has already rejected a foreign version with VERSION
        if hello.role != self.peer_role:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER, f"peer says it is a {hello.role}; so are we"
            )
        if self.our_role == "sender" and not self._hello_sent:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "receiver sent HELLO before the sender")
        self._peer_hello = hello

    # ---- payload --------------------------------------------------------------------------

    def take_buffered_payload(self, dest: memoryview) -> int:
        """Copy up to ``len(dest)`` already-buffered payload bytes into ``dest``; return count."""
        n = min(self._pending, len(self._buf) - self._off)
        if n <= 0:
            return 0
        out = _byte_view(dest)
        n = min(n, out.nbytes)
        start = self._off
        with memoryview(self._buf) as src:
            out[:n] = src[start : start + n]
        self._off = start + n
        self._pending -= n
        return n

    def payload_consumed(self, n: int) -> None:
        """Record ``n`` payload bytes the I/O layer received itself, straight off the socket."""
        if n < 0 or n > self._pending:
            self._fail(
                ErrorCode.INTERNAL, f"payload_consumed({n}) but {self._pending} bytes pending"
            )
        if n and len(self._buf) > self._off:
            self._fail(
                ErrorCode.INTERNAL,
                "payload_consumed while payload bytes are still buffered: take them first",
            )
        self._pending -= n

    def hand_over(self) -> bytes | None:
        """Every byte received and not parsed yet, taken out for whoever reads the frames
        that follow (a data worker's run, which hands back what it does not consume through
        ``receive_data`` and ``skip_bytes``); None when there is a payload under way or to
        skip, or the connection failed or ended: then nothing is taken."""
        if self._error is not None or self._pending or self._skip or self._eof or self._closed:
            return None
        data = bytes(self._buf[self._off :])
        self._buf.clear()
        self._off = 0
        return data

    def skip_bytes(self, n: int) -> None:
        """The next ``n`` bytes to arrive are the rest of a payload someone else began
        reading (a run stopped mid-payload): dropped as they come, before the next frame."""
        if n < 0 or self._pending or len(self._buf) > self._off:
            self._fail(ErrorCode.INTERNAL, f"skip_bytes({n}) with bytes buffered or pending")
        self._skip += n

    def skip_payload(self) -> None:
        """Discard the rest of the current payload: buffered bytes now, the rest on arrival."""
        buffered = min(self._pending, len(self._buf) - self._off)
        self._off += buffered
        self._skip += self._pending - buffered
        self._pending = 0

    def _fail(self, code: ErrorCode, message: str) -> NoReturn:
        self._error = ProtocolError(code, message)
        raise self._error
