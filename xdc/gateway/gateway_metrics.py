"""The gateway's Prometheus metrics, on a registry of its own (several apps per process in
tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "xdc_gateway_requests",
            "Client requests answered, by what ran and the status",
            ["endpoint", "path", "source", "status"],
            registry=r,
        )
        self.router_fallbacks = Counter(
            "xdc_gateway_router_fallbacks",
            "Requests planned statically because the router could not be asked, by reason",
            ["reason"],
            registry=r,
        )
        self.route_keys = Counter(
            "xdc_gateway_route_prefix_partial",
            "Long prompts routed with part of their prefix information: keys for a leading "
            "part only (truncated), or the length alone (length_only: the router's key "
            "schemes could not be read)",
            ["kind"],
            registry=r,
        )
        self.router_rejections = Counter(
            "xdc_gateway_router_rejections",
            "Requests the router answered 429 (passed on)",
            registry=r,
        )
        self.prefill_failures = Counter(
            "xdc_gateway_prefill_failures",
            "Remote prefills that failed or missed their deadline (the decode instance "
            "prefilled instead), by reason",
            ["reason"],
            registry=r,
        )
        self.kv_recomputed = Counter(
            "xdc_gateway_kv_recomputed",
            "Remote plans whose decode instance prefilled itself after all (the KV did not "
            "come through xdc), by decode node and the connector's reason",
            ["decode", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "xdc_gateway_ttft_seconds",
            "Streamed requests: arrival to first token sent",
            ["path"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "xdc_gateway_prefill_seconds",
            "Remote prefills that handed their KV over: the prefill call's time (the PrfaaS "
            "engine's queue and prefill, as the gateway saw it), by prefill node",
            ["prefill"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "xdc_gateway_request_seconds",
            "Arrival to the last byte of the answer",
            ["path"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
