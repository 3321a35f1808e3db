"""The lab's vLLM fork server (xdc.lab.vllm_forkserver): engines forked from one process
that imported vLLM decode what an engine in a process of its own decodes, a killed one is
reported and reaped, and the server answers bad requests and ends with its client. (That
each engine reads its own environment is shown by the connector fault tests, whose fault
is set for one engine of a pair: the server refuses to start if it imported the connector.)"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.vllm_fixtures import PY, Engine, close_engines, prompt, test_model, vllm_env
from xdc.lab.vllm_forkserver import ForkedEngineProcess, ForkServer, ForkServerError

pytestmark = pytest.mark.vllm


def test_a_forked_engine_decodes_what_an_engine_of_its_own_decodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy bf16 on one model: the tokens of a forked engine and of a ``python -m
    xdc.lab.vllm_offline`` process are the same, prompt by prompt."""
    prompts = [prompt(n, seed=n) for n in (5, 200, 700)]
    forked = Engine("plain", model=test_model())
    try:
        assert isinstance(forked.proc, ForkedEngineProcess)
        got = [o["token_ids"] for o in forked.generate(prompts, None, 12)]
    finally:
        close_engines([forked])
    monkeypatch.setenv("XDC_VLLM_FORKSERVER", "0")
    own = Engine("plain", model=test_model())
    try:
        assert isinstance(own.proc, subprocess.Popen)
        want = [o["token_ids"] for o in own.generate(prompts, None, 12)]
    finally:
        close_engines([own])
    assert all(len(t) == 12 for t in got)
    assert got == want


def test_a_killed_forked_engine_is_reported_and_reaped() -> None:
    """SIGKILL to a forked engine's group: its exit code is -9, as a child's would be, and
    its pid is reaped (no zombie left for the server's life)."""
    e = Engine("plain", model=test_model())
    pid = e.proc.pid
    try:
        assert e.proc.poll() is None
    finally:
        e.kill()
    assert e.proc.returncode == -9
    assert not Path(f"/proc/{pid}").exists()


def test_the_fork_server_answers_bad_requests_and_ends_with_its_client() -> None:
    """Garbage, an unknown request and a spawn without its three streams are each answered
    with an error, and the server goes on answering; closing the client's end ends it."""
    log = Path(tempfile.mkstemp(prefix="xdc-forkserver-test-", suffix=".log")[1])
    server = ForkServer(str(PY), vllm_env(0), log)
    try:
        with server._lock:
            server._sock.send(b"\xff not json")
            with pytest.raises(ForkServerError, match="UnicodeDecodeError"):
                server._answer()
            server._sock.send(b"[not json")
            with pytest.raises(ForkServerError, match="JSONDecodeError"):
                server._answer()
        with pytest.raises(ForkServerError, match="unknown op"):
            server._ask({"op": "exec", "argv": ["sh"]})
        r, w = os.pipe()
        try:
            with pytest.raises(ForkServerError, match="3 descriptors, not 1"):
                server._ask({"op": "spawn", "argv": [], "env": {}, "cwd": "/"}, [r])
        finally:
            os.close(r)
            os.close(w)
        with pytest.raises(ForkServerError, match="KeyError"):
            server._ask({"op": "status"})
        for pid in (0, -1):  # waitpid's "any child": would reap another engine's pid
            with pytest.raises(ForkServerError, match="pid must be > 0"):
                server.returncode(pid)
        assert server.returncode(os.getpid()) == -1  # not its child: reported as ended
        assert server.alive()
    finally:
        server.close()
    assert server.proc.returncode == 0
    assert not log.exists()
    with pytest.raises(OSError):
        server._sock.send(b"{}")


def test_a_fork_server_that_cannot_start_says_why() -> None:
    """A server whose python (the test's own) cannot import vLLM fails with its own
    output, not a hang."""
    log = Path(tempfile.mkstemp(prefix="xdc-forkserver-test-", suffix=".log")[1])
    with pytest.raises(ForkServerError, match="exited") as err:
        ForkServer(sys.executable, dict(os.environ), log, timeout=60)
    assert "No module named 'vllm'" in str(err.value)
    assert not log.exists()
