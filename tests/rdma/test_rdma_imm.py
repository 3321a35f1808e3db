"""Immediate-data codec and the chunk grid, checked against the protocol's own tracker."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xdc.transport.rdma.imm import ImmCodec, sampled, sum_slots


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


def test_sampling_covers_one_in_every() -> None:
    picks = [i for i in range(100) if sampled(i, 8, 3)]
    assert picks == list(range(3, 100, 8))
    assert {i // 8 for i in picks} == set(range(sum_slots(100, 8) - 1)) | {picks[-1] // 8}
    assert not any(sampled(i, 0, 0) for i in range(10))
    assert sum_slots(100, 0) == 0 and sum_slots(100, 1) == 100
