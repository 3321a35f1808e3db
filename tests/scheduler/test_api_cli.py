"""`xdc router` as a real process: prints its URL, serves, shuts down cleanly on signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.paths import REPO

REPO = REPO


def _start(*extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "xdc", "router", "--host", "127.0.0.1", "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",  # the default profile must be found relative to the package, not the CWD
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_router_serves_and_stops_on_signal(sig: signal.Signals) -> None:
    proc = _start("--set", "router.gateway_token=gw", "--set", "router.daemon_token=dm")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("xdc router listening on http://127.0.0.1:"), line
        url = line.split()[4]
        assert "prfaas-case-study.toml" in line
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            assert json.load(r)["ok"] is True
        req = urllib.request.Request(
            f"{url}/v1/route",
            data=json.dumps({"rid": "cli", "prompt_len": 5000}).encode(),
            headers={"Authorization": "Bearer gw", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.load(r)["target"] == "pd"
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_router_generates_tokens_when_unset() -> None:
    proc = _start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = proc.stdout.readline().split()[4]
        tokens = {}
        for _ in range(2):
            msg = proc.stderr.readline()
            name = msg.split("router.")[1].split()[0]
            tokens[name] = msg.rsplit(" ", 1)[1].strip()
        assert set(tokens) == {"gateway_token", "daemon_token"}
        req = urllib.request.Request(
            f"{url}/v1/route",
            data=b'{"rid": "x", "prompt_len": 10}',
            headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 401
        req.add_header("Authorization", f"Bearer {tokens['gateway_token']}")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_missing_profile_is_a_clear_error() -> None:
    proc = _start("--profile", "/nonexistent/profile.toml")
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert "/nonexistent/profile.toml" in err and "cannot read" in err
