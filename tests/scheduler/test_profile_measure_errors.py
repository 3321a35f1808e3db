"""`xdc profile measure` against engines that are down or answer wrongly (a real HTTP server
on loopback playing the engine): one clear line and exit 1, never a traceback or a profile
written from wrong numbers; bad flags are refused before any engine is asked."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdc.transport.launcher import free_port

from tests.hostile_engine import END, SSE_HEAD, HostileEngine, Script, event, json_answer
from tests.paths import REPO

TINY = REPO / "deploy" / "profiles" / "tiny-cpu.toml"
MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}


def measure(
    url: str, out: Path, *extra: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "xdc",
            "profile",
            "measure",
            "--pd",
            url,
            "--prfaas",
            url,
            "--base",
            str(TINY),
            "--out",
            str(out),
            "--lengths",
            "16,64",
            "--repeats",
            "1",
            "--batches",
            "1",
            "--decode-tokens",
            "4",
            "--token-ids",
            "10-100",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_failure(r: subprocess.CompletedProcess[str], out: Path, *words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("xdc profile measure: "), r.stderr
    for w in words:
        assert w in last, last
    assert not out.exists(), "a profile was written from a failed measurement"


@pytest.fixture
def engine() -> Iterator[HostileEngine]:
    e = HostileEngine(hold=20.0)
    yield e
    e.close()


def routed(models: object, completion: bytes) -> Script:
    """A script that answers /v1/models with ``models`` and a completion with ``completion``."""

    def script(eng: HostileEngine, c: socket.socket) -> None:
        line = eng.last[c][0]
        if line.startswith(b"GET /v1/models"):
            c.sendall(json_answer(models))
        else:
            c.sendall(completion)

    return script


def stream_of(n_tokens: int, prompt_tokens: int) -> bytes:
    events = b"".join(
        event({"choices": [{"index": 0, "text": "", "token_ids": [7]}]}) for _ in range(n_tokens)
    )
    usage = event({"choices": [], "usage": {"prompt_tokens": prompt_tokens}})
    return SSE_HEAD + events + usage + event(b"[DONE]") + END


def like_vllm(eng: HostileEngine, c: socket.socket) -> None:
    """Answers as vLLM would: the model list, and every prompt read whole, its tokens streamed
    one every 2 ms (as an engine's steps come)."""
    line, body = eng.last[c]
    if line.startswith(b"GET /v1/models"):
        c.sendall(json_answer(MODELS))
        return
    ask = json.loads(body)
    c.sendall(SSE_HEAD)
    for _ in range(int(ask["max_tokens"])):
        time.sleep(0.002)
        c.sendall(event({"choices": [{"index": 0, "text": "", "token_ids": [7]}]}))
    c.sendall(event({"choices": [], "usage": {"prompt_tokens": len(ask["prompt"])}}))
    c.sendall(event(b"[DONE]") + END)


def test_an_engine_that_is_down_is_named_in_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    one_line_failure(measure(url, tmp_path / "p.toml"), tmp_path / "p.toml", url, "unreachable")


@pytest.mark.parametrize("models", [{"data": []}, [{"data": []}], {"data": [{"id": 3}]}, "x"])
def test_an_engine_that_lists_no_model_is_refused(
    engine: HostileEngine, tmp_path: Path, models: object
) -> None:
    engine.script = routed(models, b"")
    one_line_failure(measure(engine.url, tmp_path / "p.toml"), tmp_path / "p.toml", "no model")


def test_an_engine_that_read_fewer_prompt_tokens_than_sent_is_not_timed(
    engine: HostileEngine, tmp_path: Path
) -> None:
    """A proxy or engine that truncates prompts would make every length look alike."""
    engine.script = routed(MODELS, stream_of(1, 5))
    r = measure(engine.url, tmp_path / "p.toml")
    one_line_failure(r, tmp_path / "p.toml", "read 5 prompt tokens of 16 sent")


def test_an_engine_that_answers_an_error_page_is_refused(
    engine: HostileEngine, tmp_path: Path
) -> None:
    engine.script = routed(MODELS, json_answer({"error": "boom"}, "500 Internal Server Error"))
    one_line_failure(measure(engine.url, tmp_path / "p.toml"), tmp_path / "p.toml", "HTTP 500")


def test_a_stalled_engine_is_given_up_at_the_budget(engine: HostileEngine, tmp_path: Path) -> None:
    def stall_completions(eng: HostileEngine, c: socket.socket) -> None:
        if eng.last[c][0].startswith(b"GET /v1/models"):
            c.sendall(json_answer(MODELS))
        else:
            eng.stall(c)

    engine.script = stall_completions
    r = measure(engine.url, tmp_path / "p.toml", "--budget-s", "2")
    one_line_failure(r, tmp_path / "p.toml", "not done within --budget-s 2")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--lengths", "512,64"], "--lengths: increasing"),
        (["--batches", "x"], "--batches: comma-separated"),
        (["--token-ids", "5-9"], "--token-ids: 0 <= LO and 16+ ids"),
        (["--repeats", "0"], "--repeats: 1..100"),
        (["--budget-s", "0"], "--budget-s: 1..86400"),
        (["--homogeneous-instances", "1"], "homogeneous_instances: must be >= 2"),
        (["--n-pd", "0"], "n_pd: must be >= 1"),
    ],
)
def test_bad_flags_are_refused_before_any_engine_is_asked(
    engine: HostileEngine, tmp_path: Path, flags: list[str], says: str
) -> None:
    r = measure(engine.url, tmp_path / "p.toml", *flags)
    assert r.returncode == 2 and says in r.stderr, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and engine.requests == 0
    assert not (tmp_path / "p.toml").exists()


