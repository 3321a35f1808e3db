"""Router HTTP API on a real loopback server: auth, validation, 413/415/429, metrics, OpenAPI,
the background replanner, and a hypothesis fuzz of every write endpoint asserting no 5xx."""

from __future__ import annotations

import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xdc.scheduler.cacheindex import chain_hashes
from xdc.scheduler.planner import threshold_for_bandwidth
from xdc.scheduler.profile import Profile
from xdc.scheduler.service import router_app as api
from xdc.scheduler.service.openapi import document
from xdc.scheduler.service.router_app import SERVICE

from tests.router_fixtures import DM, GW, Clock, LiveRouter, router_config


@pytest.fixture
def router(profile: Profile) -> Iterator[LiveRouter]:
    r = LiveRouter(router_config(), profile)
    yield r
    r.close()


@pytest.fixture
def clocked(profile: Profile) -> Iterator[LiveRouter]:
    r = LiveRouter(router_config(), profile, Clock())
    yield r
    r.close()


def link_body(
    state: str = "ok",
    util: float = 0.2,
    at: float = 1.0,
    cap: float = 100e9,
    reporter: str = "sender-0",
    src: str = "prfaas",
) -> dict[str, Any]:
    return {
        "from_cluster": src,
        "to_cluster": "pd",
        "reporter": reporter,
        "utilisation": util,
        "goodput_bps": util * cap,
        "capacity_bps": cap,
        "state": state,
        "retrans_ratio": 0.0,
        "rtt_ms": 2.0,
        "updated_at": at,
    }


# --- read endpoints ---------------------------------------------------------------------------


def test_read_endpoints(router: LiveRouter) -> None:
    assert router.call("GET", "/healthz") == (
        200,
        {"ok": True, "shared_state": {"backend": "memory"}},
    )
    status, plan = router.call("GET", "/v1/plan")
    assert status == 200
    assert (plan["n_prfaas"], plan["n_p"], plan["n_d"]) == (4, 3, 5)
    assert 15_000 < plan["base_t"] < 25_000  # the case study's t = 19.4K
    status, state = router.call("GET", "/v1/state")
    assert status == 200 and state["link"] is None and len(state["nodes"]) == 12
    status, text = router.call("GET", "/metrics")
    assert status == 200 and "xdc_router_threshold_tokens" in text


def test_openapi_document_is_valid_and_matches_routes(router: LiveRouter) -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    status, doc = router.call("GET", "/openapi.json")
    assert status == 200 and doc == json.loads(json.dumps(document()))
    validator.validate(doc)
    served = {
        (r.method, r.resource.canonical)
        for r in router.app.router.routes()
        if r.resource is not None and r.method != "HEAD"
    }
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == served


# --- auth -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/route", "/v1/cache/events", "/v1/links", "/v1/nodes"])
def test_writes_need_the_right_token(router: LiveRouter, path: str) -> None:
    body = {"rid": "a", "prompt_len": 10}
    assert router.call("POST", path, body)[0] == 401
    status, err = router.call("POST", path, body, token="nope")
    assert status == 401 and err["error"] == "wrong bearer token"
    status, err = router.call("POST", path, body, headers={"Authorization": "Basic Z3c6Z3c="})
    assert status == 401 and "bearer" in err["error"]
    # the other kind of token does not open this endpoint
    other = DM if path == "/v1/route" else GW
    assert router.call("POST", path, body, token=other)[0] == 401


def test_empty_token_config_disables_writes(profile: Profile) -> None:
    r = LiveRouter(router_config(gateway_token=""), profile)
    try:
        status, err = r.call("POST", "/v1/route", {"rid": "a", "prompt_len": 10}, token="")
        assert status == 401 and "disabled" in err["error"]
    finally:
        r.close()


def test_auth_is_checked_before_the_body_is_read(router: LiveRouter) -> None:
    status, _ = router.call("POST", "/v1/route", raw=b"x" * 200_000)
    assert status == 401


