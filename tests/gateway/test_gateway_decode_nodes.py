"""Two decode nodes behind the router, end to end (issue 28): `xdc up --decode-nodes 2` runs two PD
vLLM instances, each with its own xdc receiver, and the router picks the decode node per request
(least booked load; a request prefilled in PD-P decodes on that instance, where its KV is; the
KV events of both engines tell the router which holds a prefix). For every request that goes the
PrfaaS way, the KV lands on the receiver of the node the router chose (the x-xdc-route header
names it, the node's receiver logs the transfer complete, the other's never sees it) and the
tokens equal a plain run's. With node 2's receiver down, a request the router sends there
recomputes on node 2 with the same tokens, and the gateway says so (x-xdc-route
``kv_recomputed=receiver_gone``, metric)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.gateway_fixtures import completion_body, route_fields
from tests.vllm_fixtures import Engine, need_vllm, prompt
from xdc.gateway.up import PROFILE, LocalSystem, PdNode, UpOptions
from xdc.lab.netlab import unavailable_reason

pytestmark = [pytest.mark.vllm, pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(900)]

LONG = 3000  # over t (~2,048 tokens): the router offloads it


async def _ask(s: aiohttp.ClientSession, ids: list[int]) -> tuple[list[int], dict[str, str]]:
    """(greedy tokens, the x-xdc-route fields and the gateway's rid as "rid")."""
    async with s.post(
        "http://gateway/v1/completions",
        json=completion_body(ids, 8),
        headers={"Authorization": "Bearer e2e-token"},
        timeout=aiohttp.ClientTimeout(total=90),
    ) as r:
        assert r.status == 200, (r.status, await r.text())
        data = await r.json()
        return list(data["choices"][0]["token_ids"]), route_fields(r.headers)


def _routed(system: LocalSystem, rid: str) -> list[str]:
    """The router's log lines about ``rid``: its decision and why."""
    return [line for line in system.log("router").splitlines() if f"route {rid} " in line]


def _receiver_of(system: LocalSystem, decode: str) -> str:
    return next(n.receiver for n in system.pd_nodes if n.decode == decode)


def test_each_request_lands_its_kv_on_the_decode_node_the_router_chose() -> None:
    need_vllm()
    why = unavailable_reason()
    if why:
        pytest.skip(f"netlab unavailable: {why}")
    cases = [prompt(LONG - 50 * i, seed=40 + i) for i in range(16)]
    # float32: a recompute on the PD server cuts a long prompt into chunks where the plain
    # engine does not, and in bf16 that alone can change tokens (tests/gateway/test_gateway_e2e.py
    # and the differential test say more)
    ref = Engine("plain", core=1, dtype="float32")
    try:
        want = [ref.generate([p], [{"ignore_eos": True}], 8)[0]["token_ids"] for p in cases]
    finally:
        ref.close()
    system = LocalSystem(
        UpOptions(decode_nodes=2, client_token="e2e-token", dtype="float32", profile=PROFILE)
    )
    with system:
        system.start(progress=print)
        assert [n.decode for n in system.pd_nodes] == ["pd-d", "pd2-d"]
        seen: dict[str, list[str]] = {"pd-d": [], "pd2-d": []}
        on_pd2: list[int] = []  # cases whose KV landed on node 2 (now in its prefix cache)
        failed: list[str] = []  # why the first request to pd2-d after its receiver died failed

        async def one(s: aiohttp.ClientSession, i: int) -> dict[str, str]:
            got, route = await _ask(s, cases[i])
            assert got == want[i], (i, route)
            return route

        async def drive() -> None:
            conn = aiohttp.UnixConnector(path=system.gateway_unix)
            async with aiohttp.ClientSession(connector=conn) as s:
                # the router books each decode on the least loaded node: both get some
                for i in range(8):
                    route = await one(s, i)
                    assert route["path"] == "remote", (route, _routed(system, route["rid"]))
                    seen[route["decode"]].append(route["rid"])
                    if route["decode"] == "pd2-d":
                        on_pd2.append(i)
                    if i >= 3 and seen["pd-d"] and seen["pd2-d"]:
                        break
                # a prompt extending one whose KV node 2 holds (its engine's KV events told
                # the router) is prefilled on node 2 for its cached prefix, and decoded there
                # too: its KV is already on that instance (before, the decode went to the
                # least loaded node, which then prefilled it all again)
                await asyncio.sleep(1.5)  # node 2's KV events reach the router
                more = cases[on_pd2[0]] + prompt(150, seed=77)
                got, route = await _ask(s, more)
                assert len(got) == 8
                assert (route["path"], route["prefill"], route["decode"]) == (
                    "local",
                    "pd2-p",
                    "pd2-d",
                ), route
                assert int(route.get("cached", "0")) >= LONG - 200 - 50 * on_pd2[0], route
                assert "kv_recomputed" not in route, route
                # node 2's receiver goes down: a request routed there recomputes on node 2
                system.kill(_receiver_of(system, "pd2-d"))
                after: list[dict[str, str]] = []
                for i in range(8, 16):
                    route = await one(s, i)  # the tokens are right whatever happened
                    after.append(route)
                    if not failed:
                        if route["decode"] == "pd2-d":
                            # its KV could not land: the decode's receiver was gone
                            # (receiver_gone), or the sender found it unreachable before
                            # the prefill and the gateway had pd2-d prefill it at once
                            # (peer_unreachable); the header and the metrics name it
                            why = route.get("kv_recomputed", "")
                            assert why in ("receiver_gone", "peer_unreachable"), route
                            failed.append(why)
                            metrics = await (await s.get("http://gateway/metrics")).text()
                            assert (
                                f'xdc_gateway_kv_recomputed_total{{decode="pd2-d",'
                                f'reason="{why}"}} 1.0' in metrics
                            ), metrics[-2000:]
                        continue
                    # the router heard it: no offloaded KV goes to pd2-d any more
                    assert route["decode"] == "pd-d" and route["path"] == "remote", route
                    assert "kv_recomputed" not in route, route
                    if len(after) >= 3 and after[-2]["decode"] == "pd-d":
                        return
                pytest.fail(f"pd2-d's failure was not followed as expected: {after}, {seen}")

        asyncio.run(drive())
        assert seen["pd-d"] and seen["pd2-d"], seen  # the router used both nodes
        for node, rids in seen.items():
            here = system.log(_receiver_of(system, node))
            other = system.log(_receiver_of(system, "pd2-d" if node == "pd-d" else "pd-d"))
            for rid in rids:
                assert f"request {rid} complete" in here, (node, rid)
                assert f"request {rid} complete" not in other, (node, rid)
        pd2 = next(n for n in system.pd_nodes if n.decode == "pd2-d")
        if failed == ["receiver_gone"]:
            assert "prefilling it locally" in system.log(pd2.engine)
        assert "prefilling it locally" not in system.log(PdNode(0).engine)
