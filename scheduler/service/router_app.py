"""The router's HTTP API (aiohttp): a thin shell over ``RouterService``.

Every write needs a bearer token (gateway token for /v1/route, daemon token for the reports
engines and monitors send), checked in constant time before the body is read, so an
unauthenticated client cannot make the router parse megabytes. Bodies are size-capped
(413), strictly validated against the schemas published at /openapi.json (400 naming each
bad or unknown field), and a catch-all middleware turns anything unexpected into a logged 500
with an id instead of a traceback; the fuzz tests show that path is not reached by input.

The long-term planner runs as a background task owned by the app (``cleanup_ctx``), so it
starts and stops with the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from xdc.scheduler.cacheindex import CacheEvent, chain_hashes
from xdc.scheduler.link_table import UnknownLink, fresh
from xdc.scheduler.outages import failure_of
from xdc.scheduler.policy import (
    Decision,
    QueueSignal,
    RouteRequest,
    bandwidth_scarce,
    queue_signal,
)
from xdc.scheduler.profile import PD_CLUSTER, Profile
from xdc.scheduler.service import openapi
from xdc.scheduler.service.router import NodeReport, RouterService
from xdc.scheduler.service.router_metrics import CONTENT_TYPE, RouterMetrics
from xdc.scheduler.service.shared import RedisSync, replica_name, require_redis, wait_written
from xdc.scheduler.service.validation import BodyError, validate
from xdc.scheduler.vllm_metrics import VllmMetricsPoller

from xdc.config import RouterConfig
from xdc.config_entries import parse_targets
from xdc.linkreport import LinkReport
from xdc.logs import safe

log = logging.getLogger("xdc.router")

SERVICE: web.AppKey[RouterService] = web.AppKey("service", RouterService)
METRICS: web.AppKey[RouterMetrics] = web.AppKey("metrics", RouterMetrics)
CONFIG: web.AppKey[RouterConfig] = web.AppKey("config", RouterConfig)
REPLAN_NOW: web.AppKey[asyncio.Event] = web.AppKey("replan_now", asyncio.Event)
REPLICA: web.AppKey[str] = web.AppKey("replica", str)
VLLM_POLLER: web.AppKey[VllmMetricsPoller] = web.AppKey("vllm_poller", VllmMetricsPoller)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
DRAIN_TIMEOUT_S = 2.0
DRAIN_BUDGET_BYTES = 16 * 1024 * 1024


def _error(
    status: int, message: str, problems: list[str] | None = None, **extra: str
) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if problems:
        body["problems"] = problems
    body.update(extra)
    return web.json_response(body, status=status)


class _Reject(Exception):
    """Answer with this status and message (raised by the request-reading helpers)."""

    def __init__(self, status: int, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.problems = problems


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS]
    try:
        resp = await handler(request)
    except _Reject as e:
        resp = await _settle(request, _error(e.status, e.message, e.problems))
    except BodyError as e:
        resp = _error(400, "invalid request body", e.problems)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = await _settle(request, _error(e.status, e.reason))
    except asyncio.CancelledError:
        raise
    except Exception:
        eid = uuid.uuid4().hex[:12]
        log.exception(
            "unexpected error handling %s %s (error id %s)", request.method, request.path, eid
        )
        metrics.server_errors.inc()
        return _error(500, "internal error", id=eid)
    if 400 <= resp.status < 500:
        metrics.bad_requests.labels(str(resp.status)).inc()
    return resp


async def _settle(request: web.Request, resp: web.Response) -> web.Response:
    """Answer a request rejected before its body was read: drain the body if that is cheap,
    else send the answer now and drop the connection (aiohttp would linger up to 10 s)."""
    if await _drain(request):
        return resp
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()
    return resp


async def _drain(request: web.Request) -> bool:
    """Read and drop the rest of a rejected request's body, so the client, which may still be
    sending, gets to read the answer (closing on unread data would reset the connection and
    lose it). Bounded by DRAIN_BUDGET_BYTES and DRAIN_TIMEOUT_S; False = gave up, close."""
    content = request.content
    if content.is_eof():
        return True
    budget = DRAIN_BUDGET_BYTES
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            while budget > 0 and not content.is_eof():
                chunk = await content.readany()
                if not chunk:
                    break
                budget -= len(chunk)
    except TimeoutError:
        return False
    return content.is_eof()


def _token_ok(request: web.Request, expected: str) -> None:
    if not expected:
        raise _Reject(401, "writes are disabled: no token configured for this endpoint")
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise _Reject(401, "missing bearer token (Authorization: Bearer <token>)")
    # aiohttp decodes header bytes that are not UTF-8 as lone surrogates; encode them back the
    # same way so any byte sequence compares (and fails) instead of raising
    if not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), expected.encode()):
        raise _Reject(401, "wrong bearer token")


async def _body(request: web.Request, token: str) -> bytes:
    """Auth first, then size, then type: cheap checks before reading anything."""
    _token_ok(request, token)
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _Reject(413, f"body of {request.content_length} bytes exceeds {limit} bytes")
    ctype = request.headers.get("Content-Type")
    if (
        ctype is not None
        and request.content_type not in ("application/json", "text/json")
        and not (request.content_type.endswith("+json"))
    ):
        raise _Reject(415, f"Content-Type {request.content_type!r} is not application/json")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _Reject(413, f"body exceeds {limit} bytes") from None


def _check_blocks_fit(what: str, n: int, block_size: int, prompt_len: int) -> None:
    """``n`` block keys can belong to a prompt of ``prompt_len`` tokens, or a 400."""
    if n > -(-prompt_len // block_size):
        raise _Reject(
            400,
            f"{what}: {n} blocks of {block_size} tokens do not fit prompt_len {prompt_len}",
        )


def _prefix_hashes(
    body: dict[str, Any], block_size: int, prompt_len: int | None
) -> tuple[int, ...]:
    tokens = body.get("token_ids")
    if tokens is not None:
        if prompt_len is not None and len(tokens) > prompt_len:
            raise _Reject(400, f"token_ids: {len(tokens)} tokens but prompt_len is {prompt_len}")
        return tuple(chain_hashes(tokens, block_size))
    hashes = body.get("block_hashes") or ()
    if prompt_len is not None:
        _check_blocks_fit("block_hashes", len(hashes), block_size, prompt_len)
    return tuple(hashes)


async def route_handler(request: web.Request) -> web.Response:
    svc, metrics, cfg = request.app[SERVICE], request.app[METRICS], request.app[CONFIG]
    body = validate(await _body(request, cfg.gateway_token), openapi.ROUTE_REQUEST)
    prompt_len: int = body["prompt_len"]
    t0 = time.perf_counter()
    tokens = body.get("token_ids")
    scheme_keys = body.get("scheme_keys")
    if scheme_keys is not None:
        if tokens is not None or body.get("block_hashes") is not None:
            raise _Reject(400, "scheme_keys: give scheme_keys, block_hashes or token_ids, one")
        keys: dict[str, list[int]] = {}
        for entry in scheme_keys:
            if entry["scheme"] in keys:
                raise _Reject(400, f"scheme_keys: scheme {entry['scheme']!r} given twice")
            _check_blocks_fit("scheme_keys", len(entry["hashes"]), cfg.block_size, prompt_len)
            keys[entry["scheme"]] = entry["hashes"]
        match, hashes = svc.cache.match_keys(keys)
    elif tokens is not None:
        if len(tokens) > prompt_len:
            raise _Reject(400, f"token_ids: {len(tokens)} tokens but prompt_len is {prompt_len}")
        match, hashes = svc.cache.match(token_ids=tokens)
    else:
        hashes = _prefix_hashes(body, cfg.block_size, prompt_len)
        match, _ = svc.cache.match(hashes=hashes)
    req = RouteRequest(
        rid=body["rid"], prompt_len=prompt_len, hashes=hashes, ttft_slo_s=body.get("ttft_slo_s")
    )
    dry_run = bool(body.get("dry_run", False))
    decision = svc.route_matched(req, match, dry_run=dry_run)
    metrics.record(decision, time.perf_counter() - t0)
    log_decision(decision, dry_run=dry_run)
    return _json_response(decision.to_json(), 429 if decision.rejected else 200)


def _json_response(obj: Any, status: int = 200) -> web.Response:
    """orjson: the route answer is encoded 2,000 times a second, ~5x faster than json."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def log_decision(d: Decision, *, dry_run: bool = False) -> None:
    """One INFO line per decision, keyed by the request id, so an operator can follow a
    request from the gateway through the router into the sender and receiver logs."""
    if not log.isEnabledFor(logging.INFO):
        return
    extra = " (dry run)" if dry_run else ""
    if d.rejected:
        why = "; ".join(
            r.removeprefix("reject: ") for r in d.reasons if r.startswith("reject")
        ) or "; ".join(d.reasons)
        log.info("route %s rejected%s: %s (ttft %.2f)", safe(d.rid), extra, why, d.predicted_ttft_s)
        return
    log.info(
        "route %s -> %s prefill %s decode %s uncached %d t %.0f ttft %.2f%s | %s",
        safe(d.rid),
        d.target,
        d.prefill_node,
        d.decode_node,
        d.uncached_tokens,
        d.effective_t,
        d.predicted_ttft_s,
        extra,
        safe("; ".join(d.reasons), 1000),  # why: what the operator asks first of a route
    )