def test_a_good_enough_engine_gives_a_profile_that_loads(
    engine: HostileEngine, tmp_path: Path
) -> None:
    """The whole path with a scripted engine that answers like vLLM: the output is a profile
    the router loads, with the lengths asked for (the real engine's numbers are checked in
    tests/integrations/test_vllm_profile_measure.py)."""

    engine.script = like_vllm
    out = tmp_path / "p.toml"
    r = measure(engine.url, out)
    assert r.returncode == 0, r.stderr
    from xdc.scheduler.profile import load_profile

    p = load_profile(out)
    assert p.pd.lengths == (16, 64) and p.prfaas.lengths == (16, 64)
    assert json.loads(r.stdout)["lengths"] == [16, 64]
    assert r.stderr.count(" prefill ") == 2 and r.stderr.count(" decode batch ") == 1


def test_a_transfer_that_never_reaches_the_receiver_is_named(
    engine: HostileEngine, tmp_path: Path
) -> None:
    """With --receiver-socket each PrfaaS prompt's KV must arrive there; an engine that
    answers without the connector (or a receiver that is not there) is one clear line."""

    engine.script = like_vllm
    out = tmp_path / "p.toml"
    gone = str(tmp_path / "no-receiver.sock")
    r = measure(engine.url, out, "--receiver-socket", gone, "--timeout-s", "3")
    one_line_failure(r, out, f"receiver {gone}: transfer xdc-measure-", "not delivered")


def test_tokens_a_busy_engine_streams_several_to_an_event_are_all_counted(
    engine: HostileEngine, tmp_path: Path
) -> None:
    """vLLM under load coalesces tokens into one SSE event: counting events saw 15 tokens of
    16 and refused a good engine. Each event's token_ids are counted, and the time since the
    previous event is shared among them."""

    def pairs(eng: HostileEngine, c: socket.socket) -> None:
        line, body = eng.last[c]
        if line.startswith(b"GET /v1/models"):
            c.sendall(json_answer(MODELS))
            return
        ask = json.loads(body)
        n = int(ask["max_tokens"])
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each event when it is sent
        c.sendall(SSE_HEAD)
        c.sendall(event({"choices": [{"index": 0, "text": "", "token_ids": [7]}]}))
        for _ in range((n - 1) // 2):
            time.sleep(0.004)
            c.sendall(event({"choices": [{"index": 0, "text": "", "token_ids": [7, 8]}]}))
        if (n - 1) % 2:
            c.sendall(event({"choices": [{"index": 0, "text": "", "token_ids": [7]}]}))
        c.sendall(event({"choices": [], "usage": {"prompt_tokens": len(ask["prompt"])}}))
        c.sendall(event(b"[DONE]") + END)

    engine.script = pairs
    out = tmp_path / "p.toml"
    r = measure(engine.url, out, "--decode-tokens", "9")
    assert r.returncode == 0, r.stderr
    # two tokens per 4 ms event: 2 ms a token, not 4 ms or 0
    assert 0.0015 < json.loads(r.stdout)["pd_t_decode_s"] < 0.004, r.stdout
