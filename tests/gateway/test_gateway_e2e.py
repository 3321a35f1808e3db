"""The whole PrfaaS path, end to end, on real parts: `xdc up`'s system (router, gateway, a
PrfaaS vLLM producer + xdc sender in one namespace, a PD vLLM + xdc receiver in the other,
joined by a 1 Gbit/s tbf veth with 1% random iptables loss), driven through the gateway's
OpenAI API like a client would.

Checks: short prompts stay local and long uncached ones go the PrfaaS way (the x-xdc-route
header says which), every answer's greedy tokens equal a plain single instance's, a prefix
cached only in PrfaaS is moved (the PrfaaS instance counts it as prefix-hit tokens), and after
the PrfaaS instance is killed, and then the router, requests still succeed locally and none
hangs."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import pytest

from tests.vllm_fixtures import Engine, need_vllm, prompt
from xdc.gateway.up import PRFAAS_NODE, PROFILE, LocalSystem, UpOptions
from xdc.lab.differential import sse_tokens
from xdc.lab.netlab import unavailable_reason

pytestmark = [pytest.mark.vllm, pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(900)]

SHORT, LONG, SHARED = 300, 3000, 2976  # t is ~2,048 tokens for deploy/profiles/tiny-cpu.toml
MAX_TOKENS = 8
SERVER_BATCH = 2048  # tokens a step, vLLM's OpenAI server's default on the CPU build


def _route(headers: Any) -> dict[str, str]:
    raw = headers.get("x-xdc-route", "")
    return dict(p.split("=", 1) for p in raw.split("; ") if "=" in p)


def _prefix_hits(system: LocalSystem) -> float:
    text = system.ns_get("b", system.prfaas_url + "/metrics")
    assert isinstance(text, str), "PrfaaS vLLM /metrics did not answer"
    m = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, "no vllm:prefix_cache_hits_total on the PrfaaS instance"
    return float(m.group(1))


async def _complete(
    session: aiohttp.ClientSession, ids: list[int], *, stream: bool = False, timeout: float = 90
) -> tuple[list[int], dict[str, str], float]:
    body = {
        "model": "xdc-test",
        "prompt": ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "stream": stream,
    }
    t0 = time.monotonic()
    async with session.post(
        "http://gateway/v1/completions",
        json=body,
        headers={"Authorization": "Bearer e2e-token"},
        timeout=aiohttp.ClientTimeout(total=timeout),
    ) as r:
        assert r.status == 200, (r.status, await r.text())
        route = _route(r.headers)
        if not stream:
            data = await r.json()
            return list(data["choices"][0]["token_ids"]), route, time.monotonic() - t0
        tokens, done, error = await sse_tokens(r.content)
        assert done and not error, f"stream ended without [DONE]: {error}"
        return tokens, route, time.monotonic() - t0


def test_gateway_routes_real_engines_across_a_lossy_link_and_survives_failures() -> None:
    need_vllm()
    why = unavailable_reason()
    if why:
        pytest.skip(f"netlab unavailable: {why}")
    short = prompt(SHORT, seed=11)
    long_a = prompt(LONG, seed=12)
    long_b = prompt(LONG - 400, seed=13)
    warm = prompt(SHARED, seed=14)  # cached only in the PrfaaS instance (warmed directly)
    moved = warm + prompt(LONG, seed=15)[:64]
    after_kill = [prompt(LONG, seed=20 + i) for i in range(3)]
    no_router = prompt(LONG, seed=30)
    cases = [short, long_a, long_b, moved, *after_kill, no_router]
    # references first, on a quiet machine: one plain engine, no xdc, scheduled as the
    # servers are: vLLM's OpenAI server prefills at most 2,048 tokens a step, an offline
    # engine 4,096; on an Intel AMX host a 3,000-token prompt chunked and unchunked decoded
    # differently from the 4th token (no xdc involved)
    ref = Engine("plain", core=1, max_num_batched_tokens=SERVER_BATCH)
    try:
        want = [
            ref.generate([p], [{"ignore_eos": True}], MAX_TOKENS)[0]["token_ids"] for p in cases
        ]
    finally:
        ref.close()
    want_of = {id(p): w for p, w in zip(cases, want, strict=True)}

    system = LocalSystem(UpOptions(loss=0.01, client_token="e2e-token", profile=PROFILE))
    with system:
        system.start(progress=print)

        async def drive() -> None:
            conn = aiohttp.UnixConnector(path=system.gateway_unix)
            async with aiohttp.ClientSession(connector=conn) as s:
                got, route, _ = await _complete(s, short)
                assert route["path"] == "local" and route["target"] == "pd", route
                assert got == want_of[id(short)]
                for p, stream in ((long_a, False), (long_b, True)):
                    got, route, secs = await _complete(s, p, stream=stream)
                    assert route["path"] == "remote" and route["prefill"] == PRFAAS_NODE, (
                        route,
                        system.log("gateway")[-3000:],
                    )
                    assert got == want_of[id(p)], (len(p), stream)
                    print(f"{len(p)} tokens via PrfaaS (stream={stream}): {secs:.3f}s, equal")

                # a prefix cached only in PrfaaS (another cluster's request warmed it)
                await _warm_prfaas(system, warm)
                hits0 = _prefix_hits(system)
                got, route, _ = await _complete(s, moved)
                assert route.get("cache_transfer") == "moved", (
                    route,
                    system.log("gateway")[-3000:],
                )
                assert route["path"] == "remote" and route["prefill"] == PRFAAS_NODE, route
                assert got == want_of[id(moved)]
                hits = _prefix_hits(system) - hits0
                assert hits >= SHARED - 32, f"PrfaaS counted {hits} prefix-hit tokens"
                print(f"moved prefix: {route}, PrfaaS prefix hits +{hits:.0f} tokens")

                # so far every remote transfer was delivered (no recompute on the PD side)
                assert "prefilling it locally" not in system.log("vllm-pd")
                # the PrfaaS instance dies: later requests prefill locally, none hangs
                system.kill("vllm-prfaas")
                for p in after_kill:
                    got, route, secs = await _complete(s, p, timeout=60)
                    assert route["path"] == "local", route
                    assert got == want_of[id(p)]
                    assert secs < 30, secs
                    print(f"after the kill: {route} in {secs:.2f}s")

                # the router dies: the static fallback serves, counted
                system.kill("router")
                got, route, secs = await _complete(s, no_router, timeout=60)
                assert route["source"] == "fallback" and route["path"] == "local", route
                assert got == want_of[id(no_router)]
                async with s.get("http://gateway/metrics") as r:
                    text = await r.text()
                assert re.search(
                    r'xdc_gateway_router_fallbacks_total\{reason="unreachable"\} [1-9]', text
                ), text

        asyncio.run(drive())


async def _warm_prfaas(system: LocalSystem, ids: list[int]) -> None:
    """A plain prefill on the PrfaaS instance (no transfer), sent from the PD namespace."""
    body = json.dumps({"model": "xdc-test", "prompt": ids, "max_tokens": 1})
    answer = await asyncio.to_thread(
        system.lab.http, "b", system.prfaas_url + "/v1/completions", body, 60
    )
    assert answer is not None, "the warm-up prefill on the PrfaaS instance failed"
    await asyncio.sleep(1.0)  # KV events reach the router
