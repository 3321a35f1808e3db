"""The router's node picture between reports: bookings, reports, and decodes on their way."""

from __future__ import annotations

import pytest
from xdc.scheduler.nodes import NodeRegistry
from xdc.scheduler.profile import PD_CLUSTER


def _decode_loads(reg: NodeRegistry, now: float) -> dict[str, float]:
    return {n.name: n.load for n in reg.view(now).pd_decode}


def test_a_report_replaces_bookings_but_keeps_the_decodes_it_says_are_coming() -> None:
    """With admit = "complete" a decode waiting for its KV holds no blocks, so the engine's
    KV usage misses it; a report that cleared the bookings made its node look idle and the
    next requests all went there. The engine's count of them stays booked."""
    reg = NodeRegistry(decode_rate_rps=1.0, window_s=10.0)  # one booking = 0.1 load
    for name in ("d1", "d2"):
        reg.upsert(PD_CLUSTER, name, "decode", now=0.0, decode_load=0.0)
    for _ in range(3):
        reg.book(PD_CLUSTER, None, "d1", 0.0, now=0.0)
    assert _decode_loads(reg, 0.0)["d1"] == pytest.approx(0.3)
    reg.upsert(PD_CLUSTER, "d1", "decode", now=1.0, decode_load=0.0, decode_waiting=3)
    reg.upsert(PD_CLUSTER, "d2", "decode", now=1.0, decode_load=0.05, decode_waiting=0)
    loads = _decode_loads(reg, 1.0)
    assert loads["d1"] == pytest.approx(0.3) and loads["d2"] == pytest.approx(0.05)
    reg.book(PD_CLUSTER, None, "d1", 0.0, now=1.5)  # counted on top, not twice
    assert _decode_loads(reg, 1.5)["d1"] == pytest.approx(0.4)
    # a report without the count (an engine that does not export it) clears as before
    reg.upsert(PD_CLUSTER, "d1", "decode", now=2.0, decode_load=0.0)
    assert _decode_loads(reg, 2.0)["d1"] == 0.0
    # and the bookings age out of the window like any
    reg.upsert(PD_CLUSTER, "d1", "decode", now=3.0, decode_load=0.0, decode_waiting=2)
    assert _decode_loads(reg, 12.9)["d1"] == pytest.approx(0.2)
    assert _decode_loads(reg, 13.1)["d1"] == 0.0


def test_a_reported_backlog_counts_down_evenly_and_costs_one_count() -> None:
    """A PrfaaS engine's report of its backlog (``queue_depth`` requests over ``queue_s``)
    finishes one request every ``queue_s / queue_depth`` seconds; the router keeps it as one
    count, so a report of 10^6 (the API's limit) costs what a report of 1 does. Bookings
    made after the report add to it; the next report replaces both."""
    reg = NodeRegistry(decode_rate_rps=1.0)
    node = reg.upsert("prfaas", "p1", "prefill", now=100.0, queue_s=10.0, queue_depth=1_000_000)
    assert not node.pending
    assert reg.view(100.0).prfaas_queue_depth == 1_000_000
    assert node.queue_depth(100.0 + 10.0 * 0.25) == 750_000
    assert node.queue_depth(109.999995) == 1  # the last finishes at the end of the span
    assert node.queue_depth(110.0) == 0
    node = reg.upsert("prfaas", "p1", "prefill", now=200.0, queue_s=4.0, queue_depth=4)
    reg.book("prfaas", "p1", None, 2.0, now=200.0)  # after the backlog: done at 206
    times = (200.0, 200.5, 201.0, 203.5, 204.0, 205.9, 206.0)
    assert [node.queue_depth(t) for t in times] == [5, 5, 4, 2, 1, 1, 0]
    reg.book("prfaas", "p1", None, 2.0, now=201.0)
    node = reg.upsert("prfaas", "p1", "prefill", now=202.0, queue_s=0.0, queue_depth=0)
    assert node.queue_depth(202.0) == 0 and reg.view(202.0).prfaas_queue_depth == 0
    # a queue time without a depth is one request
    node = reg.upsert("prfaas", "p1", "prefill", now=300.0, queue_s=3.0)
    assert [node.queue_depth(t) for t in (300.0, 302.9, 303.0)] == [1, 1, 0]
