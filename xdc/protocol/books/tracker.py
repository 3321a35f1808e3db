"""Per-request chunk bookkeeping for both ends, pure and compact.

A request's chunks may arrive on any connection, in any order, more than once (resends after
a NACK, a timeout or a dead connection). The receiver must never let a second copy write
over bytes already verified, because the decode engine may be reading them; it must not
count a cell until its bytes are checked; and it must not lose a good copy that happened to
arrive on the slower path. :class:`ReceiveTracker` decides, per chunk, where its bytes go and
what a verified or failed chunk changes. State is one byte per grid cell, so a 2 GiB request
at 64 KiB chunks costs 32 KiB.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from xdc.errors import ErrorCode, ProtocolError
from xdc.protocol.books.grid import ChunkGrid
from xdc.protocol.wire.events import Begin, ChunkHeader

# Cell states of ReceiveTracker
_MISSING: Final = 0
_WRITING: Final = 1  # an IN_PLACE receive is in progress; bytes in place are not yet checked
_VERIFIED: Final = 2
# Verified through a scratch copy while an older IN_PLACE receive of the same cell was still
# in progress: that receive is still writing (identical bytes, unless they are corrupt).
_VERIFIED_WRITING: Final = 3


class Disposition(enum.Enum):
    """Where the I/O layer puts a chunk's payload."""

    IN_PLACE = "in_place"  # straight into the request's buffer at the located offset
    # The cell is verified already, or another connection is receiving it in place right
    # now: receive into a scratch buffer and never write over bytes that may be live.
    SCRATCH = "scratch"


@dataclass(frozen=True, slots=True)
class ChunkOutcome:
    """What a finished chunk changed. Answer ACK when the checksum matched, NACK otherwise."""

    newly_verified: bool  # this chunk's cell just became verified
    layer_done: int | None  # the layer that just became complete (send LAYER_DONE)
    request_done: bool  # every byte of the request is verified now (send COMPLETE)
    copy_from_scratch: bool  # copy the scratch bytes into place now; already counted verified
    # Rare race: an in-place receive that was overtaken by a verified scratch copy then
    # failed its checksum, so the bytes in place are bad. The cell is missing again (NACK so
    # the sender resends). If the layer or request was already reported done, fail it.
    live_corrupted: bool = False


_NOTHING: Final = ChunkOutcome(False, None, False, False)


