"""The gateway against an engine that misbehaves: one that never answers, stalls mid-stream,
cuts a stream short, sends a line without end, answers wrongly typed JSON or no HTTP at all
(tests/hostile_engine.py, a real server on loopback), and a client that leaves mid-stream.

What must hold every time: the client gets an OpenAI-shaped error (a 502 before the answer
started, an error event and no ``[DONE]`` after), within the gateway's request timeout; no
engine bytes of the wrong shape reach the client; a client that leaves makes the gateway drop
the engine request at once; and the gateway neither dies nor logs a traceback."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from xdc.transport.launcher import free_port

from tests.gateway_fixtures import Proc, call, gateway
from tests.hostile_engine import (
    END,
    SSE_HEAD,
    HostileEngine,
    chunk,
    event,
    json_answer,
    token,
)

TIMEOUT_S = 2.0  # gateway.request_timeout_s here
SLACK_S = 6.0  # what a noisy machine may add to it


def _gateway_before(engine: HostileEngine, **sets: Any) -> tuple[Proc, int]:
    """A gateway whose one node ("pd", prefill and decode) is ``engine``."""
    port = free_port()
    gw = gateway(
        port=port,
        nodes=(f"pd={engine.url}",),
        fallback_prefill="pd",
        fallback_decode="pd",
        request_timeout_s=TIMEOUT_S,
        **sets,
    )
    return gw, port


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[HostileEngine, Proc, int]]:
    engine = HostileEngine(hold=TIMEOUT_S + SLACK_S + 5)
    gw, port = _gateway_before(engine)
    try:
        yield engine, gw, port
    finally:
        gw.stop()
        engine.close()


@pytest.fixture
def engine(rig: tuple[HostileEngine, Proc, int]) -> Iterator[HostileEngine]:
    """The module's engine, its record cleared; after the test the gateway must still be up,
    healthy and free of tracebacks."""
    eng, gw, port = rig
    mark = len(gw.lines)
    yield eng
    assert gw.proc.poll() is None, gw.log()
    assert call(port, "/healthz")[0] == 200
    logged = "".join(gw.lines[mark:])
    assert "Traceback" not in logged, logged


@pytest.fixture
def port(rig: tuple[HostileEngine, Proc, int]) -> int:
    return rig[2]


def _body(stream: bool) -> bytes:
    return json.dumps(
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": stream}
    ).encode()


def _post(port: int, stream: bool) -> tuple[int, bytes, float]:
    """Status, whole body (http.client raises IncompleteRead if a chunked answer is cut, so a
    stream must also end properly) and seconds taken."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S + SLACK_S + 10)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", _body(stream), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - t0
    finally:
        conn.close()


def _events(body: bytes) -> list[Any]:
    out: list[Any] = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _error_message(answer: Any) -> str:
    assert isinstance(answer, dict) and set(answer) == {"error"}, answer
    assert answer["error"]["type"] == "server_error", answer
    message = answer["error"]["message"]
    assert isinstance(message, str)
    return message


def test_an_engine_that_never_answers_is_a_502_naming_the_timeout(
    engine: HostileEngine, port: int
) -> None:
    engine.script = lambda eng, c: eng.stall(c)
    for stream in (False, True):
        status, body, took = _post(port, stream)
        assert status == 502, body
        assert f"no complete answer within {TIMEOUT_S:g}s" in _error_message(json.loads(body))
        assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + SLACK_S


def _stalls_after_one_token(eng: HostileEngine, c: socket.socket) -> None:
    c.sendall(SSE_HEAD + event(token(0)))
    eng.stall(c)


def _endless_line(eng: HostileEngine, c: socket.socket) -> None:
    c.sendall(SSE_HEAD + event(token(0)))
    for _ in range(32):  # 2 MiB without a newline: 4x aiohttp's line limit
        c.sendall(chunk(b"x" * 65536))
    eng.stall(c)


def _cut_without_done(eng: HostileEngine, c: socket.socket) -> None:
    c.sendall(SSE_HEAD + event(token(0)) + event(token(1)) + END)


@pytest.mark.parametrize(
    ("script", "why"),
    [
        (_stalls_after_one_token, f"no complete answer within {TIMEOUT_S:g}s"),
        (_endless_line, "unreadable answer"),
        (_cut_without_done, "stream ended without [DONE]"),
    ],
    ids=["stalls", "endless-line", "cut-short"],
)
def test_a_stream_that_breaks_ends_with_an_error_event_and_no_done(
    engine: HostileEngine, port: int, script: Any, why: str
) -> None:
    engine.script = script
    status, body, took = _post(port, stream=True)
    assert status == 200
    events = _events(body)
    assert "[DONE]" not in events, events
    assert [e["choices"][0]["text"] for e in events[:-1]] in (["t0"], ["t0", "t1"]), events
    assert why in _error_message(events[-1])
    assert took < TIMEOUT_S + SLACK_S


WRONG_ANSWERS: dict[str, tuple[bytes, str]] = {
    "a number": (b"5", "answer is not a JSON object"),
    "choices a number": (b'{"choices": 5}', "choices is not a list of objects"),
    "choices of strings": (b'{"choices": ["x"]}', "choices is not a list of objects"),
    "text a number": (b'{"choices": [{"text": 5}]}', "choices[0].text is not a string"),
    "token ids of strings": (
        b'{"choices": [{"text": "a", "token_ids": ["x"]}]}',
        "choices[0].token_ids is not a list of token ids",
    ),
    "negative token id": (
        b'{"choices": [{"text": "a", "token_ids": [-1]}]}',
        "choices[0].token_ids is not a list of token ids",
    ),
    "finish_reason an object": (
        b'{"choices": [{"text": "a", "finish_reason": {}}]}',
        "choices[0].finish_reason is not a string",
    ),
    "usage a string": (b'{"choices": [{"text": "a"}], "usage": "lots"}', "usage is not an object"),
    "not JSON": (b"{nope", "answer is not JSON"),
    "nested 50,000 deep": (b"[" * 50000 + b"]" * 50000, "answer is not JSON"),
}


