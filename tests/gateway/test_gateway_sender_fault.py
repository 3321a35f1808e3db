"""The sender killed under load (issue 28's fault, as a test): `xdc up`'s system, a stream of
long prompts through the gateway, and the PrfaaS sender daemon SIGKILLed mid-run.

What must hold: every request succeeds; a request the router still offloads after the kill
is told at once that its KV will not come (the prefill engine's admission check finds the
sender gone, its answer says ``xdc_failed=sender_down``, and the gateway has the decode
prefill by itself with no arrival-timeout wait); the router stops offloading over the dark
link within 2 s (the gateway's failure report, or the link's silence); from 2 s after the
kill on, TTFT is back under 2x the no-fault figure; the gateway's counters and the router's
state name what happened; and once a supervisor restarts the sender, offloading resumes."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from typing import Any

import aiohttp
import pytest

from tests.gateway_fixtures import completion_body, route_fields
from tests.vllm_fixtures import need_vllm, prompt
from xdc.gateway.up import PROFILE, LocalSystem, UpOptions
from xdc.lab.netlab import unavailable_reason

pytestmark = [pytest.mark.vllm, pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(900)]

LONG = 2600  # over t (~2,048 tokens for deploy/profiles/tiny-cpu.toml): offloaded


async def _ttft(s: aiohttp.ClientSession, ids: list[int]) -> tuple[float, dict[str, str]]:
    """Seconds to the first streamed token, and the x-xdc-route fields; the stream is read
    to its end and must finish with [DONE]."""
    t0 = time.monotonic()
    first: float | None = None
    async with s.post(
        "http://gateway/v1/completions",
        json=completion_body(ids, 4, stream=True),
        headers={"Authorization": "Bearer e2e-token"},
        timeout=aiohttp.ClientTimeout(total=90),
    ) as r:
        assert r.status == 200, (r.status, await r.text())
        route = route_fields(r.headers)
        done = False
        async for line in r.content:
            line = line.strip()
            if line == b"data: [DONE]":
                done = True
                break
            if line.startswith(b"data: "):
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                if first is None:
                    first = time.monotonic() - t0
        assert done and first is not None, route
    return first, route


def test_sender_killed_under_load_router_stops_offloading_and_ttft_recovers() -> None:
    need_vllm()
    why = unavailable_reason()
    if why:
        pytest.skip(f"netlab unavailable: {why}")
    system = LocalSystem(UpOptions(client_token="e2e-token", profile=PROFILE))
    seeds = iter(range(500, 600))
    with system:
        system.start(progress=print)

        async def drive() -> None:
            conn = aiohttp.UnixConnector(path=system.gateway_unix)
            async with aiohttp.ClientSession(connector=conn) as s:
                await _ttft(s, prompt(LONG, seed=next(seeds)))  # warm-up
                base: list[float] = []
                held_local: list[dict[str, Any]] = []
                while len(base) < 4:
                    secs, route = await _ttft(s, prompt(LONG, seed=next(seeds)))
                    if route["path"] == "remote":
                        base.append(secs)
                        continue
                    # Before any fault the router may still keep a long prompt local for a
                    # moment: the warm-up's KV burst over the 1 Gbit/s shaped link can leave
                    # the link reported busy or congested, or the PrfaaS queue full, and t
                    # raised (seen once under CI's load). That is the router doing its job;
                    # it must pass within a few seconds, and what it saw is kept for the
                    # failure message.
                    state = system.router_state()
                    held_local.append(
                        {
                            "route": route,
                            "threshold": state.get("threshold"),
                            "link": state.get("link"),
                            "prfaas_queue_depth": state.get("prfaas_queue_depth"),
                        }
                    )
                    assert len(held_local) <= 6, held_local
                    await asyncio.sleep(1.0)
                if held_local:
                    print(f"routed local before the fault, then remote: {held_local}")
                no_fault = statistics.median(base)
                system.kill("sender")
                killed = time.monotonic()
                after: list[tuple[float, float, dict[str, str]]] = []
                while time.monotonic() - killed < 8.0:
                    at = time.monotonic() - killed
                    secs, route = await _ttft(s, prompt(LONG, seed=next(seeds)))
                    after.append((at, secs, route))
                table = "\n".join(
                    f"  +{at:5.2f}s ttft {secs:.3f}s  {r.get('path')} {r.get('source')}"
                    f" {r.get('kv_recomputed', '')}"
                    for at, secs, r in after
                )
                print(f"no fault: ttft median {no_fault:.3f}s of {base}\nafter the kill:\n{table}")
                late = [(at, secs, r) for at, secs, r in after if at >= 2.0]
                assert late, table
                for _, secs, r in late:
                    assert r["path"] == "local", table  # nothing offloaded over the dark link
                    assert secs < 2 * no_fault, table
                # a request the router still offloaded was recomputed at once, and said so
                for _, secs, r in after:
                    if r.get("source") == "recovery":
                        assert r.get("kv_recomputed") == "sender_down", table
                        assert secs < 2 * no_fault + 1.0, table  # no 5 s arrival wait
                metrics = await (await s.get("http://gateway/metrics")).text()
                offloaded = sum(1 for _, _, r in after if r.get("source") == "recovery")
                if offloaded:
                    assert re.search(
                        r'xdc_gateway_kv_recomputed_total\{decode="pd-d",reason="sender_down"\} '
                        f"{offloaded}.0",
                        metrics,
                    ), metrics[-3000:]
                # a supervisor restarts the sender: its reports resume and offloading with them
                await asyncio.to_thread(system.restart, "sender")
                back = time.monotonic()
                while True:
                    secs, route = await _ttft(s, prompt(LONG, seed=next(seeds)))
                    if route["path"] == "remote":
                        assert "kv_recomputed" not in route, route
                        break
                    assert time.monotonic() - back < 15, "offloading never resumed"
                print(f"offloading again {time.monotonic() - back:.1f}s after the restart")

        asyncio.run(drive())
        state: Any = system.ns_get("b", system.router_url + "/v1/state")
        assert isinstance(state, dict), state
        assert state["outages"]["links_down"] == {}, state["outages"]
        failures = {f["reason"]: f["count"] for f in state["outages"]["failures"]}
        if failures:  # the router heard each recompute, by reason
            assert set(failures) == {"sender_down"}, failures
            assert "cannot send" in system.log("vllm-prfaas")  # the engine said why
