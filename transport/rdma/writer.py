"""Sender-side bookkeeping: layer chunks in, RDMA WRITE work requests out.

Chunks go out in layer order so layer ``i`` can complete while layer ``i+1`` is still being
produced (layer-wise pipelining, as over TCP). A sampled chunk is preceded on the same QP by
an 8-byte WRITE of its checksum into the receiver's table: RC executes WRITEs in order, so the
checksum is in place when the receiver sees the data's completion. A send completion only
means "placed in remote memory"; a chunk is done when the receiver reports its layer done.
On any error completion the writer raises RdmaLinkError and ``unconfirmed`` lists what the
TCP fallback must resend (the receiver's tracker turns duplicates into cheap ACKs).
"""

from __future__ import annotations

import itertools
import struct
from collections import deque
from dataclasses import dataclass, field

from xdc.transport.rdma.imm import ImmCodec, sampled
from xdc.transport.rdma.qpinfo import SlotGrant
from xdc.transport.rdma.verbs import WC_WR_FLUSH_ERR, Completion, Mr, RdmaLinkError, Write

from xdc.protocol import Begin, chunk_checksum
from xdc.protocol.books.grid import ChunkGrid

_U64 = struct.Struct("<Q")
# A chunk that fails the receiver's check this often over RDMA is not a transient flip: give
# the RDMA path up (TCP verifies every chunk) rather than rewrite it forever.
MAX_REWRITES = 3


@dataclass(eq=False)
class OutRequest:
    begin: Begin
    grant: SlotGrant
    chunks: ChunkGrid
    # layer -> (its bytes, their address), inside the registered source region; a layer's
    # source is known once the producer hands it over (layers may live apart in the pool)
    sources: dict[int, tuple[memoryview, int]] = field(default_factory=dict)
    contiguous: tuple[memoryview, int] | None = None  # whole request in one buffer, if so
    pending: deque[int] = field(default_factory=deque)  # chunk indices not yet posted
    posted: set[int] = field(default_factory=set)
    placed: set[int] = field(default_factory=set)  # WRITE completed at the receiver's memory
    layers_done: set[int] = field(default_factory=set)
    ready: set[int] = field(default_factory=set)  # layers the producer has handed over
    rewrites: dict[int, int] = field(default_factory=dict)  # chunk index -> NACKs so far
    complete: bool = False
    resent: int = 0


