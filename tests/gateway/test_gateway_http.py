"""The gateway as a client and an operator meet it, without engines: real `xdc gateway` and
`xdc router` processes on loopback. Bad input gets OpenAI-shaped 4xx bodies, a router 429
becomes a 429 with Retry-After, a router that cannot be reached means the static fallback
(counted), and hostile bytes on the socket do not take the gateway down."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from xdc.transport.launcher import free_port

from tests.gateway_fixtures import TOKEN, Proc, call, gateway
from tests.paths import REPO

PROFILE = REPO / "deploy/profiles/tiny-cpu.toml"


@pytest.fixture
def refusing_router() -> Iterator[tuple[int, str]]:
    """A real router whose TTFT SLO nothing can meet: every route is a 429."""
    port = free_port()
    r = Proc(
        [
            "router",
            "--profile",
            str(PROFILE),
            "--port",
            str(port),
            "--set",
            "router.gateway_token=gwtok",
            "--set",
            "router.daemon_token=dtok",
            "--set",
            "router.block_size=32",
            "--set",
            "router.ttft_slo_s=0.000001",
        ],
        "xdc router listening",
    )
    yield port, "gwtok"
    r.stop()


def test_client_errors_are_openai_shaped_and_router_429_passes_through(
    refusing_router: tuple[int, str],
) -> None:
    rport, rtok = refusing_router
    port = free_port()
    dead = free_port()
    gw = gateway(
        port=port,
        client_tokens=(TOKEN,),
        router_url=f"http://127.0.0.1:{rport}",
        router_token=rtok,
        nodes=(f"pd-x=http://127.0.0.1:{dead}",),
        fallback_prefill="pd-x",
        fallback_decode="pd-x",
        max_body_bytes=4096,
    )
    try:
        ok = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
        st, _, body = call(port, "/v1/completions", ok, token=None)
        assert st == 401 and body["error"]["code"] == "invalid_api_key", body
        st, _, body = call(port, "/v1/completions", ok, token="wrong")
        assert st == 401
        st, _, body = call(port, "/v1/completions", raw=b"{not json")
        assert st == 400 and body["error"]["type"] == "invalid_request_error", body
        for deep in (b"[" * 2000 + b"]" * 2000, b"[" * 4000):  # within max_body_bytes 4096
            st, _, body = call(port, "/v1/completions", raw=deep)  # was a RecursionError: 500
            assert st == 400 and body["error"]["type"] == "invalid_request_error", body
        st, _, body = call(port, "/v1/completions", {**ok, "kv_transfer_params": {}})
        assert st == 400 and body["error"]["param"] == "kv_transfer_params", body
        st, _, body = call(port, "/v1/completions", {**ok, "model": "gpt-9"})
        assert st == 404 and body["error"]["code"] == "model_not_found", body
        st, _, body = call(port, "/v1/completions", {**ok, "prompt": list(range(5000))})
        assert st == 413, body
        st, _, body = call(port, "/v1/chat/completions", {"model": "m", "messages": "hi"})
        assert st == 400 and body["error"]["param"] == "messages", body
        st, _, body = call(port, "/v1/nowhere", ok)
        assert st == 404
        st, _, body = call(port, "/v1/models")
        assert st == 200 and body["data"][0]["id"] == "m", body
        # the router refuses: the client gets 429 + Retry-After, not a fallback
        st, headers, body = call(port, "/v1/completions", ok)
        assert st == 429 and int(headers["Retry-After"]) >= 1, (st, body)
        assert body["error"]["code"] == "rate_limit_exceeded", body
        # a body that arrives in two pieces is read whole (it reaches the router: 429)
        body_bytes = json.dumps(ok).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body_bytes)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head + body_bytes[:10])
            time.sleep(0.3)
            s.sendall(body_bytes[10:])
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 429"), answer[:300]
        # hostile bytes on the socket, then it still serves
        for junk in (
            b"\x00" * 5000,
            b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n{",
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(junk)
                s.settimeout(5)
                with contextlib.suppress(OSError):
                    s.recv(1024)
        st, _, body = call(port, "/healthz", token=None)
        assert st == 200 and body["router"] == "up", body
        _, _, metrics = call(port, "/metrics", token=None)
        assert re.search(r"xdc_gateway_router_rejections_total 2\.0", metrics), metrics
    finally:
        gw.stop()


def test_a_prompt_too_long_for_a_body_of_token_ids_still_reaches_the_router(
    refusing_router: tuple[int, str],
) -> None:
    """Issue 26 finding 8: past ~130k tokens the gateway's route body (every token id) went
    over the router's 1 MiB cap; the router answered 413 and the gateway quietly took the
    static fallback. Now it sends block keys per published scheme: this router decides
    (here: 429), and no fallback is counted."""
    rport, rtok = refusing_router
    port, dead = free_port(), free_port()
    gw = gateway(
        port=port,
        client_tokens=(TOKEN,),
        router_url=f"http://127.0.0.1:{rport}",
        router_token=rtok,
        router_timeout_s=5,
        max_body_bytes=16 << 20,
        nodes=(f"pd-x=http://127.0.0.1:{dead}",),
        fallback_prefill="pd-x",
        fallback_decode="pd-x",
    )
    try:
        for n in (200_000, 1 << 20):  # 1 MiB tokens: keys for a leading part only
            prompt = [(i * 7) % 30_000 for i in range(n)]
            st, _, body = call(port, "/v1/completions", {"model": "m", "prompt": prompt})
            assert st == 429, (st, body)
        _, _, metrics = call(port, "/metrics", token=None)
        assert "xdc_gateway_router_fallbacks_total{" not in metrics, metrics
        assert re.search(
            r'xdc_gateway_route_prefix_partial_total\{kind="truncated"\} 1\.0', metrics
        )
    finally:
        gw.stop()


def test_router_down_means_the_static_fallback_counted_and_no_fallback_means_503() -> None:
    port, port2 = free_port(), free_port()
    dead_router, dead_engine = free_port(), free_port()
    nodes = (f"pd-x=http://127.0.0.1:{dead_engine}",)
    gw = gateway(
        port=port,
        router_url=f"http://127.0.0.1:{dead_router}",
        nodes=nodes,
        fallback_prefill="pd-x",
        fallback_decode="pd-x",
    )
    gw2 = gateway(port=port2, router_url=f"http://127.0.0.1:{dead_router}", nodes=nodes)
    try:
        ok = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
        t0 = time.monotonic()
        st, _headers, body = call(port, "/v1/completions", ok, token=None)
        # the fallback ran (its engine is down too, so 502 from the engine, not from routing)
        assert st == 502 and body["error"]["code"] == "engine_error", body
        assert time.monotonic() - t0 < 10
        _, _, metrics = call(port, "/metrics", token=None)
        assert re.search(
            r'xdc_gateway_router_fallbacks_total\{reason="unreachable"\} 1\.0', metrics
        )
        st, _, body = call(port2, "/v1/completions", ok, token=None)
        assert st == 503 and "fallback" in body["error"]["message"], body
        st, _, body = call(port2, "/healthz", token=None)
        assert body["router"] == "down", body
    finally:
        gw.stop()
        gw2.stop()


def test_bad_gateway_config_is_refused_with_every_problem_named() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "xdc",
            "gateway",
            "--set",
            "gateway.nodes=a=ftp://x",
            "--set",
            "gateway.router_url=router:8080",
            "--set",
            "gateway.prefill_timeout_s=0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2, res
    for want in ("gateway.nodes", "gateway.router_url", "gateway.prefill_timeout_s"):
        assert want in res.stderr, res.stderr


def _slow_client(port: int, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head)
    return s


def _closed_by_peer(s: socket.socket, within: float, drip: bytes = b"") -> float:
    """Seconds until the gateway closes ``s`` (reading what it answered), sending ``drip`` every
    0.25 s meanwhile; fails if it is still open after ``within``."""
    t0 = time.monotonic()
    s.settimeout(0.25)
    while time.monotonic() - t0 < within:
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            if drip:
                with contextlib.suppress(OSError):
                    s.sendall(drip)
        except ConnectionResetError:
            return time.monotonic() - t0
    raise AssertionError(f"connection still open after {within}s")


def test_clients_that_trickle_headers_or_bodies_are_cut_off_in_bounded_time() -> None:
    """Slowloris and slow-POST: a connection is a descriptor, and aiohttp on its own keeps one
    without a finished request head for an hour."""
    port = free_port()
    gw = gateway(
        port=port,
        nodes=("pd=http://127.0.0.1:9",),
        fallback_prefill="pd",
        fallback_decode="pd",
        idle_timeout_s=2,
        body_timeout_s=2,
    )
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
        silent = [_slow_client(port, head) for _ in range(20)]
        dripping = _slow_client(port, head)
        body = _slow_client(
            port, head + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        assert call(port, "/healthz")[0] == 200  # the others are not held up meanwhile
        assert _closed_by_peer(dripping, within=12, drip=b"X-A: b\r\n") >= 1.5
        for s in silent:
            assert _closed_by_peer(s, within=5) >= 0
            s.close()
        body.settimeout(12)
        answer = body.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"body not received within 2s" in answer, answer
        dripping.close()
        body.close()
        assert gw.proc.poll() is None
        assert call(port, "/healthz")[0] == 200
    finally:
        gw.stop()
