"""The one chunk grid: TCP's (layer, offset) names, RDMA's cell indices and the trackers all
agree on which bytes a chunk covers, whatever the layer sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xdc.protocol import Begin, ChunkHeader, Disposition, ProtocolError, ReceiveTracker
from xdc.protocol.books.grid import ChunkGrid


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=8), st.integers(4096, 20_000))
def test_cell_indices_and_layer_offsets_name_the_same_cells(layers: list[int], chunk: int) -> None:
    begin = Begin("r", tuple(layers), chunk, (), 0, 1)
    grid = ChunkGrid.of(begin)
    expected = [(layer, off, ln) for layer in range(len(layers)) for off, ln in grid.chunks(layer)]
    assert grid.count == len(expected)
    assert sum(ln for _l, _o, ln in expected) == grid.total_bytes == begin.total_bytes
    assert [grid.locate(i) for i in range(grid.count)] == expected
    tracker = ReceiveTracker(begin)
    for i, (layer, off, ln) in enumerate(expected):
        assert grid.index(layer, off) == grid.cell(layer, off, ln) == i
        assert i in grid.layer_indices(layer)
        pos, disp = tracker.locate(ChunkHeader("r", layer, off, ln, 0))
        assert pos == grid.position(layer, off) and disp is Disposition.IN_PLACE
    with pytest.raises(ProtocolError):
        grid.locate(grid.count)
    with pytest.raises(ProtocolError):
        grid.locate(-1)


def test_empty_layers_have_no_cells_and_are_skipped_by_locate() -> None:
    grid = ChunkGrid("r", (10_000, 0, 4096, 1), 4096)
    assert grid.cells_per_layer == (3, 0, 1, 1)
    assert grid.layer_offsets == (0, 10_000, 10_000, 14_096)
    assert list(grid.layer_indices(1)) == []
    assert grid.locate(3) == (2, 0, 4096)
    assert grid.locate(4) == (3, 0, 1)


@pytest.mark.parametrize(
    ("layer", "offset", "length"),
    [(4, 0, None), (0, 1, None), (0, 12_288, None), (0, 8192, 4096), (0, 0, 4095)],
)
def test_a_chunk_off_the_grid_is_malformed(layer: int, offset: int, length: int | None) -> None:
    grid = ChunkGrid("r", (10_000, 0, 4096, 1), 4096)
    with pytest.raises(ProtocolError):
        grid.cell(layer, offset, length)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40_000), st.integers(4096, 9000), st.data())
def test_cells_within_a_ready_prefix_are_exactly_the_whole_cells_inside_it(
    size: int, chunk: int, data: st.DataObject
) -> None:
    """Partial hand-over: what may go once [0, upto) is final, from where we stopped."""
    grid = ChunkGrid("r", (size,), chunk)
    cuts = sorted(data.draw(st.lists(st.integers(0, size), max_size=5)))
    sent: list[tuple[int, int]] = []
    start = 0
    for upto in [*cuts, size]:
        new = grid.cells_within(0, start, upto)
        assert all(off >= start and off + ln <= upto for off, ln in new)
        sent += new
        if new:
            start = new[-1][0] + new[-1][1]
    assert sent == grid.chunks(0)  # every cell once, in order, when the layer is whole
