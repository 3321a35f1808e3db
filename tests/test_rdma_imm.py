"""Immediate-data codec and the chunk grid, checked against the protocol's own tracker."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.transport.rdma.imm import ChunkMap, ImmCodec, sampled, sum_slots

from xdc.protocol import Begin, ChunkHeader, Disposition, ReceiveTracker, SendTracker


@given(st.integers(1, 16), st.data())
def test_imm_round_trip(slot_bits: int, data: st.DataObject) -> None:
    codec = ImmCodec(slot_bits)
    slot = data.draw(st.integers(0, codec.max_slots - 1))
    index = data.draw(st.integers(0, codec.max_chunks - 1))
    imm = codec.encode(slot, index)
    assert 0 <= imm < 1 << 32
    assert codec.decode(imm) == (slot, index)


def test_imm_limits() -> None:
    codec = ImmCodec()
    assert codec.max_slots == 1024 and codec.max_chunks == 1 << 22
    with pytest.raises(ValueError):
        codec.encode(1024, 0)
    with pytest.raises(ValueError):
        codec.encode(0, 1 << 22)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=1, max_size=8), st.integers(4096, 20_000))
def test_chunk_map_matches_tracker_grid(layers: list[int], chunk: int) -> None:
    begin = Begin("r", tuple(layers), chunk, (), 0, 0)
    cmap = ChunkMap(begin)
    send = SendTracker("r", layers, chunk)
    expected = [(layer, off, ln) for layer in range(len(layers)) for off, ln in send.chunks(layer)]
    assert cmap.count == len(expected)
    assert [cmap.locate(i) for i in range(cmap.count)] == expected
    tracker = ReceiveTracker(begin)
    for i, (layer, off, ln) in enumerate(expected):
        assert cmap.index(layer, off) == i
        hdr = ChunkHeader("r", layer, off, ln, 0)
        pos, disp = tracker.locate(hdr)  # the tracker accepts exactly this grid
        assert pos == cmap.position(layer, off) and disp is Disposition.IN_PLACE
    with pytest.raises(ValueError):
        cmap.locate(cmap.count)


def test_sampling_covers_one_in_every() -> None:
    picks = [i for i in range(100) if sampled(i, 8, 3)]
    assert picks == list(range(3, 100, 8))
    assert {i // 8 for i in picks} == set(range(sum_slots(100, 8) - 1)) | {picks[-1] // 8}
    assert not any(sampled(i, 0, 0) for i in range(10))
    assert sum_slots(100, 0) == 0 and sum_slots(100, 1) == 100
