"""The gateway's aiohttp shell: OpenAI-compatible endpoints over the pure plan and request code.

Per request: check the client (token, body, fields), tokenise text on an engine, ask the
router (``/v1/route``), then run the plan. A remote plan sends the decode request first and the
prefill request beside it (the decode instance starts receiving KV while the prefill runs);
whichever answers first decides what happens next:

* prefill failed or missed ``prefill_timeout_s`` -> the decode request is cancelled (vLLM
  aborts it) and the decode instance prefills itself: the client sees a slower answer, not an
  error;
* decode failed -> the prefill is cancelled and the client gets the engine's error (4xx as
  the engine said it, else 502).

Router down, slow, unset or naming a node without a URL -> ``gateway.fallback_*`` (logged,
counted); router 429 -> 429 with Retry-After. Every task lives in the request's handler and is
awaited or cancelled before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from xdc.config import GatewayConfig
from xdc.config_entries import parse_nodes, parse_receivers
from xdc.gateway import openai, plan
from xdc.gateway.engine_http import (
    EngineError,
    Engines,
    RouterRejected,
    RouterUnavailable,
)
from xdc.gateway.gateway_metrics import GatewayMetrics
from xdc.gateway.outcomes import OutcomeReports
from xdc.gateway.route_keys import RouterSchemes, route_body
from xdc.http_body import read_capped
from xdc.integrations.vllm.params import (
    decode_params,
    parse_prefill_answer,
    prefill_params,
    reason_word,
)

log = logging.getLogger("xdc.gateway")


@dataclass
class Gateway:
    """What the handlers share: config, node map, engine client, metrics."""

    cfg: GatewayConfig
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    nodes: dict[str, str] = field(default_factory=dict)
    receivers: dict[str, str] = field(default_factory=dict)  # decode node -> its receiver
    engines: Engines | None = None
    tokens: tuple[bytes, ...] = ()
    router_state: str = "unset"  # unset | up | down
    schemes: RouterSchemes = field(default_factory=RouterSchemes)  # the router's key schemes
    _warned: dict[str, float] = field(default_factory=dict)  # reason -> last warning
    outcomes: OutcomeReports = field(default_factory=OutcomeReports)  # for the router

    def __post_init__(self) -> None:
        self.nodes = parse_nodes(self.cfg.nodes)
        self.receivers = parse_receivers(self.cfg.receivers)
        self.tokens = tuple(t.encode() for t in self.cfg.client_tokens)

    @property
    def tokenizer_url(self) -> str:
        name = self.cfg.fallback_decode or next(iter(self.nodes), "")
        return self.nodes.get(name, "")

    def fallback(self, reason: str, detail: str) -> plan.RequestPlan:
        self.metrics.router_fallbacks.labels(reason).inc()
        now = time.monotonic()
        if now - self._warned.get(reason, -1e9) >= 10.0:  # a down router: one line per 10 s
            self._warned[reason] = now
            log.warning("router %s (%s): static fallback", reason, detail)
        if not (self.cfg.fallback_prefill and self.cfg.fallback_decode):
            raise _Fail(
                503,
                "no route: the router cannot be asked and no gateway.fallback_* "
                "nodes are configured",
                "service_unavailable",
            )
        return self._shipping(
            plan.fallback(self.cfg.fallback_prefill, self.cfg.fallback_decode, self.nodes)
        )

    def kv_failed(self, rid: str, p: plan.RequestPlan, reason: str, stage: str) -> None:
        """Remote plan ``p`` did not get its KV to the decode node: counted by node and
        reason, named in ``x-xdc-route``, and reported to the router (which decided it)."""
        self.metrics.kv_recomputed.labels(p.decode_node, reason).inc()
        if self.cfg.router_url and p.source is plan.Source.ROUTER:
            self.outcomes.failed(rid, p.target, p.decode_node, reason, stage)

    def _shipping(self, p: plan.RequestPlan) -> plan.RequestPlan:
        """The plan with the receiver its KV goes to: the decode node's."""
        return dataclasses.replace(p, decode_receiver=self.receivers.get(p.decode_node, ""))

    async def plan_for(self, rid: str, ids: list[int]) -> plan.RequestPlan:
        assert self.engines is not None
        if not self.cfg.router_url:
            return self.fallback("unset", "gateway.router_url is empty")
        engines, url = self.engines, self.cfg.router_url
        rb = await route_body(
            rid, ids, self.schemes, lambda: engines.schemes(url, self.cfg.router_timeout_s)
        )
        if rb.truncated:
            self.metrics.route_keys.labels("truncated").inc()
        elif not rb.prefix:
            self.metrics.route_keys.labels("length_only").inc()
        try:
            d = await self.engines.route(
                self.cfg.router_url, self.cfg.router_token, rb.body, self.cfg.router_timeout_s
            )
        except RouterRejected as e:
            self.router_state = "up"
            self.metrics.router_rejections.inc()
            reasons = e.decision.get("reasons")
            raise _Fail(
                429,
                "no cluster can meet the TTFT SLO right now: "
                + "; ".join(str(r) for r in (reasons if isinstance(reasons, list) else []))[:500],
                "rate_limit_exceeded",
                retry_after=1,
            ) from None
        except RouterUnavailable as e:
            self.router_state = "down"
            return self.fallback(e.reason, str(e))
        self.router_state = "up"
        try:
            return self._shipping(plan.from_decision(d, self.nodes))
        except plan.PlanError as e:
            return self.fallback("unknown_node", str(e))