async def cache_events_handler(request: web.Request) -> web.Response:
    svc, metrics, cfg = request.app[SERVICE], request.app[METRICS], request.app[CONFIG]
    body = validate(await _body(request, cfg.daemon_token), openapi.CACHE_EVENTS)
    events: list[CacheEvent] = []
    for i, e in enumerate(body["events"]):
        try:
            hashes = _prefix_hashes(e, cfg.block_size, None)
        except ValueError as err:
            raise _Reject(400, f"events[{i}]: {err}") from None
        if e["cluster"] not in svc.clusters:
            raise _Reject(
                400,
                f"events[{i}].cluster: {e['cluster']!r} is not in the profile "
                f"(known: {', '.join(svc.clusters)})",
            )
        ev = CacheEvent(e["kind"], e["cluster"], e["node"], e["seq"], hashes)
        try:
            ev.check()
        except ValueError as err:
            raise _Reject(400, f"events[{i}]: {err}") from None
        events.append(ev)
    try:
        applied, changed = svc.apply_events(events)
    except ValueError as err:
        raise _Reject(400, str(err)) from None
    metrics.cache_events.labels("changed").inc(changed)
    metrics.cache_events.labels("no_change").inc(applied - changed)
    metrics.cache_entries.set(len(svc.index))
    replicated = await wait_written(svc.sync, cfg.redis_timeout_s)
    return _json_response(
        {
            "applied": applied,
            "changed": changed,
            "entries": len(svc.index),
            "replicated": replicated,
        }
    )