class ReceiveTracker:
    """Receiver-side state of one request: which grid cells are in progress and verified."""

    def __init__(self, begin: Begin) -> None:
        self.begin = begin
        self._grid = ChunkGrid.of(begin)
        self.total_bytes = self._grid.total_bytes
        self._cells = bytearray(self._grid.total_cells)
        self._layer_verified = [0] * len(begin.layer_sizes)
        self._cells_verified = 0
        self._bytes_verified = 0

    @property
    def grid(self) -> ChunkGrid:
        return self._grid

    def locate(self, hdr: ChunkHeader, in_place: bool = True) -> tuple[int, Disposition]:
        """Absolute offset of the chunk in the request's buffer and where to receive it;
        ``in_place`` False: in scratch, whatever the cell's state (a copy while something the
        tracker does not see yet may be writing the cell: a data worker's run)."""
        if hdr.rid != self.begin.rid:
            raise ProtocolError(
                ErrorCode.INTERNAL, f"chunk for {hdr.rid!r} given to tracker of {self.begin.rid!r}"
            )
        cell = self._grid.cell(hdr.layer, hdr.offset, hdr.length)
        position = self._grid.layer_offsets[hdr.layer] + hdr.offset
        if in_place and self._cells[cell] == _MISSING:
            self._cells[cell] = _WRITING
            return position, Disposition.IN_PLACE
        return position, Disposition.SCRATCH

    def finish(self, hdr: ChunkHeader, disposition: Disposition, ok: bool) -> ChunkOutcome:
        """Record a fully received chunk; ``ok`` is whether its checksum matched."""
        cell = self._grid.cell(hdr.layer, hdr.offset, hdr.length)
        state = self._cells[cell]
        if disposition is Disposition.IN_PLACE:
            if state == _WRITING:
                if not ok:
                    self._cells[cell] = _MISSING
                    return _NOTHING
                self._cells[cell] = _VERIFIED
                return self._count(hdr, +1)
            if state == _VERIFIED_WRITING:
                if ok:  # both copies were good; it was counted when the scratch copy landed
                    self._cells[cell] = _VERIFIED
                    return _NOTHING
                self._cells[cell] = _MISSING
                self._count(hdr, -1)
                return ChunkOutcome(False, None, False, False, live_corrupted=True)
            raise ProtocolError(
                ErrorCode.INTERNAL,
                f"finish(IN_PLACE) for layer {hdr.layer} offset {hdr.offset} "
                "without an in-place receive in progress",
                rid=hdr.rid,
            )
        if not ok or state in (_VERIFIED, _VERIFIED_WRITING):
            return _NOTHING
        self._cells[cell] = _VERIFIED if state == _MISSING else _VERIFIED_WRITING
        counted = self._count(hdr, +1)
        return ChunkOutcome(True, counted.layer_done, counted.request_done, True)

    def verified(self, hdr: ChunkHeader) -> bool:
        """The chunk's cell holds verified bytes already: a copy of it needs no receiving
        (the I/O layer skips its payload and acknowledges it)."""
        cell = self._grid.cell(hdr.layer, hdr.offset, hdr.length)
        return self._cells[cell] in (_VERIFIED, _VERIFIED_WRITING)

    def abandon(self, hdr: ChunkHeader, disposition: Disposition) -> None:
        """The connection died mid-payload: forget the in-progress mark so a resend goes in place.

        An overtaken in-place receive (the cell already verified via scratch) only ever wrote
        bytes TCP delivered for this very cell, so the cell stays verified.
        """
        if disposition is not Disposition.IN_PLACE:
            return
        cell = self._grid.cell(hdr.layer, hdr.offset, hdr.length)
        state = self._cells[cell]
        if state == _WRITING:
            self._cells[cell] = _MISSING
        elif state == _VERIFIED_WRITING:
            self._cells[cell] = _VERIFIED

    def superseded(self, hdr: ChunkHeader) -> bool:
        """True once the chunk's cell is verified: an in-place receive of it may stop writing."""
        state = self._cells[self._grid.cell(hdr.layer, hdr.offset, hdr.length)]
        return state in (_VERIFIED, _VERIFIED_WRITING)

    def _count(self, hdr: ChunkHeader, delta: int) -> ChunkOutcome:
        layer = hdr.layer
        self._cells_verified += delta
        self._bytes_verified += delta * hdr.length
        self._layer_verified[layer] += delta
        layer_done = (
            layer if self._layer_verified[layer] == self._grid.cells_per_layer[layer] else None
        )
        return ChunkOutcome(
            delta > 0, layer_done, self._cells_verified == self._grid.total_cells, False
        )

    def layer_complete(self, layer: int) -> bool:
        """Every byte of ``layer`` verified (true from the start for an empty layer)."""
        return self._layer_verified[layer] == self._grid.cells_per_layer[layer]

    @property
    def complete(self) -> bool:
        return self._cells_verified == self._grid.total_cells

    @property
    def verified_bytes(self) -> int:
        return self._bytes_verified


class SendTracker:
    """Sender-side state of one request: the grid to send and which cells are acknowledged."""

    def __init__(self, rid: str, layer_sizes: Sequence[int], chunk_bytes: int) -> None:
        self.rid = rid
        self._grid = ChunkGrid(rid, layer_sizes, chunk_bytes)
        self.total_bytes = self._grid.total_bytes
        self._acked = bytearray(self._grid.total_cells)
        self._layer_acked = [0] * len(self._grid.layer_sizes)
        self._cells_acked = 0
        self._bytes_acked = 0

    @property
    def grid(self) -> ChunkGrid:
        return self._grid

    def chunks(self, layer: int) -> list[tuple[int, int]]:
        """(offset, length) of every grid cell of ``layer``, in order."""
        return self._grid.chunks(layer)

    def ack(self, layer: int, offset: int) -> bool:
        """Record an ACK; True if it is new. Off-grid ACKs raise ProtocolError(MALFORMED)."""
        cell = self._grid.cell(layer, offset)
        if self._acked[cell]:
            return False
        self._acked[cell] = 1
        self._cells_acked += 1
        self._bytes_acked += self._grid.cell_length(layer, offset)
        self._layer_acked[layer] += 1
        return True

    def is_acked(self, layer: int, offset: int) -> bool:
        """Whether the cell at (layer, offset) is acknowledged (it need not be sent again)."""
        return bool(self._acked[self._grid.cell(layer, offset)])

    def layer_acked(self, layer: int) -> bool:
        return self._layer_acked[layer] == self._grid.cells_per_layer[layer]

    @property
    def all_acked(self) -> bool:
        return self._cells_acked == self._grid.total_cells

    @property
    def acked_bytes(self) -> int:
        return self._bytes_acked
