"""The writer's pure bookkeeping: budgets, layer order, checksum writes, immediates."""

from __future__ import annotations

import struct

import pytest
from xdc.transport.rdma.imm import ImmCodec
from xdc.transport.rdma.qpinfo import SlotGrant
from xdc.transport.rdma.verbs import Completion, Mr, RdmaLinkError, WcKind
from xdc.transport.rdma.writer import MAX_REWRITES, RdmaWriter

from xdc.protocol import Begin, chunk_checksum

BEGIN = Begin("r", (40_000, 10_000), 16384, (), 0, 0)  # chunks: 0,1,2 | 3
SRC_ADDR, STAGE_ADDR, REMOTE, SUMS = 0x10000, 0x90000, 0x500000, 0x600000


def _writer(every: int, phase: int, inflight: int = 4) -> tuple[RdmaWriter, bytearray, bytes]:
    data = bytes(range(256)) * 200
    staging = bytearray(8 * inflight)
    w = RdmaWriter(
        Mr(None, SRC_ADDR, 1 << 20, 11, 12),
        memoryview(staging),
        Mr(None, STAGE_ADDR, len(staging), 21, 22),
        rkey=99,
        max_inflight=inflight,
    )
    grant = SlotGrant("r", 5, REMOTE, BEGIN.total_bytes, SUMS, every, phase)
    w.add(BEGIN, grant, memoryview(data)[: BEGIN.total_bytes], SRC_ADDR)
    return w, staging, data


def test_layers_go_in_order_within_budget_with_checksums_first() -> None:
    w, staging, data = _writer(every=2, phase=1)
    assert w.next_writes() == []  # nothing handed over yet
    w.layer_ready("r", 0)
    with pytest.raises(ValueError, match="not awaiting hand-over"):
        w.layer_ready("r", 0)
    first = w.next_writes()
    # chunk 0 (not sampled), then chunk 1's checksum before chunk 1, then chunk 2: 4 in flight
    assert [(x.length, x.imm) for x in first] == [
        (16384, ImmCodec().encode(5, 0)),
        (8, None),
        (16384, ImmCodec().encode(5, 1)),
        (40_000 - 32768, ImmCodec().encode(5, 2)),
    ]
    assert first[1].raddr == SUMS + 8 * (1 // 2) and first[1].addr == STAGE_ADDR + 8 * 3
    (stored,) = struct.unpack_from("<Q", staging, 8 * 3)
    assert stored == chunk_checksum(data[16384:32768], "r", 0, 16384)
    assert first[2].raddr == REMOTE + 16384 and first[2].addr == SRC_ADDR + 16384
    assert w.inflight == 4
    w.layer_ready("r", 1)
    assert w.next_writes() == []  # budget full until completions arrive
    w.on_completion(Completion(first[0].wr_id, 0, WcKind.WRITE, 0, None))
    second = w.next_writes()  # chunk 3 is sampled (3 % 2 == 1): needs 2 slots, has 1
    assert second == []
    w.on_completion(Completion(first[1].wr_id, 0, WcKind.WRITE, 0, None))
    second = w.next_writes()
    assert [(x.length, x.imm) for x in second] == [(8, None), (10_000, ImmCodec().encode(5, 3))]
    for wr in first[2:] + second:
        w.on_completion(Completion(wr.wr_id, 0, WcKind.WRITE, 0, None))
    assert w.inflight == 0 and w.bytes_placed == 50_000
    assert w.unconfirmed("r")[:3] == [(0, 0, 16384), (0, 16384, 16384), (0, 32768, 40_000 - 32768)]
    w.on_layer_done("r", 0)
    assert w.unconfirmed("r") == [(1, 0, 10_000)]
    w.on_layer_done("r", 1)
    assert w.unconfirmed("r") == []


def test_nack_rewrites_first_then_gives_up() -> None:
    w, _staging, _data = _writer(every=0, phase=0, inflight=8)
    w.layer_ready("r", 0)
    w.layer_ready("r", 1)
    posted = w.next_writes()
    for wr in posted:
        w.on_completion(Completion(wr.wr_id, 0, WcKind.WRITE, 0, None))
    for _ in range(MAX_REWRITES):
        w.on_nack("r", 0, 16384)
        (again,) = w.next_writes()
        assert again.imm == ImmCodec().encode(5, 1)
        w.on_completion(Completion(again.wr_id, 0, WcKind.WRITE, 0, None))
    with pytest.raises(RdmaLinkError, match="4 times"):
        w.on_nack("r", 0, 16384)


def test_error_completion_and_complete_forget() -> None:
    w, _staging, _data = _writer(every=0, phase=0)
    w.layer_ready("r", 0)
    (a, _b, _c) = w.next_writes()
    with pytest.raises(RdmaLinkError, match="status 12"):
        w.on_completion(Completion(a.wr_id, 12, WcKind.OTHER, 0, None))
    with pytest.raises(RdmaLinkError, match="unknown work request"):
        w.on_completion(Completion(12345, 0, WcKind.WRITE, 0, None))
    w.on_complete("r")
    assert w.busy("r") and "r" in w.requests  # two writes still in flight: bytes in use
    assert w.abandon() == []
    w.clear()
    assert w.requests == {} and w.inflight == 0


def test_layers_from_separate_buffers_in_any_order() -> None:
    """The sender daemon allocates each layer on its own in the pool and may hand them over
    out of order: each chunk is read from its layer's buffer and lands at its place in the
    receiver's contiguous request buffer."""
    w, _staging, data = _writer(every=0, phase=0)
    req = w.requests["r"]
    req.contiguous = None  # as the daemon adds it: no contiguous copy of the request
    layer1 = memoryview(data)[41_000:51_000]  # anywhere inside the registered region
    with pytest.raises(ValueError, match="without its bytes"):
        w.layer_ready("r", 1)
    with pytest.raises(ValueError, match="not inside"):
        w.layer_ready("r", 1, layer1[:-1], SRC_ADDR + 41_000)
    with pytest.raises(ValueError, match="not inside"):
        w.layer_ready("r", 1, layer1, SRC_ADDR - 1)
    w.layer_ready("r", 1, layer1, SRC_ADDR + 41_000)
    (wr,) = w.next_writes()
    assert (wr.addr, wr.length, wr.raddr) == (SRC_ADDR + 41_000, 10_000, REMOTE + 40_000)
    assert w.layer_busy("r", 1) and not w.layer_busy("r", 0) and w.busy("r")
    w.on_completion(Completion(wr.wr_id, 0, WcKind.WRITE, 0, None))
    assert not w.layer_busy("r", 1)
    assert w.unconfirmed("r") == [(1, 0, 10_000)]
    w.layer_ready("r", 0, memoryview(data)[:40_000], SRC_ADDR)
    assert [x.raddr - REMOTE for x in w.next_writes()] == [0, 16384, 32768]
    assert w.unconfirmed("r")[0] == (0, 0, 16384)