async def links_handler(request: web.Request) -> web.Response:
    svc, metrics, cfg = request.app[SERVICE], request.app[METRICS], request.app[CONFIG]
    body = validate(await _body(request, cfg.daemon_token), openapi.LINK_REPORT)
    report = LinkReport.from_checked(body)
    try:
        accepted = svc.update_link(report)
    except UnknownLink as err:
        raise _Reject(400, "unknown link", [str(err)]) from None
    except ValueError as err:
        raise _Reject(429, str(err)) from None
    now = svc.clock()
    cluster = report.from_cluster
    link = fresh(svc.link_views(now).get(cluster), now, svc.params.stale_after_s)
    if accepted:
        metrics.record_link(str(report.link), link)
        if svc.capacity_replan_due():
            request.app[REPLAN_NOW].set()
    view = svc.nodes.view(now)
    fc_nodes = view.prfaas_groups().get(cluster, ())
    fc_wait = sum(n.queue_s for n in fc_nodes) / len(fc_nodes) if fc_nodes else 0.0
    q = QueueSignal(fc_wait, queue_signal(view).pd_s)
    scarce, why = bandwidth_scarce(link, q, now, svc.params)
    replicated = await wait_written(svc.sync, cfg.redis_timeout_s) if accepted else None
    return _json_response(
        {
            "accepted": accepted,
            "replicated": replicated,
            "reason": None if accepted else "older than this reporter's last report",
            "link": str(report.link),
            "combined": None if link is None else link.to_json(),
            "bandwidth": "scarce" if scarce else "abundant",
            "why": why,
            "effective_t": _num(svc.effective_t()),
        }
    )


async def nodes_handler(request: web.Request) -> web.Response:
    svc, cfg = request.app[SERVICE], request.app[CONFIG]
    body = validate(await _body(request, cfg.daemon_token), openapi.NODE_REPORTS)
    try:
        reports = [NodeReport.from_json(n) for n in body["nodes"]]
        svc.apply_node_reports(reports)
    except ValueError as err:
        raise _Reject(400, str(err)) from None
    replicated = await wait_written(svc.sync, cfg.redis_timeout_s)
    return _json_response(
        {"applied": len(reports), "nodes": len(svc.nodes), "replicated": replicated}
    )