class _Fail(Exception):
    """Answer the client with this status and an OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        kind: str | None = None,
        retry_after: int | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.retry_after, self.body = retry_after, body

    def response(self) -> web.Response:
        body = (
            self.body
            if self.body is not None
            else openai.error_body(self.message, kind=self.kind, code=self.code)
        )
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after else None
        return web.json_response(body, status=self.status, headers=headers)


GATEWAY = web.AppKey("gateway", Gateway)


def _check_token(gw: Gateway, request: web.Request) -> None:
    if not gw.tokens:
        return
    auth = request.headers.get("Authorization", "")
    scheme, _, given = auth.partition(" ")
    g = given.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(g, t) for t in gw.tokens):
        raise _Fail(401, "Incorrect API key provided", "invalid_api_key")


async def _read_json(gw: Gateway, request: web.Request) -> Any:
    limit = gw.cfg.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _Fail(413, f"body of {request.content_length} bytes exceeds {limit} bytes")
    try:
        async with asyncio.timeout(gw.cfg.body_timeout_s):
            raw = await read_capped(request.content, limit)
    except TimeoutError:
        raise _Fail(408, f"body not received within {gw.cfg.body_timeout_s:g}s") from None
    if len(raw) > limit:
        raise _Fail(413, f"body exceeds {limit} bytes")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise _Fail(400, "We could not parse the JSON body of your request.") from None


def _engine_fail(e: EngineError) -> _Fail:
    """An engine's 4xx is the client's fault (prompt too long...): pass it on as the engine
    said it. Anything else is ours: 502."""
    if 400 <= e.status < 500 and isinstance(e.body, dict) and "error" in e.body:
        return _Fail(e.status, str(e.body["error"]), body=e.body)
    return _Fail(502, f"engine failed: {e.why}", "engine_error")


def _kv_outcome(gw: Gateway, rid: str, p: plan.RequestPlan, ans: Any) -> plan.RequestPlan:
    """A remote plan whose decode answer says it recomputed (``xdc_recomputed`` in its
    ``kv_transfer_params``): counted, named and reported (``Gateway.kv_failed``). (vLLM's
    streamed answers carry no ``kv_transfer_params``: only whole answers say it.)"""
    if p.path is not plan.Path.REMOTE or not isinstance(ans, dict):
        return p
    kvp = ans.get("kv_transfer_params")
    why = kvp.get("xdc_recomputed") if isinstance(kvp, dict) else None
    if why is None:
        return p
    reason = reason_word(why)
    log.warning("request %s: decode on %s prefilled itself: %s", rid, p.decode_node, reason)
    gw.kv_failed(rid, p, reason, "decode")
    return dataclasses.replace(p, kv_recomputed=reason)


def _consumer_kv(gw: Gateway, rid: str, n: int) -> dict[str, Any]:
    """The decode waits for the transfer to begin as long as the gateway waits for the
    prefill's answer: the gateway cancels the decode itself when the prefill fails or times
    out, and a prefill queued at a busy PrfaaS cluster begins late (with the engine's own
    arrival timeout, 5-10 s, shorter than the router's queue surge mark of 8 s, such a
    decode recomputed what was still coming)."""
    return decode_params(rid, n, timeout_s=gw.cfg.kv_timeout_s, arrival_s=gw.cfg.prefill_timeout_s)


def _producer_kv(gw: Gateway, rid: str, p: plan.RequestPlan) -> dict[str, Any]:
    return prefill_params(rid, deadline_s=gw.cfg.prefill_timeout_s, peer=p.decode_receiver)


async def _prefill(
    gw: Gateway, p: plan.RequestPlan, job: openai.Job, ids: list[int], rid: str
) -> str | None:
    """Run the remote prefill; None when it handed its KV over, else why it failed."""
    assert gw.engines is not None
    body = job.engine_body(ids, max_tokens=1, kv=_producer_kv(gw, rid, p), stream=False)
    body.pop("stop", None)
    t0 = time.monotonic()
    try:
        ans = await asyncio.wait_for(
            gw.engines.post(p.prefill_url, "/v1/completions", body),
            gw.cfg.prefill_timeout_s,
        )
    except TimeoutError:
        return "timeout"
    except EngineError as e:
        log.warning("request %s: prefill on %s failed: %s", rid, p.prefill_node, e.why)
        return "error"
    kvp = ans.get("kv_transfer_params") if isinstance(ans, dict) else None
    why = parse_prefill_answer(kvp, rid, len(ids))
    if why == "mismatch":
        log.warning(
            "request %s: prefill answered without matching transfer parameters: %s",
            rid,
            str(kvp)[:200],
        )
    elif why is not None:
        log.warning("request %s: prefill on %s handed no KV over: %s", rid, p.prefill_node, why)
    else:
        took = time.monotonic() - t0
        gw.metrics.prefill.labels(p.prefill_node).observe(took)
        if gw.cfg.router_url and p.source is plan.Source.ROUTER:
            gw.outcomes.prefilled(rid, p.target, took, max(1, len(ids) - p.cached_tokens))
    return why


async def _cancel(task: asyncio.Task[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def _capture(coro: Any) -> Any:
    """Await ``coro``; an EngineError is returned instead of raised, so a failed task never
    tears down its sibling by surprise."""
    try:
        return await coro
    except EngineError as e:
        return e


T = TypeVar("T")


async def _run(
    gw: Gateway,
    p: plan.RequestPlan,
    job: openai.Job,
    ids: list[int],
    rid: str,
    start: Callable[[str, dict[str, Any]], Awaitable[T]],
) -> tuple[plan.RequestPlan, T]:
    """Run plan ``p``; ``start(url, body)`` is the decode call (a whole completion, or a
    stream's first event). Remote: the decode and the prefill go out together and whichever
    ends first decides (module docstring); a failed prefill ends in ``plan.recovery``."""
    if p.path is plan.Path.LOCAL:
        try:
            return p, await start(p.decode_url, job.engine_body(ids))
        except EngineError as e:
            raise _engine_fail(e) from None
    decode = asyncio.create_task(
        _capture(start(p.decode_url, job.engine_body(ids, kv=_consumer_kv(gw, rid, len(ids)))))
    )
    prefill = asyncio.create_task(_prefill(gw, p, job, ids, rid))
    try:
        await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
        why = None if decode.done() else await prefill
        if why is None or decode.done():  # a decode that got going anyway is kept
            result = await decode
            if not isinstance(result, EngineError):
                return p, result
            if why is None:
                raise _engine_fail(result)
    finally:
        await _cancel(prefill)
        await _cancel(decode)
    why = why or "error"
    gw.metrics.prefill_failures.labels(why).inc()
    gw.kv_failed(rid, p, why, "prefill")
    rec = dataclasses.replace(plan.recovery(p), kv_recomputed=why)
    try:
        return rec, await start(rec.decode_url, job.engine_body(ids))
    except EngineError as e:
        raise _engine_fail(e) from None


async def run_plan(
    gw: Gateway, p: plan.RequestPlan, job: openai.Job, ids: list[int], rid: str
) -> tuple[plan.RequestPlan, dict[str, Any]]:
    """Non-streamed: the engine's completion and the plan that produced it."""
    eng = gw.engines
    assert eng is not None

    async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
        ans = await eng.post(url, "/v1/completions", body)
        if not isinstance(ans, dict):
            raise EngineError(url, "answer is not a JSON object")
        return ans

    return await _run(gw, p, job, ids, rid, post)


class _Stream:
    """An engine stream whose first event was already read (to know it started)."""

    def __init__(self, first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None]) -> None:
        self.first, self.rest = first, rest

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield self.first
        async for e in self.rest:
            yield e

    async def aclose(self) -> None:
        await self.rest.aclose()


