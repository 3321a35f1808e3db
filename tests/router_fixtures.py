"""A live router for tests: a real aiohttp server on a real socket, its config and clock."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from xdc.scheduler.profile import Profile, load_profile
from xdc.scheduler.service.router_app import make_router_app

from xdc.config import RouterConfig

PROFILE = Path(__file__).resolve().parent.parent / "deploy/profiles/prfaas-case-study.toml"
GW = "gw-secret-token"
DM = "daemon-secret-token"


class Clock:
    """An explicit clock the test advances, so staleness and decay need no sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ServedApp:
    """An aiohttp app on 127.0.0.1:<ephemeral>, served from its own event-loop thread."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, access_log=None)

        async def start() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return int(self.runner.addresses[0][1])

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class LiveRouter:
    """The app served by aiohttp on 127.0.0.1:<ephemeral> from a background event loop."""

    def __init__(self, cfg: RouterConfig, profile: Profile, clock: Clock | None = None) -> None:
        self.clock = clock
        self.app = make_router_app(cfg, profile, clock=clock or time.monotonic)
        self.served = ServedApp(self.app)
        self.loop, self.port = self.served.loop, self.served.port
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def call(
        self,
        method: str,
        path: str,
        body: object = None,
        token: str | None = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        if data is not None:
            h.setdefault("Content-Type", "application/json")
        self.conn.request(method, path, body=data, headers=h)
        resp = self.conn.getresponse()
        payload = resp.read()
        if resp.getheader("Content-Type", "").startswith("application/json"):
            return resp.status, json.loads(payload)
        return resp.status, payload.decode()

    def close(self) -> None:
        self.conn.close()
        self.served.close()


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


def router_config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = {"gateway_token": GW, "daemon_token": DM, "max_body_bytes": 1 << 20}
    base.update(kw)
    return RouterConfig(**base)


SCRAPE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 5.0
"""
"""One vLLM /metrics scrape: 4 waiting, 3 running, 10 prefills in 5 s."""


def vllm_scrape(count: int, seconds: float, tokens: float) -> str:
    """A vLLM /metrics answer: ``count`` prefills done so far, ``seconds`` of prefill and
    ``tokens`` prompt tokens in total."""
    return (
        "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        f"vllm:request_prefill_time_seconds_count {count}\n"
        f"vllm:request_prefill_time_seconds_sum {seconds}\n"
        f"vllm:request_prompt_tokens_sum {tokens}\n"
    )


class MetricsEndpoint:
    """A real HTTP server whose /metrics answer the test can change."""

    def __init__(self) -> None:
        self.body, self.status = SCRAPE, 200

        async def handler(_: web.Request) -> web.Response:
            return web.Response(text=self.body, status=self.status)

        app = web.Application()
        app.router.add_get("/metrics", handler)
        self.served = ServedApp(app)
        self.port = self.served.port

    def close(self) -> None:
        self.served.close()


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    e = MetricsEndpoint()
    yield e
    e.close()