class RdmaWriter:
    """Turns requests into Write work requests for one connected QP; no I/O of its own."""

    def __init__(
        self,
        src_mr: Mr,
        staging: memoryview,
        staging_mr: Mr,
        rkey: int,
        max_inflight: int,
        codec: ImmCodec | None = None,
    ) -> None:
        if len(staging) < 8 * max_inflight:
            raise ValueError("staging must hold one u64 checksum per in-flight WR")
        self.src_mr = src_mr
        self.staging = staging
        self.staging_mr = staging_mr
        self.rkey = rkey
        self.max_inflight = max_inflight
        self.codec = codec or ImmCodec()
        self.requests: dict[str, OutRequest] = {}
        self._free_staging = list(range(max_inflight))
        self._inflight: dict[int, tuple[OutRequest, int, int | None]] = {}
        self._ids = itertools.count(1)
        self._order: deque[str] = deque()
        self.bytes_placed = 0

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def _check_source(self, src: memoryview, src_addr: int, size: int) -> None:
        lo, hi = self.src_mr.addr, self.src_mr.addr + self.src_mr.length
        if not lo <= src_addr <= src_addr + len(src) <= hi or len(src) != size:
            raise ValueError("source bytes are not inside the registered source region")

    def add(
        self,
        begin: Begin,
        grant: SlotGrant,
        src: memoryview | None = None,
        src_addr: int = 0,
    ) -> OutRequest:
        """Queue a request. ``src``/``src_addr``: its bytes laid end to end in the source MR;
        without them each layer's bytes are given to ``layer_ready``."""
        if begin.rid != grant.rid or grant.length != begin.total_bytes:
            raise ValueError(f"grant {grant} does not match request {begin.rid}")
        if begin.rid in self.requests:
            raise ValueError(f"request {begin.rid} is queued already")
        req = OutRequest(begin, grant, ChunkGrid.of(begin))
        if src is not None:
            self._check_source(src, src_addr, begin.total_bytes)
            req.contiguous = (src, src_addr)
        self.requests[begin.rid] = req
        self._order.append(begin.rid)
        return req

    def layer_ready(
        self, rid: str, layer: int, src: memoryview | None = None, src_addr: int = 0
    ) -> None:
        """The producer finished ``layer``: its chunks may go (in any layer order)."""
        req = self.requests[rid]
        if not 0 <= layer < len(req.begin.layer_sizes) or layer in req.ready:
            raise ValueError(f"layer {layer} of {rid} is not awaiting hand-over")
        size = req.begin.layer_sizes[layer]
        if src is None:
            if req.contiguous is None:
                raise ValueError(f"layer {layer} of {rid} handed over without its bytes")
            whole, base = req.contiguous
            start = req.chunks.position(layer, 0)
            src, src_addr = whole[start : start + size], base + start
        else:
            self._check_source(src, src_addr, size)
        req.sources[layer] = (src, src_addr)
        req.ready.add(layer)
        req.pending.extend(req.chunks.layer_indices(layer))
        if req.chunks.cells_per_layer[layer] == 0:
            req.layers_done.add(layer)

    def next_writes(self) -> list[Write]:
        """Work requests to post now, within the in-flight budget, oldest request first."""
        out: list[Write] = []
        for rid in list(self._order):
            req = self.requests[rid]
            while req.pending:
                index = req.pending[0]
                check = sampled(index, req.grant.verify_every, req.grant.phase)
                if self.inflight + (2 if check else 1) > self.max_inflight:  # out counted
                    return out
                req.pending.popleft()
                layer, offset, length = req.chunks.locate(index)
                pos = req.chunks.position(layer, offset)
                src, src_addr = req.sources[layer]
                if check:
                    slot = self._free_staging.pop()
                    data = src[offset : offset + length]
                    _U64.pack_into(self.staging, 8 * slot, chunk_checksum(data, rid, layer, offset))
                    wr_id = next(self._ids)
                    self._inflight[wr_id] = (req, index, slot)
                    entry = req.grant.sums_addr + 8 * (index // req.grant.verify_every)
                    out.append(
                        Write(
                            wr_id,
                            self.staging_mr.addr + 8 * slot,
                            8,
                            self.staging_mr.lkey,
                            entry,
                            self.rkey,
                        )
                    )
                wr_id = next(self._ids)
                self._inflight[wr_id] = (req, index, None)
                req.posted.add(index)
                out.append(
                    Write(
                        wr_id,
                        src_addr + offset,
                        length,
                        self.src_mr.lkey,
                        req.grant.addr + pos,
                        self.rkey,
                        self.codec.encode(req.grant.slot, index),
                    )
                )
        return out

    def on_completion(self, c: Completion) -> None:
        """A send completion; an error one means the connection is gone."""
        entry = self._inflight.pop(c.wr_id, None)
        if entry is None:
            raise RdmaLinkError(f"completion for unknown work request {c.wr_id}")
        req, index, staging = entry
        if staging is not None:
            self._free_staging.append(staging)
        if req.complete and not self.busy(req.begin.rid):
            self._forget(req.begin.rid)
        if not c.ok:
            if c.status == WC_WR_FLUSH_ERR:
                raise RdmaLinkError("work request flushed: queue pair in error")
            raise RdmaLinkError(f"RDMA write failed with status {c.status}")
        if staging is None:
            req.posted.discard(index)
            if index not in req.placed:
                req.placed.add(index)
                self.bytes_placed += req.chunks.locate(index)[2]

    def on_nack(self, rid: str, layer: int, offset: int) -> bool:
        """The receiver's sample check failed: write that chunk again, first. A NACK that
        names no chunk we could rewrite (off the grid, a layer not handed over, or one the
        receiver already reported done, whose source may be freed) is ignored: False."""
        req = self.requests.get(rid)
        if req is None or req.complete:
            return False
        begin = req.begin
        if (
            not 0 <= layer < len(begin.layer_sizes)
            or layer not in req.ready
            or layer in req.layers_done
            or offset % begin.chunk_bytes
            or not 0 <= offset < begin.layer_sizes[layer]
        ):
            return False
        index = req.chunks.index(layer, offset)
        req.rewrites[index] = req.rewrites.get(index, 0) + 1
        if req.rewrites[index] > MAX_REWRITES:
            raise RdmaLinkError(
                f"{rid} layer {layer} offset {offset} failed its checksum "
                f"{req.rewrites[index]} times over RDMA"
            )
        req.placed.discard(index)
        req.resent += 1
        if index not in req.pending:
            req.pending.appendleft(index)
        return True

    def on_layer_done(self, rid: str, layer: int) -> None:
        req = self.requests.get(rid)
        if req is not None:
            req.layers_done.add(layer)

    def on_complete(self, rid: str) -> OutRequest | None:
        """The receiver verified everything; forget the request (its bytes may be freed once
        no WRITE of it is still in flight: see ``busy``)."""
        req = self.requests.get(rid)
        if req is not None:
            req.complete = True
            req.pending.clear()
            if not self.busy(rid):
                self._forget(rid)
        return req

    def busy(self, rid: str) -> bool:
        """Some WRITE of ``rid`` is posted and not completed: its source bytes are in use."""
        return any(r.begin.rid == rid for r, _i, _s in self._inflight.values())

    def layer_busy(self, rid: str, layer: int) -> bool:
        """Some WRITE of that layer is posted and not completed (its source is in use)."""
        return any(
            r.begin.rid == rid and r.chunks.locate(i)[0] == layer
            for r, i, _s in self._inflight.values()
        )

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        if rid in self._order:
            self._order.remove(rid)

    def unconfirmed(self, rid: str) -> list[tuple[int, int, int]]:
        """(layer, offset, length) of every handed-over chunk whose layer the receiver has not
        reported done: what the TCP fallback sends."""
        req = self.requests[rid]
        out = []
        for layer in sorted(req.ready):
            if layer in req.layers_done:
                continue
            for index in req.chunks.layer_indices(layer):
                out.append(req.chunks.locate(index))
        return out

    def clear(self) -> None:
        """Drop every request and its view of the source bytes (so the pool can be unmapped).
        Only once the QP is destroyed: in-flight work is forgotten too."""
        self.abandon()
        self.requests.clear()
        self._order.clear()

    def abandon(self) -> list[str]:
        """The QP is torn down: nothing is in flight any more. Returns the unfinished rids."""
        self._inflight.clear()
        self._free_staging = list(range(self.max_inflight))
        return [rid for rid, r in self.requests.items() if not r.complete]
