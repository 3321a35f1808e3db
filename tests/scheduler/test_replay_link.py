"""The replay simulator's link: a fluid max-min fair pipe with producer-limited flows.

Expected times below are worked out by hand from the flow sizes and rates in each test.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.sim.link import FluidLink

GB = 1e9


def drain(link: FluidLink, until: float = math.inf) -> dict[int, float]:
    """Run the link's own events to completion; key -> finish time."""
    done: dict[int, float] = {}
    while math.isfinite(link.next_event()) and link.next_event() <= until:
        t = link.next_event()
        for k in link.advance(t):
            done[k] = t
    return done


def test_flow_that_keeps_up_finishes_when_production_ends() -> None:
    # 1 GB produced over 2 s is 4 Gbps: a 10 Gbps link keeps up, the transfer is hidden.
    link = FluidLink(10 * GB)
    link.add_flow(0.0, 1, 1 * GB, 2.0)
    assert link.throughput_bps() == pytest.approx(4 * GB)
    assert link.backlog_bytes() == 0
    assert drain(link) == {1: pytest.approx(2.0)}
    assert link.bytes_sent == pytest.approx(1 * GB)


def test_overloaded_link_shares_fairly_and_conserves_work() -> None:
    # Three 4 Gbps producers on 10 Gbps: all fall behind, 3 GB take 2.4 s.
    link = FluidLink(10 * GB)
    for k in range(3):
        link.add_flow(0.0, k, 1 * GB, 2.0)
    assert link.throughput_bps() == pytest.approx(10 * GB)
    link.advance(1.0)
    # Produced 1.5 GB, sent 1.25 GB (1.25 GB/s for 1 s).
    assert link.backlog_bytes() == pytest.approx(0.25 * GB)
    assert drain(link) == {k: pytest.approx(2.4) for k in range(3)}


def test_slow_producer_gets_its_rate_and_backlogged_flow_the_rest() -> None:
    # 8 Gbps link. A 10 GB cache move (all data ready) alone for 1 s sends 1 GB; then a
    # 1 GB KV stream produced at 2 Gbps for 4 s takes 0.25 GB/s (below the 0.5 GB/s fair
    # share) and finishes with its producer at 5 s; the cache move gets 0.75 GB/s meanwhile
    # (3 GB) and its last 6 GB at the full 1 GB/s: done at 11 s.
    link = FluidLink(8 * GB)
    link.add_flow(0.0, 1, 10 * GB, 0.0)
    link.add_flow(1.0, 2, 1 * GB, 4.0)
    assert drain(link) == {2: pytest.approx(5.0), 1: pytest.approx(11.0)}


def test_backlogged_flow_catches_up_with_its_producer() -> None:
    # 8 Gbps = 1 GB/s. X: 2 GB ready at once. Y: 4.8 GB produced over 8 s (0.6 GB/s). The
    # fair share 0.5 GB/s is below Y's production, so both are backlogged: X is done at 4 s,
    # when Y has sent 2.0 of 2.4 GB produced. Alone, Y runs at 1 GB/s and closes the 0.4 GB
    # gap at 0.4 / (1 - 0.6) = 1 s, i.e. at 5 s; from then on it keeps pace and ends at 8 s.
    link = FluidLink(8 * GB)
    link.add_flow(0.0, 1, 2 * GB)
    link.add_flow(0.0, 2, 4.8 * GB, 8.0)
    assert link.next_event() == pytest.approx(4.0)
    assert link.advance(4.0) == [1]
    link.advance(4.5)
    assert link.backlog_bytes() == pytest.approx(0.2 * GB)
    assert link.next_event() == pytest.approx(5.0)
    link.advance(5.5)
    assert link.backlog_bytes() == pytest.approx(0.0, abs=1.0)
    assert link.throughput_bps() == pytest.approx(4.8 * GB)
    assert drain(link) == {2: pytest.approx(8.0)}


def test_capacity_change_mid_transfer() -> None:
    # 2 GB ready at 8 Gbps: 1 GB by 1 s; then 2 Gbps: the other 1 GB takes 4 s more.
    link = FluidLink(8 * GB)
    link.add_flow(0.0, 1, 2 * GB)
    assert link.set_capacity(1.0, 2 * GB) == []
    assert drain(link) == {1: pytest.approx(5.0)}
    assert link.capacity_bits == pytest.approx(8 * GB * 1 + 2 * GB * 4)


def test_zero_capacity_stalls_until_restored() -> None:
    link = FluidLink(0.0)
    link.add_flow(0.0, 1, 1 * GB)
    assert math.isinf(link.next_event())
    assert link.advance(100.0) == []
    assert link.backlog_bytes() == pytest.approx(1 * GB)
    link.set_capacity(100.0, 8 * GB)
    assert drain(link) == {1: pytest.approx(101.0)}


def test_zero_byte_flow_finishes_at_once_and_duplicate_keys_are_refused() -> None:
    link = FluidLink(1 * GB)
    assert link.add_flow(0.0, 7, 0.0, 1.0) == [7]
    link.add_flow(0.0, 8, 1.0, 1.0)
    with pytest.raises(ValueError, match="already"):
        link.add_flow(0.0, 8, 1.0, 1.0)
    with pytest.raises(ValueError, match="backwards"):
        link.advance(-1.0)


flows = st.lists(
    st.tuples(
        st.floats(0.0, 20.0),  # start
        st.floats(1e6, 5e9),  # bytes
        st.floats(0.0, 5.0),  # production seconds
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(flows, st.floats(1e8, 1e11))
def test_invariants_hold_for_any_flow_mix(
    spec: list[tuple[float, float, float]], cap: float
) -> None:
    """Never above capacity, never ahead of production, every byte delivered exactly once."""
    link = FluidLink(cap)
    spec = sorted(spec)
    finish: dict[int, float] = {}
    for key, (start, nbytes, produce) in enumerate(spec):
        while link.next_event() <= start:
            t = link.next_event()
            finish.update({k: t for k in link.advance(t)})
        finish.update({k: start for k in link.add_flow(start, key, nbytes, produce)})
        assert link.bytes_sent <= link.capacity_bits / 8 * (1 + 1e-9) + 1.0
    finish.update(drain(link))
    assert set(finish) == set(range(len(spec)))
    total = sum(b for _, b, _ in spec)
    assert link.bytes_sent == pytest.approx(total, rel=1e-9)
    first = spec[0][0]
    # Work conservation: the last byte cannot leave before total / capacity after the start.
    assert max(finish.values()) >= first + total * 8 / cap * (1 - 1e-9)
    for key, (start, nbytes, produce) in enumerate(spec):
        # A flow ends no earlier than its producer and no faster than the whole link.
        assert finish[key] >= start + produce - 1e-9
        assert finish[key] >= start + nbytes * 8 / cap * (1 - 1e-9) - 1e-9
