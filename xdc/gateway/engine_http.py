"""HTTP calls to the engines (vLLM's OpenAI server) and to the router, with the gateway's
timeouts. Every failure becomes ``EngineError`` / ``RouterUnavailable`` carrying why, so the
shell decides what to do from one type, not from aiohttp's dozen."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError

from xdc.errors import RemoteConnectionError, RemoteRequestError
from xdc.http_body import read_capped


class EngineError(RemoteRequestError):
    """An engine did not answer usefully; ``status`` is its HTTP status (0 = no answer)."""

    def __init__(self, url: str, why: str, status: int = 0, body: Any = None) -> None:
        super().__init__(f"{url}: {why}")
        self.url, self.why, self.status, self.body = url, why, status, body


class RouterUnavailable(RemoteConnectionError):
    """The router could not be asked (down, slow, or it answered something unusable)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class RouterRejected(RemoteRequestError):
    """The router answered 429: nothing meets the TTFT SLO right now."""

    def __init__(self, decision: Mapping[str, Any]) -> None:
        super().__init__("router rejected the request")
        self.decision = decision


MAX_ENGINE_BODY = 64 << 20

# What a broken or hostile engine connection can raise out of aiohttp: its client errors, the
# socket's, a timeout, and the parser's (HttpProcessingError: a line over aiohttp's limit in an
# SSE stream, a malformed chunk), which is not a ClientError.
_TRANSPORT_ERRORS = (TimeoutError, aiohttp.ClientError, OSError, HttpProcessingError)


def _why(e: BaseException, t: aiohttp.ClientTimeout) -> str:
    """A reason an operator can act on (a bare TimeoutError says nothing)."""
    if isinstance(e, TimeoutError) and t.total:
        return f"no complete answer within {t.total:g}s"
    if isinstance(e, HttpProcessingError):
        return f"unreadable answer: {e.message}"[:300]
    return f"{type(e).__name__}: {e}"[:300]


async def _json(resp: aiohttp.ClientResponse, url: str) -> Any:
    raw = await read_capped(resp.content, MAX_ENGINE_BODY)
    if len(raw) > MAX_ENGINE_BODY:
        raise EngineError(url, "answer too large", resp.status)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        raise EngineError(url, f"answer is not JSON: {raw[:200]!r}", resp.status) from None


class Engines:
    """One aiohttp session for all engines (connection reuse), owned by the gateway app."""

    def __init__(self, session: aiohttp.ClientSession, request_timeout_s: float) -> None:
        self.session = session
        self.request_timeout_s = request_timeout_s

    async def post(
        self, base: str, path: str, body: Mapping[str, Any], timeout_s: float | None = None
    ) -> Any:
        url = base + path
        t = aiohttp.ClientTimeout(total=timeout_s or self.request_timeout_s, sock_connect=5)
        try:
            async with self.session.post(url, json=body, timeout=t) as resp:
                data = await _json(resp, url)
                if resp.status != 200:
                    why = data.get("error", data) if isinstance(data, dict) else data
                    raise EngineError(
                        url, f"HTTP {resp.status}: {str(why)[:300]}", resp.status, data
                    )
                return data
        except _TRANSPORT_ERRORS as e:
            raise EngineError(url, _why(e, t)) from None

    async def stream(
        self, base: str, body: Mapping[str, Any]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """The engine's SSE events, decoded; ends at ``[DONE]``. EngineError on any failure,
        including a stream that ends without ``[DONE]`` (a truncated answer must not look
        complete to the client)."""
        url = base + "/v1/completions"
        t = aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=5)
        try:
            async with self.session.post(url, json=body, timeout=t) as resp:
                if resp.status != 200:
                    data = await _json(resp, url)
                    raise EngineError(
                        url, f"HTTP {resp.status}: {str(data)[:300]}", resp.status, data
                    )
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return
                    try:
                        event = json.loads(payload)
                    except (ValueError, RecursionError):
                        raise EngineError(url, f"bad SSE event {payload[:200]!r}") from None
                    if isinstance(event, dict) and "error" in event:
                        raise EngineError(
                            url, f"engine error: {str(event['error'])[:300]}", 500, event
                        )
                    yield event
                raise EngineError(url, "stream ended without [DONE]")
        except _TRANSPORT_ERRORS as e:
            raise EngineError(url, _why(e, t)) from None

    async def tokenize(
        self,
        base: str,
        model: str,
        *,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body["messages"] = messages
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = text
        data = await self.post(base, "/tokenize", body, timeout_s=30)
        ids = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise EngineError(base + "/tokenize", f"no token list in {str(data)[:200]}")
        return ids

    async def _router_call(
        self, method: str, url: str, timeout_s: float, cap: int, **kw: Any
    ) -> tuple[int, Any]:
        """(status, decoded JSON) of one router call; RouterUnavailable when it cannot be
        had (timeout, unreachable, an answer that is not JSON)."""
        t = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self.session.request(method, url, timeout=t, **kw) as resp:
                raw = await read_capped(resp.content, cap)
                status = resp.status
        except TimeoutError:
            raise RouterUnavailable("timeout", f"no answer in {timeout_s}s") from None
        except (aiohttp.ClientError, OSError, HttpProcessingError) as e:
            raise RouterUnavailable("unreachable", f"{type(e).__name__}: {e}"[:200]) from None
        try:
            return status, json.loads(raw)
        except (ValueError, RecursionError):
            raise RouterUnavailable("bad_answer", f"HTTP {status}: {raw[:200]!r}") from None

    async def schemes(self, router_url: str, timeout_s: float) -> Any:
        """The router's ``GET /v1/schemes`` answer (RouterUnavailable when unusable)."""
        url = router_url.rstrip("/") + "/v1/schemes"
        status, data = await self._router_call("GET", url, timeout_s, 1 << 16)
        if status != 200:
            raise RouterUnavailable("error", f"HTTP {status} from {url}")
        return data

    async def route(
        self, router_url: str, token: str, body: dict[str, Any], timeout_s: float
    ) -> dict[str, Any]:
        """Ask the router. RouterRejected on 429; RouterUnavailable for anything unusable
        (a body the router found too large is reason ``too_large``, counted apart)."""
        url = router_url.rstrip("/") + "/v1/route"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        status, data = await self._router_call(
            "POST", url, timeout_s, 1 << 20, json=body, headers=headers
        )
        if status == 429 and isinstance(data, dict):
            raise RouterRejected(data)
        if status != 200 or not isinstance(data, dict):
            reason = {401: "auth", 403: "auth", 413: "too_large"}.get(status, "error")
            raise RouterUnavailable(reason, f"HTTP {status}: {str(data)[:200]}")
        return data

    async def report_outcomes(
        self, url: str, token: str, body: dict[str, Any], timeout_s: float
    ) -> None:
        """``POST /v1/outcomes`` (``gateway.outcomes``); RouterUnavailable unless accepted."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        status, data = await self._router_call(
            "POST", url, timeout_s, 1 << 16, json=body, headers=headers
        )
        if status != 200:
            raise RouterUnavailable("error", f"HTTP {status}: {str(data)[:200]}")
