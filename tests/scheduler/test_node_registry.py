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
