"""Node load from vLLM's own Prometheus metrics, polled by the router.

A router that only hears load from whoever posts ``/v1/nodes`` is as current as that poster.
vLLM exports its queue on ``/metrics``: ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and the histogram
``vllm:request_prefill_time_seconds``. ``load_from_metrics`` (pure) turns one scrape into a
``NodeReport``: queue depth = waiting requests, queue time = waiting x the mean prefill time
over the last scrape interval (the lifetime mean until one completes), decode load = KV cache
usage. Waiting requests the scheduler skips (``vllm:num_requests_waiting_by_reason``
``reason="deferred"``: on a decode engine, those whose connector said their KV is still on
its way) are no prefill backlog and hold no KV blocks yet; they are reported apart, as
``decode_waiting``, which the router counts like its own bookings.

``VllmMetricsPoller`` scrapes each engine listed in ``router.vllm_metrics`` and applies the
reports as ``/v1/nodes`` would; an engine that does not answer is reported unhealthy after
``FAILS_UNHEALTHY`` scrapes in a row, and healthy again at its next good one.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from xdc.scheduler.drift import PrefillWindow

from xdc.config_entries import MetricsTarget
from xdc.http_body import read_capped

log = logging.getLogger("xdc.router.vllm_metrics")

FAILS_UNHEALTHY = 3
MAX_BODY = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: int
    running: int
    kv_usage: float  # 0..1
    prefill_sum_s: float
    prefill_count: int
    prompt_tokens_sum: float = 0.0  # of the requests that finished (vllm:request_prompt_tokens)
    # that histogram's buckets: (upper bound, requests at or below it so far), ascending
    prompt_buckets: tuple[tuple[float, float], ...] = ()
    deferred: int = 0  # of ``waiting``: skipped by the scheduler (a decode's KV on its way)


# no engine has this many requests or seconds; above it a sum is garbage (or inf, which int()
# cannot take: an OverflowError there used to end the whole poller)
MAX_COUNT = 1e15


_SUMMED = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_prompt_tokens_sum",
)


_BY_REASON = "vllm:num_requests_waiting_by_reason"


def parse_metrics(text: str) -> EngineLoad:
    """One scrape of a vLLM engine (summed over its label sets). ValueError if it is not
    Prometheus text or lacks the queue gauges."""
    vals: dict[str, float] = {}
    buckets: dict[float, float] = {}  # prompt-length bound -> requests at or below it
    deferred = 0.0
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                bucket = s.name == "vllm:request_prompt_tokens_bucket"
                by_reason = s.name == _BY_REASON
                if not bucket and not by_reason and s.name not in _SUMMED:
                    continue
                if not math.isfinite(s.value) or s.value < 0:
                    raise ValueError(f"{s.name}: {s.value} is not a count")
                if by_reason:
                    if s.labels.get("reason") == "deferred":
                        deferred += s.value
                    continue
                if not bucket:
                    vals[s.name] = vals.get(s.name, 0.0) + s.value
                    continue
                le = float(s.labels["le"])
                if not le >= 0:  # a prompt length: NaN and negative bounds are no bucket
                    raise ValueError(f"{s.name}: bound {le} is not a prompt length")
                buckets[le] = buckets.get(le, 0.0) + s.value
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ValueError(f"not vLLM metrics: {e}") from None
    if "vllm:num_requests_waiting" not in vals or "vllm:num_requests_running" not in vals:
        raise ValueError("not vLLM metrics: no vllm:num_requests_waiting / _running")
    # finite each, the sum of several label sets can still overflow
    for name, v in [
        *vals.items(),
        *((f"bucket le={b}", v) for b, v in buckets.items()),
        (_BY_REASON, deferred),
    ]:
        if not v < MAX_COUNT:
            raise ValueError(f"not vLLM metrics: {name} sums to {v}")
    waiting = int(vals["vllm:num_requests_waiting"])
    return EngineLoad(
        waiting,
        int(vals["vllm:num_requests_running"]),
        min(1.0, vals.get("vllm:kv_cache_usage_perc", 0.0)),
        vals.get("vllm:request_prefill_time_seconds_sum", 0.0),
        int(vals.get("vllm:request_prefill_time_seconds_count", 0.0)),
        vals.get("vllm:request_prompt_tokens_sum", 0.0),
        tuple(sorted(buckets.items())),
        min(int(deferred), waiting),  # a part of the waiting, whatever the gauges' timing
    )


def prefill_window(now: EngineLoad, before: EngineLoad | None) -> PrefillWindow | None:
    """The prefills an engine finished between two scrapes (None: none, or counters that went
    backwards: the engine restarted)."""
    if before is None or now.prefill_count <= before.prefill_count:
        return None
    seconds = now.prefill_sum_s - before.prefill_sum_s
    tokens = now.prompt_tokens_sum - before.prompt_tokens_sum
    if seconds < 0 or tokens <= 0:
        return None
    n = now.prefill_count - before.prefill_count
    return PrefillWindow(n, seconds, tokens, _bucket_counts(now, before))


def _bucket_counts(now: EngineLoad, before: EngineLoad) -> tuple[tuple[float, float, int], ...]:
    """Requests per prompt-length bucket ``(lo, hi]`` between two scrapes; empty when the
    two scrapes' buckets differ or a count went backwards (then the mean length is used)."""
    if not now.prompt_buckets or [b for b, _ in now.prompt_buckets] != [
        b for b, _ in before.prompt_buckets
    ]:
        return ()
    out: list[tuple[float, float, int]] = []
    lo, below = 0.0, 0.0
    for (hi, cum), (_, cum0) in zip(now.prompt_buckets, before.prompt_buckets, strict=True):
        upto = cum - cum0
        k = upto - below
        if upto < 0 or k < 0:
            return ()
        out.append((lo, hi, int(k)))
        lo, below = hi, upto
    return tuple(out)