async def _open_stream(gw: Gateway, url: str, body: dict[str, Any]) -> _Stream:
    assert gw.engines is not None
    agen = gw.engines.stream(url, body)
    try:
        first = await agen.__anext__()
    except StopAsyncIteration:
        raise EngineError(url, "empty stream") from None
    except BaseException:
        await agen.aclose()
        raise
    return _Stream(first, agen)


async def open_plan_stream(
    gw: Gateway, p: plan.RequestPlan, job: openai.Job, ids: list[int], rid: str
) -> tuple[plan.RequestPlan, _Stream]:
    """Streamed: start the plan and return once the decode's first event is in hand."""

    async def open_(url: str, body: dict[str, Any]) -> _Stream:
        return await _open_stream(gw, url, body)

    return await _run(gw, p, job, ids, rid, open_)


async def _prompt_ids(gw: Gateway, job: openai.Job) -> list[int]:
    if job.prompt_ids is not None:
        return job.prompt_ids
    assert gw.engines is not None
    try:
        ids = await gw.engines.tokenize(
            gw.tokenizer_url, job.model, text=job.prompt_text, messages=job.messages
        )
    except EngineError as e:
        if 400 <= e.status < 500:
            raise _engine_fail(e) from None
        raise _Fail(503, f"cannot tokenise the prompt: {e.why}", "service_unavailable") from None
    if len(ids) > openai.MAX_PROMPT_TOKENS:  # the cap a prompt of token ids is held to
        why = f"prompt: {len(ids)} tokens, more than {openai.MAX_PROMPT_TOKENS}"
        raise _Fail(400, why, body=openai.error_body(why, param="prompt", code=None))
    return ids


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _handle(request: web.Request, *, chat: bool) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    t0 = time.monotonic()
    endpoint = "chat" if chat else "completions"
    p: plan.RequestPlan | None = None
    status = 500
    rid = "-"
    try:
        _check_token(gw, request)
        body = await _read_json(gw, request)
        try:
            job = openai.parse(
                body,
                chat=chat,
                model=gw.cfg.model,
                default_max_tokens=gw.cfg.default_max_tokens,
                max_tokens_limit=gw.cfg.max_tokens_limit,
            )
        except openai.BadRequest as e:
            raise _Fail(
                e.status,
                e.message,
                e.error_code,
                body=openai.error_body(e.message, param=e.param, code=e.error_code),
            ) from None
        ids = await _prompt_ids(gw, job)
        rid = f"gw-{job.id}"
        p = await gw.plan_for(rid, ids)
        headers = {"x-xdc-rid": rid}
        if not job.stream:
            p, ans = await run_plan(gw, p, job, ids, rid)
            p = _kv_outcome(gw, rid, p, ans)
            headers["x-xdc-route"] = p.header()
            try:
                answer = openai.completion_answer(job, ans)
            except openai.BadEngineAnswer as e:
                raise _engine_fail(EngineError(p.decode_url, str(e))) from None
            status = 200
            _log(rid, p, len(ids), status, t0)
            return web.json_response(answer, headers=headers)
        p, stream = await open_plan_stream(gw, p, job, ids, rid)
        headers["x-xdc-route"] = p.header()
        status = 200
        return await _relay(gw, request, job, stream, headers, p, t0, rid, len(ids))
    except _Fail as f:
        status = f.status
        if p is not None:
            _log(rid, p, 0, status, t0)
        return f.response()
    except asyncio.CancelledError:
        status = 499  # the client went away before its answer: counted as nginx does
        log.info("request %s: the client went away; its engine requests are closed", rid)
        raise
    finally:
        path, source = (p.path.value, p.source.value) if p is not None else ("none", "none")
        gw.metrics.requests.labels(endpoint, path, source, str(status)).inc()
        if status == 200 and p is not None:
            gw.metrics.latency.labels(path).observe(time.monotonic() - t0)