# --- body validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"{", "invalid JSON"),
        (b"", "empty"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "expected object"),
        (b'{"rid": "a", "prompt_len": NaN}', "NaN"),
        (b'{"rid": "a", "prompt_len": 1e999}', "does not fit a 64-bit float"),
        (b"[" * 5000 + b"]" * 5000, "nested deeper"),
        (b'{"rid": "a", "prompt_len": ' + b"9" * 5000 + b"}", "invalid JSON"),
        (b'{"rid": "\\ud800", "prompt_len": 5}', "lone UTF-16 surrogate"),
        (b'{"rid": "a", "prompt_len": 5, "\\udfff": 1}', "lone UTF-16 surrogate"),
    ],
)
def test_malformed_json_is_400(router: LiveRouter, raw: bytes, needle: str) -> None:
    status, err = router.call("POST", "/v1/route", raw=raw, token=GW)
    assert status == 400
    assert needle in json.dumps(err)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"rid": "a"}, "missing required field(s): prompt_len"),
        ({"rid": "a", "prompt_len": "10"}, "body.prompt_len: expected integer, got string"),
        ({"rid": "a", "prompt_len": True}, "body.prompt_len: expected integer, got boolean"),
        ({"rid": "a", "prompt_len": 10.0}, "body.prompt_len: expected integer, got number"),
        ({"rid": "a", "prompt_len": 0}, "body.prompt_len: must be >= 1"),
        ({"rid": "", "prompt_len": 5}, "body.rid: shorter than 1"),
        ({"rid": "a", "prompt_len": 5, "colour": 1, "zz": 2}, "unknown field(s) 'colour', 'zz'"),
        (
            {"rid": "a", "prompt_len": 5, "block_hashes": [1, -2]},
            "body.block_hashes[1]: must be >= 0",
        ),
        ({"rid": "a", "prompt_len": 5, "block_hashes": [2**64]}, "must be <= 18446744073709551615"),
        ({"rid": "a", "prompt_len": 5, "token_ids": [2**32]}, "body.token_ids[0]: must be <="),
        ({"rid": "a", "prompt_len": 5, "block_hashes": [], "token_ids": []}, "not both"),
        ({"rid": "a", "prompt_len": 512, "block_hashes": [1, 2]}, "do not fit prompt_len 512"),
        ({"rid": "a", "prompt_len": 2, "token_ids": [1, 2, 3]}, "3 tokens but prompt_len is 2"),
        ({"rid": "a", "prompt_len": 5, "ttft_slo_s": 0}, "body.ttft_slo_s: must be > 0"),
    ],
)
def test_wrong_fields_are_400_naming_the_field(
    router: LiveRouter, body: dict[str, Any], needle: str
) -> None:
    status, err = router.call("POST", "/v1/route", body, token=GW)
    assert status == 400
    assert needle in json.dumps(err)


def test_body_over_limit_is_413(router: LiveRouter) -> None:
    big = {"rid": "a", "prompt_len": 10, "block_hashes": list(range(200_000))}
    status, err = router.call("POST", "/v1/route", big, token=GW)
    assert status == 413 and "exceeds" in err["error"]


def test_chunked_body_over_limit_is_413(router: LiveRouter) -> None:
    """No Content-Length: the limit must still hold while streaming."""
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as s:
        head = (
            "POST /v1/route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            f"Authorization: Bearer {GW}\r\nContent-Type: application/json\r\n\r\n"
        )
        s.sendall(head.encode())
        chunk = b"[" + b"1," * 32_000
        try:
            for _ in range(40):
                s.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may close early after answering
        reply = s.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413"), reply[:80]