def load_report(
    target: MetricsTarget, now: EngineLoad, before: EngineLoad | None, default_prefill_s: float
) -> dict[str, Any]:
    """The ``/v1/nodes`` entry for one scrape (``before``: the previous scrape)."""
    n, total = now.prefill_count, now.prefill_sum_s
    if before is not None and now.prefill_count > before.prefill_count:
        n, total = (
            now.prefill_count - before.prefill_count,
            now.prefill_sum_s - before.prefill_sum_s,
        )
    mean = total / n if n > 0 and total >= 0 else default_prefill_s
    backlog = now.waiting - now.deferred
    return {
        "cluster": target.cluster,
        "name": target.node,
        "role": target.role,
        "queue_depth": backlog,
        "queue_s": round(backlog * mean, 6),
        "decode_load": round(now.kv_usage, 6),
        "decode_waiting": now.deferred,
        "healthy": True,
        # nodes scraped from one engine's /metrics are roles of one instance: a PD-P node
        # decodes on its own instance's PD-D node (policy._pick_decode)
        "instance": target.url[:128],
    }


class VllmMetricsPoller:
    """Scrapes every target each ``interval_s`` and hands the node reports to ``apply``."""

    def __init__(
        self,
        targets: list[MetricsTarget],
        apply: Callable[[list[dict[str, Any]]], None],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 1.0,
        default_prefill_s: float = 1.0,
        observe: Callable[[MetricsTarget, PrefillWindow], None] | None = None,
    ) -> None:
        self.targets = targets
        self.apply = apply
        self.observe = observe  # each prefill node's finished prefills (profile drift)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.default_prefill_s = default_prefill_s
        self.last: dict[str, EngineLoad] = {}
        self.fails: dict[str, int] = {}
        self.scrapes = 0
        self.errors = 0

    async def _scrape(self, session: Any, t: MetricsTarget) -> dict[str, Any] | None:
        import aiohttp

        key = f"{t.cluster}/{t.node}"
        try:
            async with session.get(t.url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    raise ValueError(f"HTTP {r.status}")
                body = await read_capped(r.content, MAX_BODY)
                if len(body) > MAX_BODY:
                    raise ValueError(f"body over {MAX_BODY} bytes")
                load = parse_metrics(body.decode("utf-8", "replace"))
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as e:
            self.errors += 1
            self.fails[key] = self.fails.get(key, 0) + 1
            if self.fails[key] == 1 or self.fails[key] == FAILS_UNHEALTHY:
                log.warning("vLLM metrics of %s at %s: %s", key, t.url, e)
            if self.fails[key] >= FAILS_UNHEALTHY:
                return {"cluster": t.cluster, "name": t.node, "role": t.role, "healthy": False}
            return None
        self.scrapes += 1
        self.fails[key] = 0
        before = self.last.get(key)
        report = load_report(t, load, before, self.default_prefill_s)
        self.last[key] = load
        window = prefill_window(load, before) if t.role == "prefill" else None
        if window is not None and self.observe is not None:
            self.observe(t, window)
        return report

    async def run(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            while True:
                reports = await asyncio.gather(*(self._scrape(session, t) for t in self.targets))
                ready = [r for r in reports if r is not None]
                if ready:
                    try:
                        self.apply(ready)
                    except ValueError as e:
                        log.warning("vLLM metrics: reports refused: %s", e)
                await asyncio.sleep(self.interval_s)
