"""The gateway as a real process (`xdc gateway` on loopback) and a client's HTTP call to it:
the rig the gateway tests share."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

TOKEN = "client-secret"


class Proc:
    """An ``xdc`` subcommand as a child process, started once ``ready`` is on its output.
    Its output keeps being read into ``lines`` (a test can look for a traceback in it, and a
    chatty child never blocks on a full pipe)."""

    def __init__(self, argv: list[str], ready: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xdc", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        deadline = time.monotonic() + 20
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if ready in line:
                self._reader = threading.Thread(target=self._read_rest, daemon=True)
                self._reader.start()
                return
        self.stop()
        raise AssertionError("".join(self.lines))

    def _read_rest(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def gateway(**sets: Any) -> Proc:
    port = sets.pop("port")
    argv = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--model", "m"]
    for k, v in sets.items():
        value = ",".join(v) if isinstance(v, tuple) else v  # a list setting, as --set takes it
        argv += ["--set", f"gateway.{k}={value}"]
    return Proc(argv, "xdc gateway listening")


def call(
    port: int, path: str, body: Any = None, *, token: str | None = TOKEN, raw: bytes | None = None
) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            text = r.read().decode()
            return r.status, dict(r.headers), json.loads(text) if text.startswith("{") else text
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        return e.code, dict(e.headers), json.loads(text) if text.startswith("{") else text


def completion_body(ids: list[int], max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    """A greedy completion of token ids for `xdc up`'s model (``xdc-test``)."""
    return {
        "model": "xdc-test",
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
        "stream": stream,
    }


def route_fields(headers: Any) -> dict[str, str]:
    """The ``x-xdc-route`` header as fields, plus the gateway's request id as ``rid``."""
    raw = headers.get("x-xdc-route", "")
    route = dict(p.split("=", 1) for p in raw.split("; ") if "=" in p)
    route["rid"] = headers.get("x-xdc-rid", "")
    return route
