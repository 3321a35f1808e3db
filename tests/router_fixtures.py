"""A live router for tests: a real aiohttp server on a real socket, its config and clock."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from xdc.scheduler.profile import Profile, load_profile
from xdc.scheduler.service.app import make_router_app

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


class LiveRouter:
    """The app served by aiohttp on 127.0.0.1:<ephemeral> from a background event loop."""

    def __init__(self, cfg: RouterConfig, profile: Profile, clock: Clock | None = None) -> None:
        self.clock = clock
        self.app = make_router_app(cfg, profile, clock=clock or time.monotonic)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(self.app, access_log=None)

        async def start() -> int:
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return int(self.runner.addresses[0][1])

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
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
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


def router_config(**kw: Any) -> RouterConfig:
    base: dict[str, Any] = {"gateway_token": GW, "daemon_token": DM, "max_body_bytes": 1 << 20}
    base.update(kw)
    return RouterConfig(**base)
