"""Capped body reads get the whole body even when it arrives in pieces. Before this, a JSON
answer split across TCP segments (a vLLM prefill answer, a /metrics page) was cut at the first
piece and failed to parse, which sent PrfaaS requests to local recovery at random."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from xdc.gateway.engine_http import Engines
from xdc.http_body import read_capped

PIECES = [b'{"choices": [{"text": "' + b"x" * 20_000, b"y" * 20_000, b'"}], "ok": true}']
BODY = b"".join(PIECES)


@asynccontextmanager
async def dribbling_server() -> AsyncIterator[str]:
    """A real HTTP server that writes its answer in three pieces, 50 ms apart."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(BODY)
        await resp.prepare(request)
        for piece in PIECES:
            await resp.write(piece)
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_route("*", "/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def _read(limit: int) -> bytes:
    async with dribbling_server() as url, aiohttp.ClientSession() as s, s.get(url + "/") as r:
        return await read_capped(r.content, limit)


def test_a_body_arriving_in_pieces_is_read_whole() -> None:
    assert asyncio.run(_read(1 << 20)) == BODY


def test_a_body_over_the_cap_reads_one_byte_past_it_and_stops() -> None:
    raw = asyncio.run(_read(30_000))
    assert len(raw) == 30_001 and raw == BODY[:30_001]


def test_a_negative_cap_is_refused() -> None:
    async def go() -> bytes:
        return await read_capped(asyncio.StreamReader(), -1)

    with pytest.raises(ValueError, match="limit"):
        asyncio.run(go())


def test_an_engine_answer_in_pieces_parses() -> None:
    async def go() -> object:
        async with dribbling_server() as url, aiohttp.ClientSession() as s:
            return await Engines(s, 10).post(url, "/", {"prompt": [1]})

    assert asyncio.run(go()) == json.loads(BODY)