def _log(rid: str, p: plan.RequestPlan, n: int, status: int, t0: float) -> None:
    log.info(
        "request %s %d tokens -> %s: %d in %.3fs", rid, n, p.header(), status, time.monotonic() - t0
    )


async def _relay(
    gw: Gateway,
    request: web.Request,
    job: openai.Job,
    stream: _Stream,
    headers: dict[str, str],
    p: plan.RequestPlan,
    t0: float,
    rid: str,
    n: int,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    first = True
    events = stream.events()
    try:
        await resp.prepare(request)
        async for ev in events:
            chunk = openai.stream_chunk(job, ev, first=first)
            if chunk is None:
                continue
            if first and chunk.get("choices"):
                gw.metrics.ttft.labels(p.path.value).observe(time.monotonic() - t0)
                first = False
            await resp.write(_sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        _log(rid, p, n, 200, t0)
    except (EngineError, openai.BadEngineAnswer) as e:
        # headers are gone: the error travels as an event and [DONE] is withheld, so the
        # client cannot take a cut answer for a whole one
        why = e.why if isinstance(e, EngineError) else str(e)
        log.warning("request %s: stream from %s broke: %s", rid, p.decode_node, why)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write(_sse(openai.error_body(f"engine failed: {why}", kind="server_error")))
    except ConnectionError:
        # nothing more can reach the client: the engine stream is closed below (vLLM aborts a
        # request whose connection closes), and there is nothing to raise about
        log.info("request %s: client went away; the engine request is aborted", rid)
    except asyncio.CancelledError:
        log.info("request %s: cancelled; the engine request is aborted", rid)
        raise
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()  # type: ignore[attr-defined]
            await stream.aclose()
    return resp


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, chat=True)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        _check_token(gw, request)
    except _Fail as f:
        return f.response()
    return web.json_response(
        {
            "object": "list",
            "data": [{"id": gw.cfg.model, "object": "model", "created": 0, "owned_by": "xdc"}],
        }
    )


async def healthz(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({"ok": True, "router": gw.router_state, "nodes": sorted(gw.nodes)})


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.Response(body=gw.metrics.render(), content_type="text/plain", charset="utf-8")


def make_gateway_app(cfg: GatewayConfig) -> web.Application:
    """The gateway app; its engine session opens and closes with the app."""
    gw = Gateway(cfg)
    app = web.Application(client_max_size=cfg.max_body_bytes)
    app[GATEWAY] = gw

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        async with aiohttp.ClientSession(connector=conn) as s:
            gw.engines = Engines(s, cfg.request_timeout_s)
            reporter: asyncio.Task[None] | None = None
            if cfg.router_url:
                reporter = asyncio.create_task(
                    gw.outcomes.run(
                        gw.engines, cfg.router_url, cfg.router_token, cfg.router_timeout_s
                    )
                )
            try:
                yield
            finally:
                if reporter is not None:
                    await _cancel(reporter)

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
