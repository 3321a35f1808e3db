"""Congestion monitoring for one peer of the sender: samples the peer's live data sockets
(TCP_INFO), keeps the link state, paces the sockets so that they do not build a standing
queue at the bottleneck (never for random loss: see monitor.pacing), and publishes the
state to the router.

Everything here runs beside the data path, never in it: a slow or dead router only costs a
logged warning, and sampling is a few getsockopt calls per tick.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import trio
from xdc.monitor.link_estimator import LinkSnapshot
from xdc.monitor.link_metrics import LinkMetrics
from xdc.monitor.pacing import PacingController
from xdc.monitor.sampler import run_sampler

from xdc.config import Config
from xdc.linkreport import MAX_REPORTER, LinkHealth, LinkId

log = logging.getLogger("xdc.linkmon")


def router_link_body(snap: LinkSnapshot, cfg: Config, peer: str = "") -> dict[str, Any]:
    """The router's /v1/links body: this sender's share of its link, named by the clusters at
    both ends (node.cluster -> sender.peer_cluster) and reported as node.id (one shared type,
    ``xdc.linkreport.LinkReport``). A sender that ships to several receivers (decode nodes)
    has a share per receiver on the same link: each other than its own ``peer_host:port``
    reports as ``node.id>host:port``, so the router sums them instead of keeping whichever
    came last."""
    link = LinkId(cfg.node.cluster, cfg.sender.peer_cluster)
    own = f"{cfg.sender.peer_host}:{cfg.sender.peer_port}"
    reporter = cfg.node.id if not peer or peer == own else f"{cfg.node.id}>{peer}"
    return snap.report(link, reporter[:MAX_REPORTER]).to_json()


async def http_post_json(url: str, body: dict[str, Any], token: str, timeout: float) -> int:
    """POST JSON with a bearer token over plain HTTP/1.1; returns the status code.

    The daemons are trio programs; this small client avoids a second event loop for one
    request a second. (TLS to the router is configured by terminating in front of it.)
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"router url must be http://host:port/..., got {url!r}")
    port = parts.port or 80
    path = parts.path or "/"
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        + (f"Authorization: Bearer {token}\r\n" if token else "")
        + "Connection: close\r\n\r\n"
    )
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream(parts.hostname, port)
        async with stream:
            await stream.send_all(head.encode() + data)
            reply = b""
            while b"\r\n" not in reply and len(reply) < 4096:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                reply += chunk
    status_line = reply.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise ValueError(f"router sent no HTTP status line: {reply[:80]!r}")
    return int(status_line[1])


class PeerMonitor:
    def __init__(
        self,
        peer_name: str,
        cfg: Config,
        sockets: Callable[[], Sequence[Any]],
        apply_pacing: Callable[[int], None],
        metrics: LinkMetrics,
    ) -> None:
        self.peer_name = peer_name
        self.cfg = cfg
        self.sockets = sockets
        self.apply_pacing = apply_pacing
        self.metrics = metrics
        self.pacer = PacingController() if cfg.sender.congestion_control else None
        self.snapshot: LinkSnapshot | None = None
        self.rate_bps: int | None = None
        self.transitions: list[tuple[float, str]] = []
        self.publish_failures = 0
        self._changed = trio.Event()
        self._last_warn = 0.0

    async def run(self) -> None:
        async with trio.open_nursery() as n:
            n.start_soon(self._sample)
            if self.cfg.monitor.router_url:
                n.start_soon(self._publish_loop)

    async def _sample(self) -> None:
        await run_sampler(self.sockets, self.cfg.monitor, self.on_snapshot)

    def on_snapshot(self, snap: LinkSnapshot) -> None:
        prev = self.snapshot.state if self.snapshot is not None else LinkHealth.OK
        self.snapshot = snap
        self.metrics.observe(snap, peer=self.peer_name)
        if snap.state is not prev:
            self.transitions.append((snap.updated_at, snap.state.value))
            log.warning(
                "link to %s: %s -> %s (cause %s, queue %s ms, retrans %.4f, rtt %s ms, "
                "goodput %.2f Gbit/s)",
                self.peer_name,
                prev.value,
                snap.state.value,
                snap.cause.value,
                f"{snap.queue_ms:.1f}" if snap.queue_ms is not None else "?",
                snap.retrans_ratio,
                f"{snap.rtt_ms:.2f}" if snap.rtt_ms is not None else "?",
                snap.goodput_bps / 1e9,
            )
            self._changed.set()
        if self.pacer is not None:
            rate = self.pacer.update(snap)
            if rate != self.rate_bps:
                log.info(
                    "link to %s: pacing %s -> %s (state %s, queue %s ms, goodput %.3f Gbit/s, "
                    "retrans %.4f)",
                    self.peer_name,
                    "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e9:.3f} Gbit/s",
                    "unlimited" if rate is None else f"{rate / 1e9:.3f} Gbit/s",
                    snap.state.value,
                    f"{snap.queue_ms:.1f}" if snap.queue_ms is not None else "?",
                    snap.goodput_bps / 1e9,
                    snap.retrans_ratio,
                )
                self.rate_bps = rate
                self.apply_pacing(rate or 0)
                self.metrics.observe_pacing(rate, peer=self.peer_name)

    async def _publish_loop(self) -> None:
        """Publish once a second and at once on a state change."""
        url = self.cfg.monitor.router_url.rstrip("/") + "/v1/links"
        while True:
            with trio.move_on_after(1.0):
                await self._changed.wait()
            self._changed = trio.Event()
            snap = self.snapshot
            if snap is None:
                continue
            try:
                status = await http_post_json(
                    url,
                    router_link_body(snap, self.cfg, self.peer_name),
                    self.cfg.monitor.router_token,
                    timeout=2.0,
                )
                if status >= 400:
                    raise ValueError(f"router answered HTTP {status}")
            except (OSError, ValueError, trio.TooSlowError) as e:
                self.publish_failures += 1
                now = time.monotonic()
                if now - self._last_warn > 30:
                    self._last_warn = now
                    log.warning("publishing link state to %s failed: %s", url, e)

    def status(self) -> dict[str, Any]:
        snap = self.snapshot
        return {
            **(snap.to_json() if snap is not None else {"state": "unknown"}),
            "pacing_bps": self.rate_bps,
            "publish_failures": self.publish_failures,
            "transitions": self.transitions[-20:],
        }
