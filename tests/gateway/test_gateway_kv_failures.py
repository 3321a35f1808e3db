"""A remote plan whose KV does not reach the decode node, as the gateway meets it (issue 28).

The prefill answers ``xdc_failed`` (its sender is down or can not reach that receiver): the
gateway has the decode instance prefill by itself at once, instead of leaving it to wait out
its arrival timeout for bytes that will not come. The decode answers ``xdc_recomputed``: the
answer stands. Either way the client's ``x-xdc-route`` and the gateway's metrics name it, and
the router that chose the plan hears it (``POST /v1/outcomes``), which is how it stops
offloading over that link or to that node. Engines and router are scripted HTTP servers on
loopback (tests/hostile_engine.py), so each answer is exactly the one under test; the
router's side of ``/v1/outcomes`` is tested against the real router in
tests/scheduler/test_api.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

from xdc.transport.launcher import free_port

from tests.gateway_fixtures import TOKEN, Proc, call, gateway
from tests.hostile_engine import HostileEngine, json_answer

HOLD_S = 20.0  # how long the decode would wait for KV: the test must not see it


def _router(eng: HostileEngine, c: socket.socket) -> None:
    line = eng.last[c][0]
    if b"/v1/route" in line:
        decision = {"prefill_node": "pf", "decode_node": "dec", "target": "prfaas"}
        c.sendall(json_answer(decision))
    elif b"/v1/outcomes" in line:
        c.sendall(json_answer({"applied": 1}))
    else:
        c.sendall(json_answer({"error": "no such path"}, status="404 Not Found"))


def _answer(tokens: list[int], kv: dict[str, Any] | None = None) -> bytes:
    out: dict[str, Any] = {
        "choices": [{"index": 0, "text": "x", "token_ids": tokens, "finish_reason": "length"}]
    }
    if kv is not None:
        out["kv_transfer_params"] = kv
    return json_answer(out)


def _gateway(port: int, pf: HostileEngine, dec: HostileEngine, router: HostileEngine) -> Proc:
    """The gateway under test: prefill node ``pf``, decode node ``dec``, the scripted router."""
    return gateway(
        port=port,
        client_tokens=(TOKEN,),
        nodes=(f"pf={pf.url}", f"dec={dec.url}"),
        router_url=router.url,
        router_token="rtok",
        fallback_prefill="dec",
        fallback_decode="dec",
    )


def _outcomes(router: HostileEngine, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = [
            f
            for line, body in list(router.seen)
            if b"/v1/outcomes" in line
            for f in json.loads(body)["failures"]
        ]
        if len(got) >= n:
            return got
        time.sleep(0.05)
    raise AssertionError(f"the router heard {router.seen[-3:]}")


def test_kv_that_will_not_come_is_recomputed_at_once_named_and_reported_to_the_router() -> None:
    mode = {"prefill": "sender_down"}

    def prefill(eng: HostileEngine, c: socket.socket) -> None:
        kvp = eng.body(c)["kv_transfer_params"]
        if mode["prefill"] == "sender_down":
            c.sendall(_answer([1], {"xdc_failed": "sender_down"}))
        else:
            n = len(eng.body(c)["prompt"])
            c.sendall(
                _answer(
                    [1], {"do_remote_prefill": True, "xdc_rid": kvp["xdc_rid"], "xdc_num_tokens": n}
                )
            )

    asked: list[dict[str, Any]] = []  # what the decode was asked to load

    def decode(eng: HostileEngine, c: socket.socket) -> None:
        kvp = eng.body(c).get("kv_transfer_params") or {}
        if kvp:
            asked.append(kvp)
        if not kvp.get("do_remote_prefill"):
            c.sendall(_answer([7, 8]))  # a plain request: it prefills itself
        elif mode["prefill"] == "sender_down":
            eng.stall(c)  # waits for KV that never comes (until the gateway cancels it)
        else:
            c.sendall(_answer([7, 8], {"xdc_recomputed": "receiver_gone"}))

    pf, dec = HostileEngine(prefill, hold=HOLD_S), HostileEngine(decode, hold=HOLD_S)
    router = HostileEngine(_router)
    port = free_port()
    gw = _gateway(port, pf, dec, router)
    try:
        ask = {"model": "m", "prompt": list(range(1, 300)), "max_tokens": 2}
        t0 = time.monotonic()
        st, headers, body = call(port, "/v1/completions", ask)
        took = time.monotonic() - t0
        assert st == 200 and body["choices"][0]["token_ids"] == [7, 8], body
        route = headers["x-xdc-route"]
        assert "source=recovery" in route and "kv_recomputed=sender_down" in route, route
        assert took < 5.0, took  # no wait for the decode's arrival timeout (HOLD_S)
        (f,) = _outcomes(router, 1)
        assert f == {
            "rid": headers["x-xdc-rid"],
            "cluster": "prfaas",
            "decode_node": "dec",
            "reason": "sender_down",
            "stage": "prefill",
        }, f
        # the KV was handed over but the decode recomputed anyway: its answer stands
        mode["prefill"] = "ok"
        st, headers, body = call(port, "/v1/completions", ask)
        assert st == 200 and body["choices"][0]["token_ids"] == [7, 8], body
        route = headers["x-xdc-route"]
        assert "path=remote" in route and "kv_recomputed=receiver_gone" in route, route
        # the decode waits for the transfer to begin as long as the gateway waits for the
        # prefill (gateway.prefill_timeout_s, 30 s by default): a prefill queued at PrfaaS
        # begins late
        assert asked and all(
            (k["xdc_timeout_s"], k["xdc_arrival_s"]) == (60.0, 30.0) for k in asked
        ), asked
        second = _outcomes(router, 2)[1]
        assert (second["reason"], second["stage"], second["decode_node"]) == (
            "receiver_gone",
            "decode",
            "dec",
        )
        _, _, metrics = call(port, "/metrics", token=None)
        for line in (
            'xdc_gateway_kv_recomputed_total{decode="dec",reason="sender_down"} 1.0',
            'xdc_gateway_kv_recomputed_total{decode="dec",reason="receiver_gone"} 1.0',
            'xdc_gateway_prefill_failures_total{reason="sender_down"} 1.0',
        ):
            assert line in metrics, metrics[-3000:]
        assert "Traceback" not in gw.log(), gw.log()
    finally:
        gw.stop()
        for e in (pf, dec, router):
            e.close()


def test_a_remote_prefill_that_hands_its_kv_over_is_timed_per_prefill_node() -> None:
    """``xdc_gateway_prefill_seconds{prefill}``: how long the PrfaaS engine took, queue and
    prefill, as the gateway saw it (the bench splits a remote plan's TTFT with it), also
    reported to the router (``prefills`` of ``/v1/outcomes``); a failed prefill is not a
    prefill time and is neither counted nor reported."""

    handed = threading.Event()
    mode = {"prefill": "ok"}

    def prefill(eng: HostileEngine, c: socket.socket) -> None:
        body = eng.body(c)
        time.sleep(0.3)
        if mode["prefill"] != "ok":
            c.sendall(_answer([1], {"xdc_failed": "sender_down"}))
            return
        kvp = body["kv_transfer_params"]
        n = len(body["prompt"])
        c.sendall(
            _answer(
                [1], {"do_remote_prefill": True, "xdc_rid": kvp["xdc_rid"], "xdc_num_tokens": n}
            )
        )
        handed.set()

    def decode(eng: HostileEngine, c: socket.socket) -> None:
        kvp = eng.body(c).get("kv_transfer_params") or {}
        if kvp.get("do_remote_prefill") and mode["prefill"] == "ok":
            handed.wait(10)  # the KV "arrives" once the prefill has answered
            time.sleep(0.1)
        elif kvp.get("do_remote_prefill"):
            eng.stall(c)
            return
        c.sendall(_answer([7, 8]))

    pf, dec = HostileEngine(prefill, hold=HOLD_S), HostileEngine(decode, hold=HOLD_S)
    router = HostileEngine(_router)
    port = free_port()
    gw = _gateway(port, pf, dec, router)
    try:
        ask = {"model": "m", "prompt": list(range(1, 300)), "max_tokens": 2}
        st, headers, _ = call(port, "/v1/completions", ask)
        assert st == 200 and "path=remote" in headers["x-xdc-route"], headers
        mode["prefill"] = "sender_down"
        st, headers, _ = call(port, "/v1/completions", ask)
        assert st == 200 and "kv_recomputed=sender_down" in headers["x-xdc-route"], headers
        _, _, metrics = call(port, "/metrics", token=None)
        assert 'xdc_gateway_prefill_seconds_count{prefill="pf"} 1.0' in metrics, metrics[-3000:]
        (total,) = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith('xdc_gateway_prefill_seconds_sum{prefill="pf"}')
        ]
        assert 0.3 <= total < 5.0, total
        # and the router hears it: its drift signal where it cannot scrape the PrfaaS engines
        deadline = time.monotonic() + 10
        timed: list[dict[str, Any]] = []
        while not timed and time.monotonic() < deadline:
            timed = [
                e
                for line, body in list(router.seen)
                if b"/v1/outcomes" in line
                for e in json.loads(body).get("prefills", [])
            ]
            time.sleep(0.05)
        assert len(timed) == 1, router.seen[-3:]
        assert timed[0]["cluster"] == "prfaas" and timed[0]["uncached_tokens"] == 299, timed
        assert 0.3 <= timed[0]["seconds"] < 5.0, timed
    finally:
        gw.stop()
        for e in (pf, dec, router):
            e.close()
