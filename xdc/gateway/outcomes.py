"""What the gateway tells the router about the remote plans it ran.

The router decides where KV goes, so it has to hear when it did not get there: the prefill
answered ``xdc_failed`` (its sender is down, or can not reach the decode node's receiver) or
the decode answered ``xdc_recomputed``. Each such plan becomes one ``failures`` entry of
``POST /v1/outcomes`` (``scheduler.outages`` decides what it blames). Each remote prefill
that handed its KV over becomes one ``prefills`` entry: how long the PrfaaS engine took as
the gateway saw it, the router's profile-drift signal where it cannot scrape those engines.
Reports are queued (bounded, oldest dropped first) and sent in batches by one task the app
owns, so a slow or dead router never delays an answer to a client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from xdc.gateway.engine_http import Engines, RouterUnavailable

log = logging.getLogger("xdc.gateway")

MAX_QUEUED = 1024
MAX_BATCH = 256  # the router's openapi.MAX_FAILURES (per kind)


class OutcomeReports:
    """The queues of outcome reports and the loop that delivers them."""

    def __init__(self) -> None:
        self.failures: deque[dict[str, Any]] = deque(maxlen=MAX_QUEUED)
        self.prefills: deque[dict[str, Any]] = deque(maxlen=MAX_QUEUED)
        self._ready = asyncio.Event()
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self._last_warn = 0.0

    def _queue(self, q: deque[dict[str, Any]], entry: dict[str, Any]) -> None:
        if len(q) == q.maxlen:
            self.dropped += 1
        q.append(entry)
        self._ready.set()

    def failed(self, rid: str, cluster: str, decode_node: str, reason: str, stage: str) -> None:
        """A remote plan whose KV did not reach its decode node."""
        entry = {
            "rid": rid,
            "cluster": cluster,
            "decode_node": decode_node,
            "reason": reason,
            "stage": stage,
        }
        self._queue(self.failures, entry)

    def prefilled(self, rid: str, cluster: str, seconds: float, uncached_tokens: int) -> None:
        """A remote prefill that handed its KV over, and how long it took."""
        if seconds > 0 and uncached_tokens > 0:
            entry = {
                "rid": rid,
                "cluster": cluster,
                "seconds": seconds,
                "uncached_tokens": uncached_tokens,
            }
            self._queue(self.prefills, entry)

    async def run(self, engines: Engines, router_url: str, token: str, timeout_s: float) -> None:
        """Deliver until cancelled (the app's cleanup context owns this task)."""
        url = router_url.rstrip("/") + "/v1/outcomes"
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self.failures or self.prefills:
                # one kind per call: a router from before ``prefills`` refuses those only
                if self.failures:
                    body = {"failures": _take(self.failures)}
                else:
                    body = {"failures": [], "prefills": _take(self.prefills)}
                n = sum(len(v) for v in body.values())
                try:
                    await engines.report_outcomes(url, token, body, timeout_s)
                    self.sent += n
                except RouterUnavailable as e:
                    # the router is down or refused them: these reports are lost (the link
                    # reports still tell it the same within seconds), say so now and then
                    self.errors += 1
                    self.dropped += n
                    now = time.monotonic()
                    if now - self._last_warn > 30:
                        self._last_warn = now
                        log.warning("outcome reports to %s not delivered: %s", url, e)
                    break


def _take(q: deque[dict[str, Any]]) -> list[dict[str, Any]]:
    return [q.popleft() for _ in range(min(len(q), MAX_BATCH))]


__all__ = ["OutcomeReports"]
