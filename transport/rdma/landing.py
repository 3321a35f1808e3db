"""Receiver-side bookkeeping for chunks that arrive by RDMA WRITE_WITH_IMM.

The bytes are already in the request's buffer when the completion arrives; what is left is
what the TCP path does after ``read_payload``: verify (here on a sample, against the checksum
the sender wrote into the request's table before the data, which RC ordering guarantees has
landed), then drive the *same* ReceiveTracker, so layer-wise completion and two-phase
visibility are decided by one piece of code for both backends. The answer is a list of
protocol events (NACK, LAYER_DONE, COMPLETE) for the control connection.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, field

from xdc.transport.rdma.imm import ImmCodec, sampled, sum_slots
from xdc.transport.rdma.qpinfo import SlotGrant
from xdc.transport.rdma.verbs import Completion, RdmaLinkError, WcKind

from xdc.protocol import (
    Begin,
    ChunkHeader,
    Complete,
    ErrorCode,
    Event,
    LayerDone,
    Nack,
    ProtocolError,
    ReceiveTracker,
    chunk_checksum,
)
from xdc.protocol.books.grid import ChunkGrid

_U64 = struct.Struct("<Q")


@dataclass(eq=False)
class Landing:
    grant: SlotGrant
    tracker: ReceiveTracker
    chunks: ChunkGrid
    offset: int  # request's first byte in the pool
    sums_offset: int  # checksum table in the pool
    verified_by_sample: int = 0
    unchecked: int = 0
    rejected: int = 0
    done_layers: list[int] = field(default_factory=list)


class LandingZone:
    """All requests of one receive pool that peers may write by RDMA."""

    def __init__(self, pool: memoryview, pool_addr: int, codec: ImmCodec | None = None) -> None:
        self.pool = pool
        self.pool_addr = pool_addr
        self.codec = codec or ImmCodec()
        self.slots: dict[int, Landing] = {}
        self.stale_writes = 0
        self._cursor = 0

    @staticmethod
    def sums_bytes(begin: Begin, verify_every: int) -> int:
        """Pool bytes to allocate after the request for its checksum table."""
        return 8 * sum_slots(ChunkGrid.of(begin).count, verify_every)

    def grant(
        self,
        tracker: ReceiveTracker,
        offset: int,
        sums_offset: int,
        verify_every: int,
    ) -> SlotGrant:
        """Open a slot for an accepted request whose buffer is at ``offset`` in the pool."""
        begin = tracker.begin
        chunks = ChunkGrid.of(begin)
        if chunks.count > self.codec.max_chunks:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"{chunks.count} chunks exceed the {self.codec.max_chunks} an RDMA slot carries",
                rid=begin.rid,
            )
        need = self.sums_bytes(begin, verify_every)
        for start, size in ((offset, begin.total_bytes), (sums_offset, need)):
            if start < 0 or start + size > len(self.pool):
                raise ValueError(f"region {start}+{size} is outside the pool")
        # round robin, never the lowest free: a slot just released may still have receive
        # completions queued behind the landing loop, which must not count for a new request
        n = self.codec.max_slots
        slot = next(
            (c % n for c in range(self._cursor, self._cursor + n) if c % n not in self.slots),
            None,
        )
        if slot is None:
            raise ProtocolError(ErrorCode.TOO_BUSY, "no free RDMA slot", rid=begin.rid)
        self._cursor = slot + 1
        grant = SlotGrant(
            rid=begin.rid,
            slot=slot,
            addr=self.pool_addr + offset,
            length=begin.total_bytes,
            sums_addr=self.pool_addr + sums_offset if need else 0,
            verify_every=verify_every if need else 0,
            phase=secrets.randbelow(verify_every) if need else 0,
        )
        self.slots[slot] = Landing(grant, tracker, chunks, offset, sums_offset)
        return grant

    def release(self, slot: int) -> None:
        """Forget a finished request. The caller must be sure the peer writes no more to it
        (request complete, or the QP torn down) before the pool region is reused."""
        self.slots.pop(slot, None)

    def on_completion(self, c: Completion) -> list[Event]:
        """Events to send on the control connection for one receive completion."""
        if not c.ok:  # a flushed receive too: the QP is in error, nothing more will land
            raise RdmaLinkError(f"receive completion failed with status {c.status}")
        if c.kind is not WcKind.RECV_IMM or c.imm is None:
            raise RdmaLinkError(f"unexpected receive completion {c.kind.value}")
        slot, index = self.codec.decode(c.imm)
        land = self.slots.get(slot)
        if land is None:
            self.stale_writes += 1
            raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"RDMA write to free slot {slot}")
        rid = land.grant.rid
        try:
            layer, offset, length = land.chunks.locate(index)
        except ProtocolError as exc:
            raise ProtocolError(ErrorCode.MALFORMED, exc.message, rid=rid) from None
        if c.byte_len != length:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"chunk {index} landed {c.byte_len} bytes, grid cell is {length}",
                rid=rid,
            )
        hdr = ChunkHeader(rid, layer, offset, length, 0)
        rel, disp = land.tracker.locate(hdr)
        start = land.offset + rel
        ok = True
        if sampled(index, land.grant.verify_every, land.grant.phase):
            entry = land.sums_offset + 8 * (index // land.grant.verify_every)
            (expected,) = _U64.unpack_from(self.pool, entry)
            data = self.pool[start : start + length]
            ok = chunk_checksum(data, rid, layer, offset) == expected
            land.verified_by_sample += ok
        else:
            land.unchecked += 1  # trusted to RC's link-level CRC
        # The bytes are in place either way; SCRATCH only means the cell was verified or
        # being received over TCP already, and finish() then counts it at most once.
        out = land.tracker.finish(hdr, disp, ok)
        events: list[Event] = []
        if not ok or out.live_corrupted:
            land.rejected += 1
            events.append(Nack(rid, layer, offset, "checksum mismatch (rdma sample)"))
            return events
        if out.layer_done is not None:
            land.done_layers.append(out.layer_done)
            events.append(LayerDone(rid, out.layer_done))
        if out.request_done:
            events.append(Complete(rid, land.tracker.total_bytes))
        return events
