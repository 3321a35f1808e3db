"""Chunk-grid bookkeeping: where chunks land, when layers and requests complete, resends."""

from __future__ import annotations

import itertools
import time

import pytest

from xdc.protocol import (
    Begin,
    ChunkHeader,
    Disposition,
    ErrorCode,
    ProtocolError,
    ReceiveTracker,
    SendTracker,
)

C = 4096
# layer 0 empty, layer 1 an exact multiple, layer 2 with a short last chunk, layer 3 < 1 chunk
SIZES = (0, 3 * C, 2 * C + 100, 7)
BEGIN = Begin("r1", SIZES, C, (), 0, 1000)


def hdr(layer: int, offset: int, length: int | None = None, rid: str = "r1") -> ChunkHeader:
    if length is None:
        length = min(C, SIZES[layer] - offset)
    return ChunkHeader(rid, layer, offset, length, 0)


def all_cells() -> list[ChunkHeader]:
    return [hdr(layer, off) for layer, size in enumerate(SIZES) for off in range(0, size, C)]


def test_grid_positions() -> None:
    t = ReceiveTracker(BEGIN)
    assert t.total_bytes == sum(SIZES) == 5 * C + 107
    starts = BEGIN.layer_offsets
    assert starts == (0, 0, 3 * C, 5 * C + 100)
    seen = []
    for h in all_cells():
        pos, disp = t.locate(h)
        assert disp is Disposition.IN_PLACE
        assert pos == starts[h.layer] + h.offset
        seen.append((pos, h.length))
    # the cells tile the request's buffer exactly, with no gap and no overlap
    seen.sort()
    assert seen[0][0] == 0
    for (a, la), (b, _) in itertools.pairwise(seen):
        assert a + la == b
    assert seen[-1][0] + seen[-1][1] == t.total_bytes


@pytest.mark.parametrize(
    "bad",
    [
        hdr(0, 0, 1),  # the empty layer has no cells
        hdr(4, 0, 1),  # no such layer
        hdr(1, 3 * C, C),  # offset == layer size
        hdr(1, 100, C),  # off the grid
        hdr(1, C, C - 1),  # short non-last chunk
        hdr(2, 2 * C, C),  # last chunk must be 100 bytes
        hdr(2, 2 * C, 99),
        hdr(3, 0, C),
        ChunkHeader("r1", 1, -C, C, 0),
    ],
    ids=repr,
)
def test_off_grid_chunks_are_refused_with_the_rid(bad: ChunkHeader) -> None:
    t = ReceiveTracker(BEGIN)
    with pytest.raises(ProtocolError) as exc:
        t.locate(bad)
    assert exc.value.code in (ErrorCode.MALFORMED, ErrorCode.OUT_OF_ORDER)
    assert exc.value.rid == "r1"
    assert t.verified_bytes == 0


def test_wrong_request_is_a_caller_bug() -> None:
    with pytest.raises(ProtocolError) as exc:
        ReceiveTracker(BEGIN).locate(hdr(1, 0, rid="other"))
    assert exc.value.code == ErrorCode.INTERNAL


def test_layers_and_request_complete_exactly_once() -> None:
    t = ReceiveTracker(BEGIN)
    assert t.layer_complete(0)  # an empty layer is complete from the start
    assert not t.layer_complete(1)
    done_layers = []
    finished = 0
    for i, h in enumerate(reversed(all_cells())):  # any order
        assert not t.complete
        _, disp = t.locate(h)
        out = t.finish(h, disp, ok=True)
        assert out.newly_verified
        assert not out.copy_from_scratch
        if out.layer_done is not None:
            done_layers.append(out.layer_done)
            assert t.layer_complete(out.layer_done)
        finished += out.request_done
        assert out.request_done == (i == len(all_cells()) - 1)
    assert sorted(done_layers) == [1, 2, 3]
    assert finished == 1
    assert t.complete
    assert t.verified_bytes == t.total_bytes


def test_duplicate_goes_to_scratch_and_changes_nothing() -> None:
    t = ReceiveTracker(BEGIN)
    h = hdr(3, 0)
    _, disp = t.locate(h)
    out = t.finish(h, disp, ok=True)
    assert out.layer_done == 3
    pos, again = t.locate(h)
    assert again is Disposition.SCRATCH  # never receive over verified bytes
    assert pos == BEGIN.layer_offsets[3]
    out = t.finish(h, again, ok=True)
    assert (out.newly_verified, out.layer_done, out.request_done, out.copy_from_scratch) == (
        False,
        None,
        False,
        False,
    )
    assert t.verified_bytes == 7


def test_corrupt_chunk_is_not_verified_and_the_resend_is() -> None:
    t = ReceiveTracker(BEGIN)
    h = hdr(1, C)
    _, disp = t.locate(h)
    out = t.finish(h, disp, ok=False)
    assert not out.newly_verified
    assert t.verified_bytes == 0
    _, disp = t.locate(h)
    assert disp is Disposition.IN_PLACE  # the resend may overwrite the bad bytes
    out = t.finish(h, disp, ok=True)
    assert out.newly_verified
    assert t.verified_bytes == C


