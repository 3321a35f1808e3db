"""What the gateway tells the router about a prompt: its length and its prefix, compactly.

Token ids made a route body of ~6 bytes per token: past ~130k tokens it went over the
router's 1 MiB cap, the router answered 413 and the gateway quietly took the static
fallback, for exactly the long prompts PrfaaS routing exists for. A long prompt now goes as
block keys, one list per key scheme the router publishes (``GET /v1/schemes``: the gateway
computes the keys with the router's own code), cut to a leading part when even those would
not fit: the prefix caches match from block 0, and ``prompt_len`` carries the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from xdc.scheduler.cacheintake import KeyScheme, scheme_from
from xdc.scheduler.service.openapi import MAX_SCHEMES

log = logging.getLogger("xdc.gateway")

# up to this many ids a prompt goes as token ids (the router hashes them in every scheme)
INLINE_TOKEN_IDS = 32_768
# block keys in one route body, all schemes together (~21 bytes each as JSON: ~500 KB)
MAX_ROUTE_KEYS = 24_576
# keys of prompts longer than this are computed in a worker thread, off the event loop
THREAD_KEYS_FROM = 65_536
SCHEMES_TTL_S = 60.0
SCHEMES_RETRY_S = 5.0


@dataclass(frozen=True, slots=True)
class RouteBody:
    body: dict[str, Any]
    truncated: bool  # the keys cover only a leading part of the prompt
    prefix: bool  # prefix information is in it at all


def keys_body(rid: str, ids: Sequence[int], schemes: Sequence[KeyScheme] | None) -> RouteBody:
    """The route body for ``ids``: the ids themselves when short, else per-scheme keys
    (``schemes`` None: the router's schemes are unknown, so the length alone)."""
    if len(ids) <= INLINE_TOKEN_IDS:
        return RouteBody({"rid": rid, "prompt_len": len(ids), "token_ids": list(ids)}, False, True)
    if not schemes:
        return RouteBody({"rid": rid, "prompt_len": len(ids)}, False, False)
    per = MAX_ROUTE_KEYS // len(schemes)
    truncated = False
    entries = []
    for s in schemes:
        cut = min(len(ids), per * s.block_size)
        truncated |= cut < len(ids) - len(ids) % s.block_size
        entries.append({"scheme": s.name, "hashes": s.keys(ids[:cut])})
    body = {"rid": rid, "prompt_len": len(ids), "scheme_keys": entries}
    return RouteBody(body, truncated, True)


@dataclass
class RouterSchemes:
    """The router's key schemes as last fetched; refetched after SCHEMES_TTL_S, retried
    after SCHEMES_RETRY_S when a fetch failed."""

    schemes: list[KeyScheme] | None = None
    _next_fetch: float = 0.0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def get(self, fetch: Any) -> list[KeyScheme] | None:
        """``fetch``: an awaitable factory for the router's ``/v1/schemes`` JSON."""
        if time.monotonic() < self._next_fetch:
            return self.schemes
        async with self._lock:
            if time.monotonic() < self._next_fetch:
                return self.schemes
            try:
                data = await fetch()
                raw = data["schemes"] if isinstance(data, dict) else None
                if not isinstance(raw, list):
                    raise ValueError(f"no scheme list in {str(data)[:200]}")
                known = []
                for d in raw:
                    try:
                        known.append(scheme_from(d))
                    except ValueError as e:  # a scheme this gateway cannot compute
                        log.warning("router key scheme skipped: %s", e)
                # a route body carries at most the router's own MAX_SCHEMES
                self.schemes = known[:MAX_SCHEMES]
                self._next_fetch = time.monotonic() + SCHEMES_TTL_S
            except Exception as e:  # any failure: keep what we had, try again soon
                log.warning("cannot read the router's key schemes: %s", str(e)[:200])
                self._next_fetch = time.monotonic() + SCHEMES_RETRY_S
            return self.schemes


async def route_body(rid: str, ids: Sequence[int], schemes: RouterSchemes, fetch: Any) -> RouteBody:
    """``keys_body`` with the router's schemes fetched when the prompt needs them."""
    known = await schemes.get(fetch) if len(ids) > INLINE_TOKEN_IDS else None
    if len(ids) > THREAD_KEYS_FROM:
        return await asyncio.to_thread(keys_body, rid, ids, known)
    return keys_body(rid, ids, known)