def test_stalled_oversize_upload_is_answered_then_dropped(
    router: LiveRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that declares a huge body and stalls gets its 413, then the connection is
    closed; the router does not wait on it (aiohttp alone would linger for 10 s)."""
    monkeypatch.setattr(api, "DRAIN_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", router.port), timeout=5) as s:
        head = (
            "POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n"
            f"Authorization: Bearer {GW}\r\nContent-Type: application/json\r\n\r\n"
        )
        s.sendall(head.encode() + b"[" * 10_000)
        t0 = time.monotonic()
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
        waited = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 413"), reply[:80]
    assert b"exceeds" in reply
    assert waited < 3.0


def test_wrong_content_type_is_415(router: LiveRouter) -> None:
    status, err = router.call(
        "POST",
        "/v1/route",
        raw=b'{"rid": "a", "prompt_len": 1}',
        token=GW,
        headers={"Content-Type": "text/plain"},
    )
    assert status == 415 and "text/plain" in err["error"]


def test_unknown_path_and_method_are_json_4xx(router: LiveRouter) -> None:
    status, err = router.call("GET", "/v1/nope")
    assert status == 404 and "error" in err
    status, err = router.call("GET", "/v1/route")
    assert status == 405 and "error" in err


# --- routing through the API ------------------------------------------------------------------


def test_route_returns_decision_with_nodes_ttft_and_reasons(router: LiveRouter) -> None:
    status, d = router.call("POST", "/v1/route", {"rid": "short-1", "prompt_len": 4000}, token=GW)
    assert status == 200
    assert d["rid"] == "short-1" and d["target"] == "pd" and not d["rejected"]
    assert d["prefill_node"].startswith("pd-") and d["decode_node"].startswith("pd-")
    assert d["predicted_ttft_s"] > 0 and d["reasons"]
    status, d = router.call("POST", "/v1/route", {"rid": "long-1", "prompt_len": 100_000}, token=GW)
    assert status == 200 and d["target"] == "prfaas" and d["prefill_node"].startswith("prfaas-")


def test_cache_events_feed_routing_and_token_ids_hash_like_block_hashes(router: LiveRouter) -> None:
    tokens = list(range(40 * 512))
    hashes = chain_hashes(tokens, 512)
    ev = {"kind": "stored", "cluster": "prfaas", "node": "prfaas-2", "seq": 1, "token_ids": tokens}
    status, ack = router.call("POST", "/v1/cache/events", {"events": [ev]}, token=DM)
    assert status == 200 and ack == {"applied": 1, "changed": 1, "entries": 40, "replicated": None}
    # duplicate delivery changes nothing
    assert router.call("POST", "/v1/cache/events", {"events": [ev]}, token=DM)[1]["changed"] == 0
    assert router.call("POST", "/v1/links", link_body(), token=DM)[0] == 200
    # 30,000 tokens, 20,480 cached in PrfaaS; abundant bandwidth -> PD-P with a cache transfer
    req = {"rid": "r", "prompt_len": 30_000, "block_hashes": hashes}
    status, d = router.call("POST", "/v1/route", req, token=GW)
    assert status == 200 and d["mode"] == "abundant"
    assert d["target"] == "pd" and d["cached_tokens"] == 20_480
    assert d["cache_transfer"]["source_node"] == "prfaas-2"
    assert d["cache_transfer"]["blocks"] == 40
    req_tokens = {"rid": "r2", "prompt_len": 30_000, "token_ids": tokens + [7] * 9520}
    status, d2 = router.call("POST", "/v1/route", req_tokens, token=GW)
    assert status == 200 and d2["cached_tokens"] == 20_480
    # an eviction newer than the store removes the prefix
    evict = {"kind": "evicted", "cluster": "prfaas", "node": "prfaas-2", "seq": 2}
    evict["block_hashes"] = hashes
    assert router.call("POST", "/v1/cache/events", {"events": [evict]}, token=DM)[0] == 200
    status, d3 = router.call("POST", "/v1/route", {**req, "rid": "r3"}, token=GW)
    assert d3["cached_tokens"] == 0


def test_a_gateway_routes_by_published_scheme_keys_instead_of_token_ids(
    router: LiveRouter,
) -> None:
    """Issue 26 finding 8: a 200k-token prompt's ids did not fit the 1 MiB body; its block
    keys per published scheme do, and give the same decision."""
    from xdc.scheduler.cacheintake import scheme_from

    status, pub = router.call("GET", "/v1/schemes")
    assert status == 200 and pub["default"] == "xdc" and pub["block_size"] == 512
    schemes = [scheme_from(d) for d in pub["schemes"]]
    tokens = [(i * 31) % 30_000 for i in range(200_000)]
    ev = {"kind": "stored", "cluster": "prfaas", "node": "prfaas-1", "seq": 1}
    ev["block_hashes"] = chain_hashes(tokens[: 64 * 512], 512)
    assert router.call("POST", "/v1/cache/events", {"events": [ev]}, token=DM)[0] == 200
    keys = [{"scheme": s.name, "hashes": s.keys(tokens)} for s in schemes]
    body = {"rid": "long", "prompt_len": len(tokens), "scheme_keys": keys}
    assert len(json.dumps(body)) < 1 << 20 < len(json.dumps({"token_ids": tokens}))
    status, d = router.call("POST", "/v1/route", body, token=GW)
    assert status == 200 and d["cached_tokens"] == 64 * 512, d
    for bad, says in [
        ({**body, "token_ids": [1]}, "one"),
        ({**body, "scheme_keys": keys + keys}, "given twice"),
        ({**body, "prompt_len": 512}, "do not fit prompt_len"),
    ]:
        status, err = router.call("POST", "/v1/route", bad, token=GW)
        assert status == 400 and says in json.dumps(err), err


def test_rejection_is_429_with_reason(router: LiveRouter) -> None:
    body = {"rid": "tight", "prompt_len": 100_000, "ttft_slo_s": 0.5}
    status, d = router.call("POST", "/v1/route", body, token=GW)
    assert status == 429 and d["rejected"] is True
    assert "no choice meets TTFT SLO 0.50s" in d["reasons"][-1]
    _, text = router.call("GET", "/metrics")
    assert 'xdc_router_rejections_total{cause="ttft_slo"} 1.0' in text


def test_node_reports_steer_load_and_replace_placeholders(router: LiveRouter) -> None:
    _, st = router.call("GET", "/v1/state")
    assert {n["name"] for n in st["nodes"] if n["cluster"] == "pd"} == {f"pd-{i}" for i in range(8)}
    nodes = [
        {"name": "h20-a", "cluster": "pd", "role": "prefill", "queue_s": 50.0},
        {"name": "h20-b", "cluster": "pd", "role": "prefill", "queue_s": 0.5},
        {"name": "h20-c", "cluster": "pd", "role": "prefill", "queue_s": 20.0},
        {"name": "h20-d", "cluster": "pd", "role": "decode", "decode_load": 0.9},
        {"name": "h20-e", "cluster": "pd", "role": "decode", "decode_load": 0.1},
    ]
    status, ack = router.call("POST", "/v1/nodes", {"nodes": nodes}, token=DM)
    assert status == 200 and ack == {
        "applied": 5,
        "nodes": 9,
        "replicated": None,
    }  # PrfaaS placeholders stay
    _, st = router.call("GET", "/v1/state")
    assert {n["name"] for n in st["nodes"] if n["cluster"] == "pd"} == {f"h20-{c}" for c in "abcde"}
    _, d = router.call("POST", "/v1/route", {"rid": "x", "prompt_len": 2000}, token=GW)
    assert (d["prefill_node"], d["decode_node"]) == ("h20-b", "h20-e")
    assert d["queue_s"] == pytest.approx(0.5, abs=0.05)
    # decodes the engine holds whose KV is on its way count, though they hold no KV yet
    busy = {"name": "h20-e", "cluster": "pd", "role": "decode", "decode_load": 0.1}
    busy["decode_waiting"] = 1000
    status, _ = router.call("POST", "/v1/nodes", {"nodes": [busy]}, token=DM)
    assert status == 200
    _, d = router.call("POST", "/v1/route", {"rid": "x2", "prompt_len": 2000}, token=GW)
    assert d["decode_node"] == "h20-d"
    busy["decode_waiting"] = -1
    status, err = router.call("POST", "/v1/nodes", {"nodes": [busy]}, token=DM)
    assert status == 400 and "decode_waiting" in str(err), err
    busy["decode_waiting"] = 0
    router.call("POST", "/v1/nodes", {"nodes": [busy]}, token=DM)
    # an unhealthy node takes no work
    router.call(
        "POST",
        "/v1/nodes",
        {"nodes": [{"name": "h20-b", "cluster": "pd", "role": "prefill", "healthy": False}]},
        token=DM,
    )
    _, d = router.call("POST", "/v1/route", {"rid": "y", "prompt_len": 2000}, token=GW)
    # the remaining PD-P queues (20 s, 50 s) miss the 10 s SLO: PrfaaS takes the short request
    assert d["target"] == "prfaas" and any("misses SLO" in r for r in d["reasons"])
    # a lone surrogate in a node's name used to be stored, then every /v1/route answer
    # that named the node failed to encode: 500 for everyone
    raw = b'{"nodes": [{"name": "h20-\\ud800", "cluster": "pd", "role": "decode"}]}'
    status, err = router.call("POST", "/v1/nodes", raw=raw, token=DM)
    assert status == 400 and "surrogate" in str(err["problems"]), err
    status, d = router.call("POST", "/v1/route", {"rid": "z", "prompt_len": 2000}, token=GW)
    assert status == 200, d
    bad = {"nodes": [{"name": "prfaas-0", "cluster": "prfaas", "role": "decode"}]}
    status, err = router.call("POST", "/v1/nodes", bad, token=DM)
    assert status == 400 and "PrfaaS nodes only prefill" in err["error"]


def test_congested_link_raises_t_and_clearing_restores_it(profile: Profile) -> None:
    # The short-term loop alone (no capacity-triggered replan): a congested link that dropped
    # to 5 Gbps raises t geometrically, but only up to the planner's t for what it delivers.
    clocked = LiveRouter(router_config(replan_capacity_change=1e9), profile, Clock())
    try:
        _check_raise_bounded_and_decay(clocked, profile)
    finally:
        clocked.close()


def _check_raise_bounded_and_decay(clocked: LiveRouter, profile: Profile) -> None:
    clock = clocked.clock
    assert clock is not None
    _, plan = clocked.call("GET", "/v1/plan")
    base = plan["base_t"]
    t5 = threshold_for_bandwidth(profile, plan["n_p"], plan["n_d"], 5.0)
    assert base * 1.5 < t5 < base * 1.5**2  # so the bound, not max_raise, stops the raise
    status, ack = clocked.call(
        "POST", "/v1/links", link_body("congested", 0.95, at=1.0, cap=5e9), token=DM
    )
    assert status == 200 and ack["accepted"] and ack["bandwidth"] == "scarce"
    clock.now += 1.0
    _, d = clocked.call("POST", "/v1/route", {"rid": "a", "prompt_len": 25_000}, token=GW)
    assert d["effective_t"] == pytest.approx(base * 1.5, rel=1e-6)
    assert d["target"] == "pd"  # 25,000 > base t would offload; the raised t keeps it local
    for k in range(10):  # ten more seconds of pressure: x1.5 per second would reach 57x base
        clock.now += 1.0
        hot = link_body("congested", 0.95, at=2.0 + k, cap=5e9)
        assert clocked.call("POST", "/v1/links", hot, token=DM)[1]["accepted"]
    _, d = clocked.call("POST", "/v1/route", {"rid": "a2", "prompt_len": 25_000}, token=GW)
    # bounded by the planner's t for what the congested link delivers (95% of 5 Gbps)
    t_usable = threshold_for_bandwidth(profile, plan["n_p"], plan["n_d"], 0.95 * 5.0)
    assert t5 < t_usable < base * 1.5**2
    assert d["effective_t"] == pytest.approx(t_usable, rel=1e-3)
    # a late report older than the one held is ignored
    _, ack = clocked.call("POST", "/v1/links", link_body("ok", 0.1, at=0.5, cap=5e9), token=DM)
    assert ack["accepted"] is False
    at = 13.0
    for _ in range(3):  # inside the 5 s staleness window each time
        clock.now += 4.0
        ok = link_body("ok", 0.2, at=at, cap=5e9)
        assert clocked.call("POST", "/v1/links", ok, token=DM)[1]["accepted"]
        at += 4.0
    _, st = clocked.call("GET", "/v1/state")
    assert base < st["threshold"]["effective_t"] < t_usable
    for _ in range(60):  # 240 s: 24 half-lives
        clock.now += 4.0
        clocked.call("POST", "/v1/links", link_body("ok", 0.2, at=at, cap=5e9), token=DM)
        at += 4.0
    _, st = clocked.call("GET", "/v1/state")
    assert st["threshold"]["effective_t"] == pytest.approx(base)
    assert st["counts"]["capacity_replans"] == 0
    # silence: after 2 s the link is dark (nothing offloads over it); after 5 s the held
    # state is stale too -> unknown -> scarce
    clock.now += 6.0
    _, d = clocked.call("POST", "/v1/route", {"rid": "b", "prompt_len": 1000}, token=GW)
    assert "link prfaas->pd dark: no report for 6.0s" in d["reasons"][0], d["reasons"]
    assert d["mode"] == "scarce" and any("no live link report" in r for r in d["reasons"])


def test_capacity_drop_replans_early_and_rate_limits(profile: Profile) -> None:
    # 300 s timer, but the link falls from the profile's 100 Gbps to 5: the router re-solves t
    # for 5 Gbps at once; a second big change within replan_min_interval_s waits.
    r = LiveRouter(router_config(replan_interval_s=300.0, replan_min_interval_s=60.0), profile)
    try:
        _, plan = r.call("GET", "/v1/plan")
        base = plan["base_t"]
        now = time.monotonic()
        r.call("POST", "/v1/links", link_body("ok", 0.2, at=now, cap=5e9), token=DM)
        deadline = time.monotonic() + 5
        st: dict[str, Any] = {}
        while time.monotonic() < deadline:
            _, st = r.call("GET", "/v1/state")
            if st["counts"]["replans"] >= 1:
                break
            time.sleep(0.02)
        assert st["counts"]["capacity_replans"] == 1 and st["counts"]["replans"] == 1
        while time.monotonic() < deadline:
            _, plan = r.call("GET", "/v1/plan")
            if plan["recommendation"] is not None:
                break
            time.sleep(0.02)
        # 5 Gbps cannot carry the 100 Gbps plan's offload: the re-solved t is much higher
        assert plan["base_t"] > 1.3 * base
        # back to 100 Gbps within a minute: no second replan yet (rate limit)
        r.call("POST", "/v1/links", link_body("ok", 0.2, at=time.monotonic(), cap=100e9), token=DM)
        # the report's handler decided at once: had it woken the replanner, the replan would
        # be pending or done
        _, st = r.call("GET", "/v1/state")
        assert st["counts"]["capacity_replans"] == 1 and st["replan_pending"] is False, st
    finally:
        r.close()


def test_route_logs_one_line_per_decision_with_the_request_id(
    router: LiveRouter, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="xdc.router"):
        router.call("POST", "/v1/route", {"rid": "req-7f3a", "prompt_len": 1000}, token=GW)
        router.call(
            "POST",
            "/v1/route",
            {"rid": "req-slow", "prompt_len": 1000, "ttft_slo_s": 1e-6},
            token=GW,
        )
    lines = [r.getMessage() for r in caplog.records if r.name == "xdc.router"]
    ok = [m for m in lines if m.startswith("route req-7f3a ")]
    assert len(ok) == 1
    assert re.fullmatch(
        r"route req-7f3a -> pd prefill pd-\d+ decode pd-\d+ uncached 1000 t \d+ ttft [\d.]+ \| "
        r".*uncached in PD.*",
        ok[0],
    ), ok[0]
    bad = [m for m in lines if m.startswith("route req-slow ")]
    assert len(bad) == 1 and "rejected" in bad[0] and "TTFT SLO" in bad[0], bad


def test_metrics_count_decisions(router: LiveRouter) -> None:
    for i in range(3):
        router.call("POST", "/v1/route", {"rid": f"s{i}", "prompt_len": 1000}, token=GW)
    router.call("POST", "/v1/route", {"rid": "l", "prompt_len": 90_000}, token=GW)
    router.call("POST", "/v1/route", {"rid": "dry", "prompt_len": 1000, "dry_run": True}, token=GW)
    router.call("POST", "/v1/route", {"rid": 5}, token=GW)
    _, text = router.call("GET", "/metrics")
    assert 'xdc_router_decisions_total{target="pd"} 4.0' in text  # dry runs count as decisions
    assert 'xdc_router_decisions_total{target="prfaas"} 1.0' in text
    assert "xdc_router_route_seconds_count 5.0" in text
    assert 'xdc_router_http_client_errors_total{status="400"} 1.0' in text
    assert "xdc_router_offload_fraction 0.2" in text
    _, st = router.call("GET", "/v1/state")
    assert st["counts"]["decisions"] == 4  # the dry run is not booked


def test_background_replanner_publishes_recommendation(profile: Profile) -> None:
    r = LiveRouter(router_config(replan_interval_s=0.1), profile)
    try:
        # make the PD cluster decode-heavy by hand: 1 prefill / 7 decode
        nodes = [
            {"name": f"pd-{i}", "cluster": "pd", "role": "prefill" if i == 0 else "decode"}
            for i in range(8)
        ]
        assert r.call("POST", "/v1/nodes", {"nodes": nodes}, token=DM)[0] == 200
        deadline = time.monotonic() + 5
        rec = None
        while time.monotonic() < deadline:
            _, plan = r.call("GET", "/v1/plan")
            rec = plan["recommendation"]
            if rec is not None and rec["current_n_p"] == 1:
                break
            time.sleep(0.05)
        assert rec is not None and rec["current_n_p"] == 1
        assert rec["n_p"] > 1 and rec["role_changes"]
        assert all(c["to"] == "prefill" for c in rec["role_changes"])
        assert rec["lambda_max"] > rec["lambda_current"]
        _, text = r.call("GET", "/metrics")
        assert 'xdc_router_recommended_role_changes{to_role="prefill"}' in text
    finally:
        r.close()


# --- fuzz -------------------------------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)

_VALID: dict[str, dict[str, Any]] = {
    "/v1/route": {"rid": "f", "prompt_len": 3000, "block_hashes": [1, 2, 3], "ttft_slo_s": 5.0},
    "/v1/cache/events": {
        "events": [
            {"kind": "stored", "cluster": "pd", "node": "pd-1", "seq": 3, "block_hashes": [1]}
        ]
    },
    "/v1/links": link_body(),
    "/v1/nodes": {"nodes": [{"name": "pd-1", "cluster": "pd", "role": "prefill", "queue_s": 1.0}]},
    "/v1/outcomes": {
        "failures": [
            {"cluster": "prfaas", "decode_node": "pd-4", "reason": "timeout", "stage": "decode"}
        ]
    },
}

_GATEWAY_PATHS = ("/v1/route", "/v1/outcomes")


def _mutate(base: dict[str, Any], key: str, value: object, drop: bool) -> dict[str, Any]:
    out = dict(base)
    if drop and out:
        out.pop(sorted(out)[len(key) % len(out)])
    else:
        out[key] = value
    return out


@pytest.fixture(scope="module")
def fuzz_router(profile: Profile) -> Iterator[LiveRouter]:
    r = LiveRouter(router_config(), profile)
    yield r
    r.close()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    path=st.sampled_from(sorted(_VALID)),
    body=_json,
    key=st.sampled_from(
        ["rid", "prompt_len", "events", "state", "nodes", "utilisation", "failures", "x"]
    ),
    drop=st.booleans(),
    mode=st.sampled_from(["random", "mutated", "nested"]),
)
def test_fuzz_json_inputs_never_5xx(
    fuzz_router: LiveRouter, path: str, body: object, key: str, drop: bool, mode: str
) -> None:
    if mode == "random":
        payload: object = body
    elif mode == "mutated":
        payload = _mutate(_VALID[path], key, body, drop)
    else:  # a valid envelope with a random element inside the list/field
        inner = _VALID[path]
        lst = next((k for k, v in inner.items() if isinstance(v, list)), None)
        payload = dict(inner)
        if lst is not None and isinstance(payload, dict):
            payload[lst] = [*inner[lst], body]
    token = GW if path in _GATEWAY_PATHS else DM
    status, resp = fuzz_router.call("POST", path, payload, token=token)
    assert status < 500, (status, resp)
    assert status in (200, 400, 429), (status, resp)


_name = st.text(st.characters(codec="utf-8"), min_size=1, max_size=128)
_nonneg = st.floats(min_value=0, max_value=1e300, allow_nan=False, allow_infinity=False)
_hashes = st.lists(st.integers(0, 2**64 - 1), max_size=40)
_schema_valid: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "/v1/route": st.fixed_dictionaries(
        {"rid": _name, "prompt_len": st.integers(1, 2**24)},
        optional={
            "block_hashes": _hashes,
            "ttft_slo_s": st.floats(min_value=1e-9, max_value=86400),
            "dry_run": st.booleans(),
        },
    ),
    "/v1/cache/events": st.fixed_dictionaries(
        {
            "events": st.lists(
                st.fixed_dictionaries(
                    {
                        "kind": st.sampled_from(["stored", "evicted"]),
                        "cluster": st.sampled_from(["prfaas", "pd"]),
                        "node": _name,
                        "seq": st.integers(0, 2**63 - 1),
                    },
                    optional={
                        "block_hashes": _hashes,
                        "token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=1100),
                    },
                ),
                max_size=4,
            )
        }
    ),
    "/v1/links": st.fixed_dictionaries(
        {
            "from_cluster": st.just("prfaas"),
            "to_cluster": st.just("pd"),
            "reporter": _name,
            "utilisation": st.floats(0, 1e3),
            "goodput_bps": st.floats(0, 1e15),
            "capacity_bps": st.floats(0, 1e15),
            "state": st.sampled_from(["ok", "warn", "congested"]),
            "retrans_ratio": st.floats(0, 1),
            "rtt_ms": st.floats(0, 3.6e6),
            "updated_at": st.floats(0, 1e11),
        }
    ),
    "/v1/nodes": st.fixed_dictionaries(
        {
            "nodes": st.lists(
                st.fixed_dictionaries(
                    {
                        "name": _name,
                        "cluster": st.sampled_from(["prfaas", "pd"]),
                        "role": st.sampled_from(["prefill", "decode"]),
                    },
                    optional={
                        "queue_s": st.floats(0, 86400),
                        "queue_depth": st.integers(0, 1_000_000),
                        "decode_load": st.floats(0, 100),
                        "healthy": st.booleans(),
                    },
                ),
                max_size=4,
            )
        }
    ),
    "/v1/outcomes": st.fixed_dictionaries(
        {
            "failures": st.lists(
                st.fixed_dictionaries(
                    {
                        "cluster": st.sampled_from(["prfaas", "pd", "x"]),
                        "decode_node": st.text(min_size=1, max_size=64),
                        "reason": st.from_regex(r"[a-z_]{1,32}", fullmatch=True),
                        "stage": st.sampled_from(["prefill", "decode"]),
                    },
                    optional={"rid": _name},
                ),
                max_size=4,
            )
        },
        optional={
            "prefills": st.lists(
                st.fixed_dictionaries(
                    {
                        "cluster": st.sampled_from(["prfaas", "pd", "x"]),
                        "seconds": st.floats(1e-9, 86_400),
                        "uncached_tokens": st.integers(1, 1 << 24),
                    },
                    optional={"rid": _name},
                ),
                max_size=4,
            )
        },
    ),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), path=st.sampled_from(sorted(_VALID)))
def test_fuzz_schema_valid_bodies_never_5xx(
    fuzz_router: LiveRouter, data: st.DataObject, path: str
) -> None:
    """Bodies that pass validation, with extreme values, exercise the handlers themselves."""
    body = data.draw(_schema_valid[path])
    token = GW if path in _GATEWAY_PATHS else DM
    status, resp = fuzz_router.call("POST", path, body, token=token)
    assert status in (200, 400, 429), (status, resp)
    if path == "/v1/links":
        assert status == 200, resp  # every schema-valid link report is accepted or ignored


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(sorted(_VALID)), raw=st.binary(max_size=300))
def test_fuzz_raw_bytes_never_5xx(fuzz_router: LiveRouter, path: str, raw: bytes) -> None:
    token = GW if path in _GATEWAY_PATHS else DM
    status, _ = fuzz_router.call("POST", path, raw=raw, token=token)
    assert status in (200, 400), status


def test_fuzz_found_no_server_errors(fuzz_router: LiveRouter) -> None:
    """Runs after the two fuzz tests on the same router: no 500 was ever logged, and the
    fuzzing reached both the rejection paths and the handlers behind validation."""
    _, text = fuzz_router.call("GET", "/metrics")
    assert "xdc_router_http_server_errors_total 0.0" in text
    assert 'xdc_router_http_client_errors_total{status="400"}' in text
    counts = fuzz_router.app[SERVICE].counts
    assert counts["decisions"] > 0 and counts["events"] > 0 and counts["link_reports"] > 0


def test_a_number_beyond_a_double_is_named_as_such(router: LiveRouter) -> None:
    """It was refused as 'expected number, got number' (the stdlib read it as infinity)."""
    body = json.dumps(link_body()).replace('"utilisation": 0.2', '"utilisation": 1e400')
    status, err = router.call("POST", "/v1/links", raw=body.encode(), token=DM)
    assert status == 400
    text = json.dumps(err)
    assert "1e400 does not fit a 64-bit float" in text and "got number" not in text


def test_a_request_id_with_control_characters_cannot_forge_a_log_line(
    router: LiveRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xdc.router")
    rid = "evil\nroute fake -> pd prefill x\x00"
    status, out = router.call("POST", "/v1/route", {"rid": rid, "prompt_len": 1000}, token=GW)
    assert status == 200 and out["rid"] == rid  # echoed back intact, in JSON
    lines = [r.getMessage() for r in caplog.records if "route" in r.getMessage()]
    assert lines and all("\n" not in line and "\x00" not in line for line in lines), lines
    assert any(repr(rid) in line for line in lines)


def test_one_replan_log_line_stays_short_however_many_nodes_change() -> None:
    from xdc.scheduler.longterm import RoleChange
    from xdc.scheduler.service.router_app import summarize_role_changes

    changes = [RoleChange(f"pd-{i}", "decode", "prefill") for i in range(300)]
    line = summarize_role_changes(changes)
    assert len(line) < 300, line
    assert "300 role changes (300 decode->prefill)" in line and "295 more" in line


# --- failure reports and dark links (scheduler.outages) ---------------------------------------


def _long(clocked: LiveRouter, rid: str) -> dict[str, Any]:
    status, d = clocked.call("POST", "/v1/route", {"rid": rid, "prompt_len": 40_000}, token=GW)
    assert status == 200, d
    return dict(d)


def test_failure_reports_take_the_link_or_node_they_blame_out_of_offloading(
    clocked: LiveRouter,
) -> None:
    clock = clocked.clock
    assert clock is not None
    fail = {"cluster": "prfaas", "decode_node": "pd-4", "reason": "sender_down", "stage": "prefill"}
    assert clocked.call("POST", "/v1/links", link_body(at=1.0), token=DM)[1]["accepted"]
    assert _long(clocked, "a")["target"] == "prfaas"
    # only the gateway may report, and only about what the profile has
    assert clocked.call("POST", "/v1/outcomes", {"failures": [fail]}, token=DM)[0] == 401
    bad = {**fail, "cluster": "elsewhere"}
    status, err = clocked.call("POST", "/v1/outcomes", {"failures": [bad]}, token=GW)
    assert status == 400 and "elsewhere" in str(err), err
    # the prefill's sender is down: nothing offloads over that link, at once
    status, ack = clocked.call("POST", "/v1/outcomes", {"failures": [fail]}, token=GW)
    assert status == 200 and ack["blamed"] == ["link"] and "prfaas" in ack["links_down"], ack
    d = _long(clocked, "b")
    assert d["target"] == "pd", d
    assert any("sender_down" in r for r in d["reasons"]), d["reasons"]
    # ... until the sender reports again (it is back)
    clock.now += 0.5
    assert clocked.call("POST", "/v1/links", link_body(at=2.0), token=DM)[1]["accepted"]
    assert _long(clocked, "c")["target"] == "prfaas"
    # a decode node whose receiver is gone takes no offloaded KV; the others still do
    d = _long(clocked, "d")
    gone = {**fail, "decode_node": d["decode_node"], "reason": "receiver_gone", "stage": "decode"}
    assert clocked.call("POST", "/v1/outcomes", {"failures": [gone]}, token=GW)[1]["blamed"] == [
        "intake"
    ]
    for i in range(6):
        d2 = _long(clocked, f"e{i}")
        assert d2["target"] == "prfaas" and d2["decode_node"] != d["decode_node"], d2
    # an ambiguous reason counts once, then takes the link out when it repeats
    maybe = {**fail, "reason": "never_arrived", "stage": "decode"}
    clocked.call("POST", "/v1/outcomes", {"failures": [maybe]}, token=GW)
    assert _long(clocked, "f")["target"] == "prfaas"
    clocked.call("POST", "/v1/outcomes", {"failures": [maybe]}, token=GW)
    assert _long(clocked, "g")["target"] == "pd"
    # and it holds for router.outage_hold_s, reports or not
    clock.now += 1.0
    assert clocked.call("POST", "/v1/links", link_body(at=3.0), token=DM)[1]["accepted"]
    assert _long(clocked, "h")["target"] == "pd"
    clock.now += 10.5
    assert clocked.call("POST", "/v1/links", link_body(at=4.0), token=DM)[1]["accepted"]
    assert _long(clocked, "i")["target"] == "prfaas"
    # a link that goes silent is dark after router.link_dark_s (2 s)
    clock.now += 1.5
    assert _long(clocked, "j")["target"] == "prfaas"
    clock.now += 1.0
    d = _long(clocked, "k")
    assert d["target"] == "pd" and "dark: no report for 2.5s" in d["reasons"][0], d
    _, state = clocked.call("GET", "/v1/state")
    assert "prfaas" in state["outages"]["links_down"], state["outages"]
    failures = {(f["reason"], f["decode_node"]): f["count"] for f in state["outages"]["failures"]}
    assert failures[("sender_down", "pd-4")] == 1 and failures[("never_arrived", "pd-4")] == 2
    _, text = clocked.call("GET", "/metrics")
    assert 'xdc_router_link_down{link="prfaas->pd"} 1.0' in text
    assert (
        'xdc_router_kv_failures_total{blamed="link",decode="pd-4",link="prfaas->pd",'
        'reason="sender_down"} 1.0' in text
    ), [ln for ln in text.splitlines() if "kv_failures" in ln]


def test_gateway_prefill_times_correct_prfaas_drift_only_where_no_engine_is_scraped(
    profile: Profile,
) -> None:
    """Across datacenters the router may not reach the PrfaaS engines' /metrics: then the
    gateway's timings of remote prefills are the PrfaaS drift signal. Where it does scrape
    them, those engines' own histograms are (the gateway's time includes their queue)."""
    per = profile.prfaas.prefill_time(8192)
    slow = {"cluster": "prfaas", "seconds": 3 * per, "uncached_tokens": 8192}
    blind = LiveRouter(router_config(), profile)
    try:
        status, ack = blind.call(
            "POST", "/v1/outcomes", {"failures": [], "prefills": [slow] * 10}, token=GW
        )
        assert status == 200 and ack["prefills_timed"] == 10 and ack["applied"] == 0, ack
        _, state = blind.call("GET", "/v1/state")
        factor = state["profile_drift"]["measured"]["prfaas"]["factor"]
        assert factor == pytest.approx(3.0, rel=0.01)
        assert state["counts"]["gateway_prefills"] == 10
        bad = {**slow, "cluster": "elsewhere"}
        status, err = blind.call(
            "POST", "/v1/outcomes", {"failures": [], "prefills": [bad]}, token=GW
        )
        assert status == 400 and "elsewhere" in str(err), err
        status, err = blind.call(
            "POST", "/v1/outcomes", {"failures": [], "prefills": [{**slow, "seconds": 0}]}, token=GW
        )
        assert status == 400, err
    finally:
        blind.close()
    seeing = LiveRouter(
        router_config(vllm_metrics=("prfaas/pf-0@prefill=http://127.0.0.1:9/metrics",)), profile
    )
    try:
        status, ack = seeing.call(
            "POST", "/v1/outcomes", {"failures": [], "prefills": [slow] * 10}, token=GW
        )
        assert status == 200 and ack["prefills_timed"] == 0, ack
        _, state = seeing.call("GET", "/v1/state")
        assert state["profile_drift"]["measured"]["prfaas"]["factor"] == 1.0
        assert state["counts"]["gateway_prefills"] == 10
    finally:
        seeing.close()
