"""The chunk grid of one request: the one place that says which bytes a chunk is.

A request's bytes are its layers laid end to end; layer ``l`` is cut into cells of
``chunk_bytes`` (the last one shorter, an empty layer has none). Cells are numbered across
the whole request, layer after layer. The TCP path names a cell by (layer, offset) in CHUNK
and ACK frames, the RDMA path by its index in the 32-bit immediate; both trackers and the
RDMA writer and landing zone all locate cells here, so the two paths can never disagree on
what a chunk covers.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from xdc.errors import ErrorCode, ProtocolError
from xdc.protocol.wire.events import Begin


class ChunkGrid:
    __slots__ = (
        "cells_per_layer",
        "chunk_bytes",
        "first_cell",
        "layer_offsets",
        "layer_sizes",
        "rid",
        "total_bytes",
        "total_cells",
    )

    def __init__(self, rid: str, layer_sizes: Sequence[int], chunk_bytes: int) -> None:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be > 0")
        self.rid = rid
        self.layer_sizes = tuple(layer_sizes)
        self.chunk_bytes = chunk_bytes
        self.cells_per_layer = tuple(-(-size // chunk_bytes) for size in self.layer_sizes)
        first: list[int] = []
        starts: list[int] = []
        cell = pos = 0
        for size, cells in zip(self.layer_sizes, self.cells_per_layer, strict=True):
            first.append(cell)
            starts.append(pos)
            cell += cells
            pos += size
        self.first_cell = tuple(first)
        self.layer_offsets = tuple(starts)
        self.total_cells = cell
        self.total_bytes = pos

    @classmethod
    def of(cls, begin: Begin) -> ChunkGrid:
        return cls(begin.rid, begin.layer_sizes, begin.chunk_bytes)

    @property
    def count(self) -> int:
        """Cells in the whole request."""
        return self.total_cells

    def cell(self, layer: int, offset: int, length: int | None = None) -> int:
        """Index of the cell at (layer, offset); ProtocolError(MALFORMED) if it is not one,
        or (with ``length``) if the chunk does not cover exactly that cell."""
        if not 0 <= layer < len(self.layer_sizes):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"layer {layer} out of range (request has {len(self.layer_sizes)})",
                rid=self.rid,
            )
        k, rem = divmod(offset, self.chunk_bytes)
        if rem or not 0 <= k < self.cells_per_layer[layer]:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"offset {offset} of layer {layer} is off the chunk grid",
                rid=self.rid,
            )
        if length is not None and length != self.cell_length(layer, offset):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"chunk at layer {layer} offset {offset} has length {length}, "
                f"grid cell is {self.cell_length(layer, offset)}",
                rid=self.rid,
            )
        return self.first_cell[layer] + k

    def index(self, layer: int, offset: int) -> int:
        """Index of the cell starting at (layer, offset) (ProtocolError if none does)."""
        return self.cell(layer, offset)

    def cell_length(self, layer: int, offset: int) -> int:
        return min(self.chunk_bytes, self.layer_sizes[layer] - offset)

    def locate(self, index: int) -> tuple[int, int, int]:
        """(layer, offset within the layer, length) of cell ``index``; ProtocolError
        (MALFORMED) off the grid."""
        if not 0 <= index < self.total_cells:
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"chunk {index} is off the grid of {self.total_cells}",
                rid=self.rid,
            )
        # the last layer starting at or before the index that has cells
        layer = bisect.bisect_right(self.first_cell, index) - 1
        while self.cells_per_layer[layer] == 0:
            layer -= 1
        offset = (index - self.first_cell[layer]) * self.chunk_bytes
        return layer, offset, self.cell_length(layer, offset)

    def position(self, layer: int, offset: int) -> int:
        """Byte position of (layer, offset) in the request's contiguous buffer."""
        return self.layer_offsets[layer] + offset

    def layer_indices(self, layer: int) -> range:
        first = self.first_cell[layer]
        return range(first, first + self.cells_per_layer[layer])

    def chunks(self, layer: int) -> list[tuple[int, int]]:
        """(offset, length) of every cell of ``layer``, in order."""
        size = self.layer_sizes[layer]
        step = self.chunk_bytes
        return [(off, min(step, size - off)) for off in range(0, size, step)]

    def cells_within(self, layer: int, start: int, upto: int) -> list[tuple[int, int]]:
        """(offset, length) of the cells of ``layer`` that begin at or after ``start`` and
        end at or before ``upto``: what may go once bytes [0, upto) are final."""
        step = self.chunk_bytes
        size = self.layer_sizes[layer]
        first = -(-start // step) * step
        return [
            (off, min(step, size - off))
            for off in range(first, min(upto, size), step)
            if off + min(step, size - off) <= upto
        ]