@pytest.mark.parametrize("case", list(WRONG_ANSWERS))
def test_a_wrongly_shaped_answer_is_a_502_and_none_of_it_is_relayed(
    engine: HostileEngine, port: int, case: str
) -> None:
    payload, why = WRONG_ANSWERS[case]
    engine.script = lambda eng, c: c.sendall(json_answer(payload))
    status, body, _ = _post(port, stream=False)
    assert status == 502, body
    message = _error_message(json.loads(body))
    assert why in message, message


# the same answers as stream events: what the stream path says where it differs
STREAM_WHY = {
    "a number": "answer is not an object",
    "not JSON": "bad SSE event",
    "nested 50,000 deep": "bad SSE event",
}


@pytest.mark.parametrize("case", list(WRONG_ANSWERS))
def test_a_wrongly_shaped_stream_event_ends_the_stream_with_an_error_event(
    engine: HostileEngine, port: int, case: str
) -> None:
    payload, why = WRONG_ANSWERS[case]
    why = STREAM_WHY.get(case, why)

    def script(eng: HostileEngine, c: socket.socket) -> None:
        c.sendall(SSE_HEAD + event(token(0)) + event(payload) + event(b"[DONE]") + END)

    engine.script = script
    status, body, _ = _post(port, stream=True)
    assert status == 200
    events = _events(body)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["t0"], events
    message = _error_message(events[-1])
    assert why in message, message


def test_an_answer_that_is_not_http_is_a_502(engine: HostileEngine, port: int) -> None:
    engine.script = lambda eng, c: c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n" + b"\x00" * 100)
    for stream in (False, True):
        status, body, took = _post(port, stream)
        assert status == 502, body
        assert "engine failed" in _error_message(json.loads(body))
        assert took < TIMEOUT_S + SLACK_S


def test_a_client_leaving_mid_stream_makes_the_gateway_drop_the_engine_request(
    engine: HostileEngine, port: int
) -> None:
    hung_up: list[float] = []
    sent = [0]

    def slow_tokens(eng: HostileEngine, c: socket.socket) -> None:
        c.sendall(SSE_HEAD)
        for i in range(200):  # 20 s of tokens unless the gateway hangs up first
            try:
                c.sendall(event(token(i)))
            except OSError:
                hung_up.append(time.monotonic())
                return
            sent[0] += 1
            time.sleep(0.1)

    engine.script = slow_tokens
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = _body(stream=True)
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    got = b""
    while got.count(b"data: ") < 3:
        data = client.recv(65536)
        assert data, got
        got += data
    client.close()
    left = time.monotonic()
    deadline = left + 5
    while not hung_up and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hung_up, "the gateway kept the engine request after its client left"
    assert hung_up[0] - left < 2.0
    assert 3 <= sent[0] < 30, sent
    requests = engine.requests
    time.sleep(0.5)  # a window for a retry the gateway would make right after the hang-up
    assert engine.requests == requests, "the gateway asked the engine again for nobody"


def test_a_router_answer_with_a_header_injection_or_bad_reasons_is_contained(
    engine: HostileEngine,
) -> None:
    """The router's words reach the client in the x-xdc-route header and the 429 message: a
    target with CRLF in it must not become a header of its own (aiohttp refuses it with a 500),
    and reasons that are not a list must not turn a 429 into a 500."""

    def engine_answers(eng: HostileEngine, c: socket.socket) -> None:
        c.sendall(json_answer({"choices": [{"text": "ok", "token_ids": [7]}]}))

    engine.script = engine_answers
    answers = iter(
        [
            json_answer(
                {"prefill_node": "pd", "decode_node": "pd", "target": "pd\r\nSet-Cookie: a=b"}
            ),
            json_answer({"accepted": False, "reasons": 5}, status="429 Too Many Requests"),
        ]
    )
    router = HostileEngine(lambda eng, c: c.sendall(next(answers)))
    gw, port = _gateway_before(engine, router_url=router.url)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        conn.request("POST", "/v1/completions", _body(False), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200, body
        assert resp.getheader("Set-Cookie") is None
        assert "target=?" in (resp.getheader("x-xdc-route") or ""), resp.getheaders()
        conn.request("POST", "/v1/completions", _body(False), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 429, body
        assert "TTFT SLO" in _error_message_any(json.loads(body))
        conn.close()
        assert "Traceback" not in gw.log(), gw.log()
    finally:
        gw.stop()
        router.close()


def _error_message_any(answer: Any) -> str:
    assert isinstance(answer, dict) and "error" in answer, answer
    return str(answer["error"]["message"])


def test_a_text_prompt_that_tokenises_past_the_cap_is_refused_not_forwarded(
    engine: HostileEngine, port: int
) -> None:
    """Issue 26 finding 8: a prompt of token ids is held to 1,048,576 tokens, a text prompt
    was not (2,000,002 tokens were forwarded). Now its token count is checked too."""
    tokens = json_answer({"tokens": [5] * 2_000_002, "count": 2_000_002})
    engine.script = lambda eng, c: c.sendall(tokens)
    asked = engine.requests
    body = json.dumps({"model": "m", "prompt": "a very long text", "max_tokens": 5}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        status, answer = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 400 and "2000002 tokens, more than 1048576" in answer["error"]["message"]
    assert answer["error"]["param"] == "prompt", answer
    assert engine.requests == asked + 1  # the tokenize call only: nothing was forwarded
