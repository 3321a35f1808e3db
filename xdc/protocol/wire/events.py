"""Typed events, one per frame type, plus the sentinels ``Connection.next_event`` returns.

Events are plain frozen values: constructing one validates nothing (that would tax the hot
path twice); the codec validates everything that crosses the wire, in both directions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, TypeAlias

PROTOCOL_VERSION: Final = 2  # 2: KEEP, and deadlines count from the last progress


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    peer_id: str
    role: str
    session: str
    conn_index: int


@dataclass(frozen=True, slots=True)
class Begin:
    """Announces a request; its bytes are the layers laid end to end in one buffer."""

    rid: str
    layer_sizes: tuple[int, ...]
    chunk_bytes: int
    block_hashes: tuple[int, ...]
    cached_blocks: int
    deadline_ms: int
    # What the bytes are (model, dtype, block size, KV layout), as the producing engine says;
    # a receiver whose decode engine expects another layout refuses the request before any
    # byte moves. "" = unspecified (synthetic engines).
    layout: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_sizes)

    @property
    def layer_offsets(self) -> tuple[int, ...]:
        """Start of each layer in the request's contiguous buffer."""
        offsets = []
        pos = 0
        for size in self.layer_sizes:
            offsets.append(pos)
            pos += size
        return tuple(offsets)


@dataclass(frozen=True, slots=True)
class Accept:
    rid: str


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A CHUNK frame's header; its ``length`` payload bytes follow it on the wire.

    ``copy``: True when the sender sent this cell before (a resend after a NACK, a lost
    connection or an RDMA fallback), False for its first send, None from a sender that does
    not say (a header of five fields). A receiver whose data workers land chunks on their own
    lands only chunks marked False that way: each cell has one such chunk per request, so
    two workers never write one cell at once; copies go through the receiver's books."""

    rid: str
    layer: int
    offset: int
    length: int
    checksum: int
    copy: bool | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    rid: str
    layer: int
    offset: int


@dataclass(frozen=True, slots=True)
class Nack:
    rid: str
    layer: int
    offset: int
    reason: str
    # 0: resend at once (the bytes were wrong); > 0: the receiver could not take the chunk
    # now (no scratch buffer free) and asks for a resend no sooner than this
    retry_after_ms: int = 0


@dataclass(frozen=True, slots=True)
class LayerDone:
    rid: str
    layer: int


@dataclass(frozen=True, slots=True)
class End:
    rid: str


@dataclass(frozen=True, slots=True)
class Keep:
    """The sender still holds ``rid`` live (its engine may still be computing): the receiver's
    window for it starts again. Sent every third of a window (at least every second) until the
    request ends there, so a receiver frees what its sender dropped (a CANCEL lost with its
    connection) a window later, and never what a long prefill is still making."""

    rid: str


@dataclass(frozen=True, slots=True)
class Complete:
    rid: str
    total_bytes: int


@dataclass(frozen=True, slots=True)
class Cancel:
    rid: str
    reason: str


@dataclass(frozen=True, slots=True)
class Error:
    """An ERROR frame; ``code`` is a plain int so codes from newer peers still decode."""

    code: int
    message: str
    rid: str | None


@dataclass(frozen=True, slots=True)
class Ping:
    nonce: int


@dataclass(frozen=True, slots=True)
class Pong:
    nonce: int


@dataclass(frozen=True, slots=True)
class RdmaOffer:
    """Sender -> receiver: "connect an RC queue pair to mine". ``info`` is an encoded QpInfo
    (xdc.transport.rdma.qpinfo); the receiver answers on the same connection."""

    domain: str
    info: bytes


@dataclass(frozen=True, slots=True)
class RdmaAnswer:
    """Receiver -> sender: its QpInfo (pool rkey and bounds included), or empty ``info`` and
    the reason it stays on TCP."""

    domain: str
    info: bytes
    reason: str
    # the sender QP of the offer this answers (0: unknown, from a peer before this field), so
    # a late answer to an offer that timed out is never taken for the next offer's
    offer_qp: int = 0


@dataclass(frozen=True, slots=True)
class Grant:
    """Receiver -> sender, just before ACCEPT on the same connection: where the request's
    buffer lives for RDMA WRITEs (an encoded SlotGrant). No GRANT = the request goes by TCP."""

    rid: str
    grant: bytes


@dataclass(frozen=True, slots=True)
class RdmaClose:
    """Either side: its queue pair ``qp_num`` is destroyed; everything continues on TCP. The
    peer closes its own side only if that is the QP it is connected to, so a late close (from
    a pair already replaced) never tears down a newer one."""

    qp_num: int
    reason: str


Event: TypeAlias = (
    Hello
    | Begin
    | Accept
    | ChunkHeader
    | Ack
    | Nack
    | LayerDone
    | End
    | Keep
    | Complete
    | Cancel
    | Error
    | Ping
    | Pong
    | RdmaOffer
    | RdmaAnswer
    | Grant
    | RdmaClose
)


# Single-member enums rather than bare objects: mypy narrows both ``x is NEED_DATA`` and
# ``isinstance(x, NeedData)``, and they pickle/compare as singletons.
class NeedData(enum.Enum):
    """More bytes are needed before the next event (feed ``receive_data``)."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value


class Payload(enum.Enum):
    """A CHUNK's payload is pending; consume it before asking for the next event."""

    PAYLOAD = "PAYLOAD"

    def __repr__(self) -> str:
        return self.value


class Closed(enum.Enum):
    """The peer closed its side at a frame boundary."""

    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = NeedData.NEED_DATA
PAYLOAD: Final = Payload.PAYLOAD
CLOSED: Final = Closed.CLOSED
