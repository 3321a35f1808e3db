"""Prometheus metrics for one router app, on a registry of its own.

A per-app CollectorRegistry (not the process-global default) lets tests and benchmarks run
several routers in one process without "duplicated timeseries" errors, and keeps /metrics to
what this router did. Hot-path children (``labels(...)``) are resolved once up front, since
label lookup costs more than the increment itself.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from xdc.scheduler.link_table import LinkView
from xdc.scheduler.longterm import Recommendation
from xdc.scheduler.policy import Decision
from xdc.scheduler.vllm_events import VllmKvEventSource

OFFLOAD_WINDOW = 1000
_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.1,
)
_TTFT_BUCKETS = (0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60)

__all__ = ["CONTENT_TYPE", "RouterMetrics"]


class RouterMetrics:
    """Every metric the router exports; ``render()`` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter(
            "xdc_router_decisions", "Accepted routing decisions by target", ["target"], registry=r
        )
        self.rejections = Counter(
            "xdc_router_rejections", "Requests answered 429, by cause", ["cause"], registry=r
        )
        self.cache_transfers = Counter(
            "xdc_router_cache_transfers",
            "Decisions that include a cross-cluster prefix transfer",
            ["source", "dest"],
            registry=r,
        )
        self.offload_fraction = Gauge(
            "xdc_router_offload_fraction",
            f"Fraction of the last {OFFLOAD_WINDOW} accepted decisions sent to PrfaaS",
            registry=r,
        )
        self.route_seconds = Histogram(
            "xdc_router_route_seconds",
            "In-process time to decide one request (match + policy)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "xdc_router_predicted_ttft_seconds",
            "Predicted TTFT of accepted decisions",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.threshold = Gauge(
            "xdc_router_threshold_tokens",
            "Routing threshold t in uncached tokens (-1 = infinite: nothing offloads)",
            ["kind"],
            registry=r,
        )
        self.profile_drift = Gauge(
            "xdc_router_profile_drift",
            "Prefill time the engines report over the profile's, per instance type, as the "
            "last replan applied it (1 = as profiled)",
            ["instance"],
            registry=r,
        )
        self.scarce = Gauge(
            "xdc_router_bandwidth_scarce", "1 if the last decision saw scarce bandwidth", registry=r
        )
        self.link_utilisation = Gauge(
            "xdc_router_link_utilisation",
            "Combined utilisation of each PrfaaS egress link (all its senders)",
            ["link"],
            registry=r,
        )
        self.link_goodput = Gauge(
            "xdc_router_link_goodput_bps",
            "Summed goodput of a link's senders",
            ["link"],
            registry=r,
        )
        self.link_capacity = Gauge(
            "xdc_router_link_capacity_bps",
            "Capacity estimate for the whole link",
            ["link"],
            registry=r,
        )
        self.link_reporters = Gauge(
            "xdc_router_link_reporters", "Live senders reporting on a link", ["link"], registry=r
        )
        self.link_state = Gauge(
            "xdc_router_link_state",
            "1 for the combined state of each link (worst of its senders)",
            ["link", "state"],
            registry=r,
        )
        self.failures = Counter(
            "xdc_router_kv_failures",
            "Remote plans whose KV did not reach the decode node (the gateway's reports), by "
            "link, decode node, reason and what the router blamed (link, intake, none)",
            ["link", "decode", "reason", "blamed"],
            registry=r,
        )
        self.link_down = Gauge(
            "xdc_router_link_down",
            "1 while nothing is offloaded over the link (dark, or failures reported)",
            ["link"],
            registry=r,
        )
        self.intake_down = Gauge(
            "xdc_router_decode_intake_down",
            "1 while no offloaded KV is sent to the decode node (its receiver failed)",
            ["decode"],
            registry=r,
        )
        self.replication_up = Gauge(
            "xdc_router_replication_up",
            "1 while the shared state (Redis) is reachable; 0 = routing on the last state",
            registry=r,
        )
        self.replication_leader = Gauge(
            "xdc_router_replication_leader",
            "1 while this replica runs the threshold controller and the planner",
            registry=r,
        )
        self.replication_lag = Gauge(
            "xdc_router_replication_outbox",
            "Local inputs not yet written to the shared state",
            registry=r,
        )
        self.replication_errors = Counter(
            "xdc_router_replication_errors", "Failed operations on the shared state", registry=r
        )
        self.replication_applied = Counter(
            "xdc_router_replication_applied",
            "Inputs from other replicas applied, by kind",
            ["kind"],
            registry=r,
        )
        self.cache_entries = Gauge(
            "xdc_router_cache_index_entries",
            "(node, block) entries in the prefix index",
            registry=r,
        )
        self.cache_events = Counter(
            "xdc_router_cache_events", "Cache events received, by effect", ["effect"], registry=r
        )
        self.bad_requests = Counter(
            "xdc_router_http_client_errors", "4xx answers by status", ["status"], registry=r
        )
        self.server_errors = Counter(
            "xdc_router_http_server_errors", "Unexpected errors answered 500", registry=r
        )
        self.replans = Counter("xdc_router_replans", "Long-term replans run", registry=r)
        self.rec_nodes = Gauge(
            "xdc_router_recommended_nodes",
            "Recommended PD node counts by role",
            ["role"],
            registry=r,
        )
        self.rec_role_changes = Gauge(
            "xdc_router_recommended_role_changes",
            "Role changes in the latest recommendation, by new role",
            ["to_role"],
            registry=r,
        )
        self.rec_lambda = Gauge(
            "xdc_router_recommended_lambda_max",
            "Lambda_max (req/s) at the recommended split",
            registry=r,
        )
        self._by_target: dict[str, Counter] = {}
        self._reject_slo = self.rejections.labels("ttft_slo")
        self._reject_decode = self.rejections.labels("decode_capacity")
        self._recent: deque[bool] = deque(maxlen=OFFLOAD_WINDOW)
        self._offloaded = 0
        self._scarce = 0.0
        # Gauges that change with every decision are read when scraped, not set per request.
        self.offload_fraction.set_function(
            lambda: self._offloaded / len(self._recent) if self._recent else 0.0
        )
        self.scarce.set_function(lambda: self._scarce)

    def watch_threshold(self, base: Callable[[], float], effective: Callable[[], float]) -> None:
        """Report the router's current thresholds at scrape time."""
        self.threshold.labels("base").set_function(lambda: _t(base()))
        self.threshold.labels("effective").set_function(lambda: _t(effective()))

    def record(self, d: Decision, seconds: float) -> None:
        self.route_seconds.observe(seconds)
        self._scarce = 1.0 if d.mode == "scarce" else 0.0
        if d.rejected:
            if d.decode_node is None:
                self._reject_decode.inc()
            else:
                self._reject_slo.inc()
            return
        child = self._by_target.get(d.target)
        if child is None:
            child = self._by_target[d.target] = self.decisions.labels(d.target)
        child.inc()
        if math.isfinite(d.predicted_ttft_s):
            self.ttft.observe(d.predicted_ttft_s)
        if d.cache_transfer is not None:
            x = d.cache_transfer
            self.cache_transfers.labels(x.source_cluster, x.dest_cluster).inc()
        off = d.target != "pd"
        if len(self._recent) == self._recent.maxlen:
            self._offloaded -= self._recent[0]
        self._recent.append(off)
        self._offloaded += off

    def record_link(self, link: str, view: LinkView | None) -> None:
        """The combined state of ``link`` after a report (None: no live sender)."""
        self.link_utilisation.labels(link).set(view.utilisation if view else 0.0)
        self.link_goodput.labels(link).set(view.goodput_bps if view else 0.0)
        self.link_capacity.labels(link).set(view.capacity_bps if view else 0.0)
        self.link_reporters.labels(link).set(view.reporters if view else 0)
        for s in ("ok", "warn", "congested"):
            self.link_state.labels(link, s).set(1 if view is not None and s == view.state else 0)

    def record_recommendation(self, rec: Recommendation) -> None:
        self.replans.inc()
        self.rec_nodes.labels("prefill").set(rec.n_p)
        self.rec_nodes.labels("decode").set(rec.n_d)
        self.rec_lambda.set(rec.lambda_max)
        to_p = sum(1 for c in rec.role_changes if c.to_role == "prefill")
        self.rec_role_changes.labels("prefill").set(to_p)
        self.rec_role_changes.labels("decode").set(len(rec.role_changes) - to_p)

    def watch_vllm_sources(self, sources: Sequence[VllmKvEventSource]) -> None:
        """Export each vLLM KV-event source's counts (batches, events, gaps, malformed...)."""
        if sources:
            self.registry.register(_VllmSourceCollector(sources))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmSourceCollector(Collector):
    def __init__(self, sources: Sequence[VllmKvEventSource]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "xdc_router_vllm_events",
            "vLLM KV-event stream, per engine and outcome (batches, events applied, gaps, "
            "missed, malformed, duplicate, restarts, replays, dropped_<reason>)",
            labels=["node", "outcome"],
        )
        for s in self.sources:
            node = f"{s.endpoint.cluster}/{s.endpoint.node}"
            counts = dict(s.counts)
            counts.update({f"dropped_{k}": v for k, v in s.translator.dropped.items()})
            for outcome, n in sorted(counts.items()):
                fam.add_metric([node, outcome], n)
        yield fam


def _t(t: float) -> float:
    return t if math.isfinite(t) else -1.0