def test_resend_overtaking_a_slow_connection() -> None:
    """Connection A is receiving a chunk in place; the resend on B lands in scratch first."""
    t = ReceiveTracker(BEGIN)
    h = hdr(2, 2 * C)
    _, on_a = t.locate(h)
    _, on_b = t.locate(h)
    assert (on_a, on_b) == (Disposition.IN_PLACE, Disposition.SCRATCH)
    assert not t.superseded(h)
    out = t.finish(h, on_b, ok=True)
    assert out.copy_from_scratch and out.newly_verified
    assert t.verified_bytes == 100
    assert t.superseded(h)
    out = t.finish(h, on_a, ok=True)  # A was fine too: nothing new
    assert not out.newly_verified and not out.copy_from_scratch and not out.live_corrupted
    assert t.verified_bytes == 100


def test_overtaken_in_place_receive_that_turns_out_corrupt() -> None:
    t = ReceiveTracker(BEGIN)
    h = hdr(2, 0)
    _, on_a = t.locate(h)
    _, on_b = t.locate(h)
    assert t.finish(h, on_b, ok=True).copy_from_scratch
    out = t.finish(h, on_a, ok=False)  # A wrote bad bytes over the copy
    assert out.live_corrupted and not out.newly_verified
    assert t.verified_bytes == 0
    _, disp = t.locate(h)
    assert disp is Disposition.IN_PLACE


def test_scratch_copy_failing_leaves_the_in_place_receive_alone() -> None:
    t = ReceiveTracker(BEGIN)
    h = hdr(1, 0)
    _, on_a = t.locate(h)
    _, on_b = t.locate(h)
    assert not t.finish(h, on_b, ok=False).newly_verified
    assert t.finish(h, on_a, ok=True).newly_verified


def test_abandon_lets_the_resend_go_in_place() -> None:
    t = ReceiveTracker(BEGIN)
    h = hdr(1, 2 * C)
    _, disp = t.locate(h)
    t.abandon(h, disp)
    _, disp = t.locate(h)
    assert disp is Disposition.IN_PLACE
    t.abandon(h, Disposition.SCRATCH)  # scratch receives hold no mark
    assert t.finish(h, disp, ok=True).newly_verified


def test_scratch_copy_after_the_in_place_receive_died() -> None:
    t = ReceiveTracker(BEGIN)
    h = hdr(1, 0)
    _, on_a = t.locate(h)
    _, on_b = t.locate(h)
    t.abandon(h, on_a)
    out = t.finish(h, on_b, ok=True)
    assert out.copy_from_scratch and out.newly_verified


def test_finish_without_locate_is_internal() -> None:
    t = ReceiveTracker(BEGIN)
    with pytest.raises(ProtocolError) as exc:
        t.finish(hdr(1, 0), Disposition.IN_PLACE, ok=True)
    assert exc.value.code == ErrorCode.INTERNAL


def test_large_request_is_compact_and_fast() -> None:
    size = 2 * 1024**3 // 64
    begin = Begin("big", (size,) * 64, 64 * 1024, (), 0, 1)  # 2 GiB at 64 KiB: 32768 cells
    t0 = time.perf_counter()
    t = ReceiveTracker(begin)
    s = SendTracker("big", begin.layer_sizes, begin.chunk_bytes)
    finished = 0
    for layer in range(64):
        for off, length in s.chunks(layer):
            h = ChunkHeader("big", layer, off, length, 0)
            _, disp = t.locate(h)
            finished += t.finish(h, disp, ok=True).request_done
            s.ack(layer, off)
    assert finished == 1 and t.complete and s.all_acked
    assert t.verified_bytes == s.acked_bytes == 2 * 1024**3
    assert time.perf_counter() - t0 < 2.0


# ---- sender side ------------------------------------------------------------------------------


def test_send_grid() -> None:
    s = SendTracker("r1", SIZES, C)
    assert s.chunks(0) == []
    assert s.chunks(1) == [(0, C), (C, C), (2 * C, C)]
    assert s.chunks(2) == [(0, C), (C, C), (2 * C, 100)]
    assert s.chunks(3) == [(0, 7)]
    assert s.total_bytes == sum(SIZES)


def test_acks() -> None:
    s = SendTracker("r1", SIZES, C)
    assert s.layer_acked(0)
    assert not s.all_acked
    for layer in (1, 2, 3):
        for off, _ in s.chunks(layer):
            assert not s.layer_acked(layer)
            assert s.ack(layer, off)
            assert not s.ack(layer, off)  # duplicate
        assert s.layer_acked(layer)
    assert s.all_acked
    assert s.acked_bytes == sum(SIZES)


@pytest.mark.parametrize(("layer", "offset"), [(0, 0), (1, 3 * C), (1, 1), (4, 0), (-1, 0)])
def test_off_grid_ack(layer: int, offset: int) -> None:
    s = SendTracker("r1", SIZES, C)
    with pytest.raises(ProtocolError) as exc:
        s.ack(layer, offset)
    assert exc.value.rid == "r1"
    assert s.acked_bytes == 0
