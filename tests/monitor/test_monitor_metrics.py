"""Prometheus export of link snapshots, read back through the text exposition format."""

from __future__ import annotations

import dataclasses
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from xdc.monitor.link_estimator import LinkSnapshot
from xdc.monitor.link_metrics import LinkMetrics

from xdc.linkreport import LinkHealth

SNAP = LinkSnapshot(
    t=1.0,
    updated_at=1700000000.0,
    interval_s=0.1,
    sockets=8,
    active_sockets=6,
    goodput_bps=750e6,
    delivery_rate_bps=800e6,
    capacity_bps=1e9,
    capacity_source="configured",
    utilisation=0.75,
    sent_bytes=10_000_000,
    acked_bytes=9_375_000,
    retrans_bytes=50_000,
    retrans_ratio=0.005,
    rtt_ms=12.5,
    min_rtt_ms=10.0,
    rttvar_ms=1.5,
    rtt_inflation=1.25,
    rwnd_limited_frac=0.1,
    sndbuf_limited_frac=0.0,
    lost_packets=3,
    rto_sockets=0,
    cwnd_packets=400,
    pacing_rate_bps=900e6,
    notsent_bytes=4096,
    host_retrans_ratio=None,
    host_timeouts=1,
    sample_state=LinkHealth.WARN,
    state=LinkHealth.OK,
)


def samples(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def val(reg: CollectorRegistry, name: str, **labels: str) -> float:
    return samples(reg)[(name, tuple(sorted(labels.items())))]


def test_every_signal_is_exported_with_its_value() -> None:
    reg = CollectorRegistry()
    m = LinkMetrics(reg)
    m.observe(SNAP, peer="dc-b")
    assert val(reg, "xdc_link_goodput_bps", peer="dc-b") == 750e6
    assert val(reg, "xdc_link_utilisation", peer="dc-b") == 0.75
    assert val(reg, "xdc_link_retrans_ratio", peer="dc-b") == 0.005
    assert val(reg, "xdc_link_rtt_seconds", peer="dc-b") == 0.0125
    assert val(reg, "xdc_link_min_rtt_seconds", peer="dc-b") == 0.010
    assert val(reg, "xdc_link_rtt_inflation", peer="dc-b") == 1.25
    assert val(reg, "xdc_link_rwnd_limited_frac", peer="dc-b") == 0.1
    assert val(reg, "xdc_link_sent_bytes_total", peer="dc-b") == 10_000_000
    assert val(reg, "xdc_link_sample_state", peer="dc-b") == 1
    assert math.isnan(val(reg, "xdc_link_host_retrans_ratio", peer="dc-b"))
    names = {n for n, _ in samples(reg)}
    for key in SNAP.to_json():
        if key in ("t", "updated_at", "interval_s", "capacity_source", "state"):
            continue
        base = key.removesuffix("_ms") + "_seconds" if key.endswith("_ms") else key
        assert any(n.startswith(f"xdc_link_{base}") for n in names), key


def test_state_is_one_hot_and_transitions_are_counted() -> None:
    reg = CollectorRegistry()
    m = LinkMetrics(reg)
    m.observe(SNAP, peer="p")
    assert val(reg, "xdc_link_state", peer="p", state="ok") == 1
    assert val(reg, "xdc_link_state", peer="p", state="congested") == 0
    m.observe(dataclasses.replace(SNAP, state=LinkHealth.CONGESTED), peer="p")
    m.observe(dataclasses.replace(SNAP, state=LinkHealth.CONGESTED), peer="p")
    m.observe(SNAP, peer="p")
    assert val(reg, "xdc_link_state", peer="p", state="ok") == 1
    assert val(reg, "xdc_link_state", peer="p", state="congested") == 0
    assert val(reg, "xdc_link_state_transitions_total", peer="p", to="congested") == 1
    assert val(reg, "xdc_link_state_transitions_total", peer="p", to="ok") == 1


def test_counters_accumulate_per_peer_and_rtt_none_is_nan() -> None:
    reg = CollectorRegistry()
    m = LinkMetrics(reg)
    m.observe(SNAP, peer="a")
    m.observe(SNAP, peer="a")
    m.observe(dataclasses.replace(SNAP, rtt_ms=None), peer="b")
    assert val(reg, "xdc_link_retrans_bytes_total", peer="a") == 100_000
    assert val(reg, "xdc_link_retrans_bytes_total", peer="b") == 50_000
    assert math.isnan(val(reg, "xdc_link_rtt_seconds", peer="b"))


def test_pacing_limit_and_separate_registries() -> None:
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    m1, m2 = LinkMetrics(r1), LinkMetrics(r2)  # no "duplicated timeseries" across daemons
    m1.observe_pacing(300_000_000)
    m2.observe_pacing(None)
    assert val(r1, "xdc_link_pacing_limit_bps", peer="default") == 300e6
    assert val(r2, "xdc_link_pacing_limit_bps", peer="default") == 0


def test_a_sender_with_several_receivers_reports_a_share_per_receiver() -> None:
    """Each decode node's receiver is a share of the same PrfaaS -> PD link: the router must
    sum them, so each gets a reporter name of its own (the sender's own peer keeps node.id)."""
    from xdc.transport.linkmon import router_link_body

    from xdc.config import Config

    cfg = Config()
    cfg.node.id, cfg.node.cluster = "tx-1", "prfaas"
    cfg.sender.peer_host, cfg.sender.peer_port, cfg.sender.peer_cluster = "10.0.0.2", 7070, "pd"
    own = router_link_body(SNAP, cfg, "10.0.0.2:7070")
    other = router_link_body(SNAP, cfg, "10.0.0.3:7070")
    assert (own["reporter"], other["reporter"]) == ("tx-1", "tx-1>10.0.0.3:7070")
    assert own["from_cluster"] == other["from_cluster"] == "prfaas"
    assert router_link_body(SNAP, cfg)["reporter"] == "tx-1"
