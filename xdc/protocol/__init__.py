"""Sans-IO wire protocol: bytes in, events out; events in, bytes out.

Pure state machines and codecs (no sockets, no trio) so the transport is a thin shell and
every protocol rule is testable by feeding bytes. The wire format is docs/protocol.md.
"""

from xdc.errors import ErrorCode, ProtocolError
from xdc.protocol.books.tracker import ChunkOutcome, Disposition, ReceiveTracker, SendTracker
from xdc.protocol.wire.checksum import checksum, chunk_checksum
from xdc.protocol.wire.connection import Connection
from xdc.protocol.wire.events import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    PROTOCOL_VERSION,
    Accept,
    Ack,
    Begin,
    Cancel,
    ChunkHeader,
    Closed,
    Complete,
    End,
    Error,
    Event,
    Grant,
    Hello,
    Keep,
    LayerDone,
    Nack,
    NeedData,
    Payload,
    Ping,
    Pong,
    RdmaAnswer,
    RdmaClose,
    RdmaOffer,
)
from xdc.protocol.wire.frames import (
    PREFIX,
    FrameType,
    decode_header,
    encode,
    encode_chunk_header,
    validate_event,
)
from xdc.protocol.wire.limits import Limits

__all__ = [
    "CLOSED",
    "NEED_DATA",
    "PAYLOAD",
    "PREFIX",
    "PROTOCOL_VERSION",
    "Accept",
    "Ack",
    "Begin",
    "Cancel",
    "ChunkHeader",
    "ChunkOutcome",
    "Closed",
    "Complete",
    "Connection",
    "Disposition",
    "End",
    "Error",
    "ErrorCode",
    "Event",
    "FrameType",
    "Grant",
    "Hello",
    "Keep",
    "LayerDone",
    "Limits",
    "Nack",
    "NeedData",
    "Payload",
    "Ping",
    "Pong",
    "ProtocolError",
    "RdmaAnswer",
    "RdmaClose",
    "RdmaOffer",
    "ReceiveTracker",
    "SendTracker",
    "checksum",
    "chunk_checksum",
    "decode_header",
    "encode",
    "encode_chunk_header",
    "validate_event",
]