async def outcomes_handler(request: web.Request) -> web.Response:
    """The gateway's failure reports (``scheduler.outages``): counted per link, decode node
    and reason, and a link or node they prove broken is out of offloading at once; and its
    timings of remote prefills (``RouterService.observe_gateway_prefill``)."""
    svc, metrics, cfg = request.app[SERVICE], request.app[METRICS], request.app[CONFIG]
    body = validate(await _body(request, cfg.gateway_token), openapi.FAILURES)
    prefills = body.get("prefills", [])
    try:
        failures = [
            failure_of(f["cluster"], f["decode_node"], f["reason"], f["stage"])
            for f in body["failures"]
        ]
        for c in [f.cluster for f in failures] + [p["cluster"] for p in prefills]:
            svc.check_prfaas(c)
    except ValueError as err:
        raise _Reject(400, str(err)) from None
    timed = sum(
        svc.observe_gateway_prefill(p["cluster"], p["seconds"], p["uncached_tokens"])
        for p in prefills
    )
    blamed = []
    for f in failures:
        what = svc.apply_failure(f)
        blamed.append(what)
        # label values from the body only where the router knows them (bounded series)
        known = svc.nodes.get(PD_CLUSTER, f.decode_node) is not None
        metrics.failures.labels(
            f"{f.cluster}->pd", f.decode_node if known else "unknown", f.reason, what
        ).inc()
    replicated = await wait_written(svc.sync, cfg.redis_timeout_s)
    now = svc.clock()
    return _json_response(
        {
            "applied": len(failures),
            "prefills_timed": timed,  # folded into the drift estimate (see openapi.PREFILL)
            "blamed": blamed,
            "links_down": svc.links_down(now),
            "intakes_down": svc.outages.intakes_down(now),
            "replicated": replicated,
        }
    )


