"""Prometheus view of the link snapshots: every signal as ``xdc_link_*``, labelled by peer.

The metrics live on a registry the daemon owns (never the global one), so several daemons in
one test process, or two peers in one daemon, never collide. Times are exported in seconds
as Prometheus expects; everything else keeps the name and unit of its ``to_json`` key.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge
from xdc.monitor.link_estimator import LinkSnapshot

from xdc.linkreport import LinkCause, LinkHealth

_GAUGES: dict[str, str] = {
    "goodput_bps": "newly acknowledged payload, bits/s",
    "delivery_rate_bps": "sum of the kernel's delivery-rate estimates of active sockets, bits/s",
    "capacity_bps": "configured or measured (windowed p90 of goodput) link capacity, bits/s",
    "utilisation": "goodput / capacity",
    "retrans_ratio": "retransmitted / sent bytes in the last interval",
    "rtt_inflation": "srtt / max(min_rtt, floor)",
    "rwnd_limited_frac": "share of busy time limited by the peer's receive window",
    "sndbuf_limited_frac": "share of busy time limited by the local send buffer",
    "sockets": "sockets sampled",
    "active_sockets": "sockets that sent data in the last interval",
    "lost_packets": "packets currently considered lost (sum of tcpi_lost)",
    "rto_sockets": "sockets in RTO recovery (CA_Loss)",
    "cwnd_packets": "sum of congestion windows, packets",
    "pacing_rate_bps": "sum of the kernel's per-socket pacing rates, bits/s",
    "notsent_bytes": "bytes queued in send buffers not yet sent",
    "host_retrans_ratio": "host-wide RetransSegs / OutSegs in the last interval",
    "ce_ratio": "share of delivered packets echoed Congestion Experienced (ECN)",
}
_SECONDS: dict[str, str] = {
    "rtt_ms": "smoothed RTT of active sockets (weighted by acked bytes)",
    "min_rtt_ms": "minimum RTT seen by any socket",
    "rttvar_ms": "RTT variance of active sockets",
    "queue_ms": "smoothed RTT over min RTT: the delay the bottleneck queue adds",
}
_COUNTERS: dict[str, str] = {
    "sent_bytes": "payload bytes sent, retransmits included",
    "acked_bytes": "payload bytes acknowledged",
    "retrans_bytes": "payload bytes retransmitted",
    "host_timeouts": "host-wide TCP retransmission timeouts",
}


class LinkMetrics:
    """Gauges and counters for one daemon's links; call ``observe`` with every snapshot."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["peer"]
        self.gauges = {
            k: Gauge(f"xdc_link_{k}", h, labels, registry=registry) for k, h in _GAUGES.items()
        }
        self.seconds = {
            k: Gauge(f"xdc_link_{k.removesuffix('_ms')}_seconds", h, labels, registry=registry)
            for k, h in _SECONDS.items()
        }
        self.counters = {
            k: Counter(f"xdc_link_{k}", h, labels, registry=registry) for k, h in _COUNTERS.items()
        }
        self.state = Gauge(
            "xdc_link_state",
            "1 for the link's current state (ok, warn, congested), 0 for the others",
            ["peer", "state"],
            registry=registry,
        )
        self.cause = Gauge(
            "xdc_link_cause",
            "1 for why the link is in its state (clear, queue, ecn, random_loss, stall), 0 for "
            "the others; random_loss is loss without queueing, reported with state ok",
            ["peer", "cause"],
            registry=registry,
        )
        self.sample_state = Gauge(
            "xdc_link_sample_state",
            "level of the last interval alone, before hysteresis: 0 ok, 1 warn, 2 congested",
            labels,
            registry=registry,
        )
        self.transitions = Counter(
            "xdc_link_state_transitions",
            "state changes, by the state entered",
            ["peer", "to"],
            registry=registry,
        )
        self.pacing_limit = Gauge(
            "xdc_link_pacing_limit_bps",
            "aggregate pacing limit applied by the AIMD controller, bits/s (0 = unlimited)",
            labels,
            registry=registry,
        )
        self._last_state: dict[str, LinkHealth] = {}

    def observe(self, snap: LinkSnapshot, peer: str = "default") -> None:
        data = snap.to_json()
        for k, g in self.gauges.items():
            v = data[k]
            g.labels(peer).set(float("nan") if v is None else float(v))
        for k, g in self.seconds.items():
            v = data[k]
            g.labels(peer).set(float("nan") if v is None else float(v) / 1000.0)
        for k, c in self.counters.items():
            c.labels(peer).inc(max(0, int(data[k])))
        for st in LinkHealth:
            self.state.labels(peer, st.value).set(1.0 if st is snap.state else 0.0)
        self.sample_state.labels(peer).set(snap.sample_state.rank)
        for cause in LinkCause:
            self.cause.labels(peer, cause.value).set(1.0 if cause is snap.cause else 0.0)
        prev = self._last_state.get(peer)
        if prev is not None and prev is not snap.state:
            self.transitions.labels(peer, snap.state.value).inc()
        self._last_state[peer] = snap.state

    def observe_pacing(self, rate_bps: int | None, peer: str = "default") -> None:
        self.pacing_limit.labels(peer).set(0.0 if rate_bps is None else float(rate_bps))
