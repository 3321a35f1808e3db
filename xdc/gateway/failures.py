"""What the gateway tells the router about remote plans whose KV did not come.

The router decides where KV goes, so it has to hear when it did not get there: the prefill
answered ``xdc_failed`` (its sender is down, or can not reach the decode node's receiver) or
the decode answered ``xdc_recomputed``. Each such plan becomes one ``POST /v1/outcomes``
entry (``scheduler.outages`` decides what it blames). Reports are queued (bounded, oldest
dropped first) and sent in batches by one task the app owns, so a slow or dead router never
delays an answer to a client.
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
MAX_BATCH = 256  # the router's openapi.MAX_FAILURES


class FailureReports:
    """The queue of failure reports and the loop that delivers them."""

    def __init__(self) -> None:
        self.queue: deque[dict[str, Any]] = deque(maxlen=MAX_QUEUED)
        self._ready = asyncio.Event()
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self._last_warn = 0.0

    def add(self, rid: str, cluster: str, decode_node: str, reason: str, stage: str) -> None:
        if len(self.queue) == self.queue.maxlen:
            self.dropped += 1
        self.queue.append(
            {
                "rid": rid,
                "cluster": cluster,
                "decode_node": decode_node,
                "reason": reason,
                "stage": stage,
            }
        )
        self._ready.set()

    async def run(self, engines: Engines, router_url: str, token: str, timeout_s: float) -> None:
        """Deliver until cancelled (the app's cleanup context owns this task)."""
        url = router_url.rstrip("/") + "/v1/outcomes"
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self.queue:
                batch = [self.queue.popleft() for _ in range(min(len(self.queue), MAX_BATCH))]
                try:
                    await engines.report_failures(url, token, batch, timeout_s)
                    self.sent += len(batch)
                except RouterUnavailable as e:
                    # the router is down or refused them: these reports are lost (the link
                    # reports still tell it the same within seconds), say so now and then
                    self.errors += 1
                    self.dropped += len(batch)
                    now = time.monotonic()
                    if now - self._last_warn > 30:
                        self._last_warn = now
                        log.warning("failure reports to %s not delivered: %s", url, e)
                    break


__all__ = ["FailureReports"]
