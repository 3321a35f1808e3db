"""Prometheus metrics of the daemons, each on its own registry so several daemons (or tests)
can live in one process without colliding on metric names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ReceiverMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.connections = Gauge("xdc_receiver_connections", "open data connections", registry=r)
        self.requests = Counter(
            "xdc_receiver_requests", "requests by outcome", ["outcome"], registry=r
        )
        self.bytes_received = Counter(
            "xdc_receiver_bytes", "verified payload bytes received", registry=r
        )
        self.checksum_failures = Counter(
            "xdc_receiver_checksum_failures", "chunks rejected by checksum", registry=r
        )
        self.protocol_errors = Counter(
            "xdc_receiver_protocol_errors", "request-scoped protocol errors", ["code"], registry=r
        )
        self.rejected_connections = Counter(
            "xdc_receiver_rejected_connections", "connections refused", ["reason"], registry=r
        )
        self.superseded_connections = Counter(
            "xdc_receiver_superseded_connections",
            "connections closed because their sender opened them again",
            registry=r,
        )
        self.rejected_chunks = Counter(
            "xdc_receiver_declined_chunks",
            "chunk payloads declined (the sender resends them)",
            ["reason"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "xdc_receiver_transfer_seconds",
            "BEGIN to last verified byte",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )


class SenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.connections = Gauge("xdc_sender_connections", "live data connections", registry=r)
        self.requests = Counter(
            "xdc_sender_requests", "requests by outcome", ["outcome"], registry=r
        )
        self.bytes_sent = Counter(
            "xdc_sender_bytes", "payload bytes sent (with resends)", registry=r
        )
        self.resent_chunks = Counter(
            "xdc_sender_resent_chunks", "chunks sent again after a loss or NACK", registry=r
        )
        self.connection_failures = Counter(
            "xdc_sender_connection_failures", "data connections lost", ["reason"], registry=r
        )
        self.transfer_seconds = Histogram(
            "xdc_sender_transfer_seconds",
            "BEGIN to all chunks acked",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.tail_seconds = Histogram(
            "xdc_sender_tail_seconds",
            "last layer handed over to all chunks acked",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )
        self.pool_used = Gauge("xdc_sender_pool_used_bytes", "send pool bytes in use", registry=r)
        self.chunks_per_send = Histogram(
            "xdc_sender_chunks_per_send",
            "chunks a connection sent in one write (with data threads: one thread hand-off)",
            buckets=(1, 2, 4, 8, 16, 64),
            registry=r,
        )