async def plan_handler(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    plan = svc.plan_json()
    sync = svc.sync
    if isinstance(sync, RedisSync) and not svc.leads and sync.remote_recommendation is not None:
        plan["recommendation"] = sync.remote_recommendation  # the leader's
    return web.json_response(plan)


async def state_handler(request: web.Request) -> web.Response:
    state = request.app[SERVICE].state()
    # a link report that moved the capacity enough woke the replanner and it has not run
    # yet: with the counts, says whether a report caused a replan without waiting for one
    state["replan_pending"] = request.app[REPLAN_NOW].is_set()
    state["profile"] = request.app[CONFIG].profile  # the file the router's model came from
    return web.json_response(state)


async def schemes_handler(request: web.Request) -> web.Response:
    cache = request.app[SERVICE].cache
    return web.json_response(
        {
            "block_size": request.app[CONFIG].block_size,
            "default": cache.default,
            "schemes": cache.describe(),
        }
    )


async def metrics_handler(request: web.Request) -> web.Response:
    svc, metrics = request.app[SERVICE], request.app[METRICS]
    metrics.cache_entries.set(len(svc.index))
    # link gauges from the combined state now: reports that reached this replica through
    # Redis count, and a link whose senders went silent reads as gone
    now = svc.clock()
    stale = svc.params.stale_after_s
    for cluster, view in svc.link_views(now).items():
        metrics.record_link(f"{cluster}->pd", fresh(view, now, stale))
    down = svc.links_down(now)
    for cluster in svc.prfaas_names:
        metrics.link_down.labels(f"{cluster}->pd").set(1 if cluster in down else 0)
    intakes = svc.outages.intakes_down(now)
    for node in svc.nodes.nodes():
        if node.role == "decode":
            metrics.intake_down.labels(node.name).set(1 if node.name in intakes else 0)
    for kind, factor in svc.drift_applied.items():
        metrics.profile_drift.labels(kind).set(factor)
    resp = web.Response(body=metrics.render())
    resp.headers["Content-Type"] = CONTENT_TYPE
    return resp


async def healthz_handler(request: web.Request) -> web.Response:
    """200 while this process routes. With replicas, ``shared_state`` says whether Redis is
    reachable; ``degraded: true`` means routing goes on with the last state it had."""
    sync = request.app[SERVICE].sync
    shared = sync.status() if isinstance(sync, RedisSync) else {"backend": "memory"}
    return web.json_response({"ok": True, "shared_state": shared})


async def openapi_handler(request: web.Request) -> web.Response:
    return web.json_response(openapi.document())


def _num(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


async def replan_once(app: web.Application) -> None:
    """One long-term cycle: re-solve, apply the new t, publish the recommendation."""
    svc, metrics = app[SERVICE], app[METRICS]
    rec = await asyncio.to_thread(svc.solve, svc.replan_inputs())
    svc.adopt(rec)
    metrics.record_recommendation(rec)
    if rec.role_changes:
        log.info("replan: recommend %s", summarize_role_changes(rec.role_changes))


def summarize_role_changes(changes: Sequence[Any], shown: int = 5) -> str:
    """One short line however many nodes change (the full list is on /v1/plan): counts per
    direction, then the first few nodes."""
    moves = Counter(f"{c.from_role}->{c.to_role}" for c in changes)
    counts = ", ".join(f"{n} {move}" for move, n in sorted(moves.items()))
    first = ", ".join(f"{safe(c.node, 64)} {c.from_role}->{c.to_role}" for c in changes[:shown])
    more = f" (and {len(changes) - shown} more; see /v1/plan)" if len(changes) > shown else ""
    return f"{len(changes)} role changes ({counts}): {first}{more}"


async def _shared_state(app: web.Application) -> AsyncIterator[None]:
    """With router.shared_state = redis: replicate inputs through Redis for the app's life."""
    cfg, svc = app[CONFIG], app[SERVICE]
    if cfg.shared_state != "redis":
        yield
        return
    sync = RedisSync(svc, cfg, app[METRICS], app[REPLICA])
    await sync.start()
    try:
        yield
    finally:
        await sync.close()


async def _event_sources(app: web.Application) -> AsyncIterator[None]:
    """Run every registered cache-event source (cacheintake.EventSource) with the app."""
    svc = app[SERVICE]

    def sink(scheme: str, events: Sequence[CacheEvent]) -> None:
        try:
            svc.apply_events(events, scheme)
        except ValueError as e:
            log.warning("cache event source %s: dropped a batch: %s", scheme, e)

    tasks = [
        asyncio.create_task(_guarded(src.run(sink), src.scheme.name)) for src in svc.cache.sources
    ]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def _vllm_metrics(app: web.Application) -> AsyncIterator[None]:
    """Scrape the vLLM engines of router.vllm_metrics for node load, with the app."""
    cfg, svc = app[CONFIG], app[SERVICE]
    targets = parse_targets(cfg.vllm_metrics)
    if not targets:
        yield
        return

    def apply(reports: list[dict[str, Any]]) -> None:
        svc.apply_node_reports([NodeReport.from_json(r) for r in reports])

    poller = VllmMetricsPoller(
        targets,
        apply,
        interval_s=cfg.vllm_metrics_interval_s,
        observe=lambda t, w: svc.observe_prefill(t.cluster, w),
    )
    app[VLLM_POLLER] = poller
    task = asyncio.create_task(_guarded(poller.run(), "vllm metrics"))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _guarded(run: Awaitable[None], name: str) -> None:
    try:
        await run
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("cache event source %s failed; its events stop", name)


async def _replanner(app: web.Application) -> AsyncIterator[None]:
    """Replan every ``replan_interval_s``, and early when a link report moved the capacity
    enough (``links_handler`` sets ``REPLAN_NOW``; the service rate-limits it)."""
    interval = app[CONFIG].replan_interval_s
    wake = app[REPLAN_NOW]

    async def loop() -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval)
            early = wake.is_set()
            wake.clear()
            if not app[SERVICE].leads:
                continue  # another replica plans; this one adopts its thresholds
            if early:
                app[SERVICE].counts["capacity_replans"] += 1
                log.info("replan: link capacity changed; re-solving t for the live bandwidth")
            try:
                await replan_once(app)
            except Exception:
                log.exception("replan failed; keeping the previous plan")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def make_router_app(
    cfg: RouterConfig,
    profile: Profile,
    *,
    clock: Callable[[], float] | None = None,
    replica: str = "",
) -> web.Application:
    """The router app. ``clock`` (seconds) drives queues, staleness and the threshold; by
    default monotonic for one router, wall time for replicas (their timestamps travel between
    hosts). ``replica`` names this replica in the shared state."""
    if cfg.shared_state == "redis":
        require_redis()
    if clock is None:
        clock = time.time if cfg.shared_state == "redis" else time.monotonic
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[_guard])
    app[CONFIG] = cfg
    app[REPLICA] = replica or replica_name(cfg, "router")
    app[SERVICE] = RouterService(cfg, profile, clock=clock)
    app[METRICS] = RouterMetrics()
    app[REPLAN_NOW] = asyncio.Event()
    svc = app[SERVICE]
    app[METRICS].watch_threshold(lambda: svc.threshold.base_t, lambda: svc.threshold.t)
    app[METRICS].watch_vllm_sources(svc.vllm_sources)
    app.router.add_post("/v1/route", route_handler)
    app.router.add_post("/v1/cache/events", cache_events_handler)
    app.router.add_post("/v1/links", links_handler)
    app.router.add_post("/v1/nodes", nodes_handler)
    app.router.add_post("/v1/outcomes", outcomes_handler)
    app.router.add_get("/v1/plan", plan_handler)
    app.router.add_get("/v1/state", state_handler)
    app.router.add_get("/v1/schemes", schemes_handler)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz_handler)
    app.router.add_get("/openapi.json", openapi_handler)
    app.cleanup_ctx.append(_shared_state)
    app.cleanup_ctx.append(_event_sources)
    app.cleanup_ctx.append(_vllm_metrics)
    app.cleanup_ctx.append(_replanner)
    return app
