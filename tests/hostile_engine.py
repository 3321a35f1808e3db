"""A hostile or broken engine for the gateway to meet: a real HTTP/1.1 server on loopback whose
answer to each request is a script (stall, cut, garbage, endless lines, wrongly typed JSON...),
the way a wedged vLLM, a proxy in between or an attacker who took an engine's port would answer.
A script sees the connection itself, so a test can also watch what the gateway does to it (a
send that fails once the gateway hung up is how a client leaving is seen to drop the engine
request)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

Script = Callable[["HostileEngine", socket.socket], None]

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
END = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(obj: Any) -> bytes:
    """One SSE ``data:`` event as a chunk (``obj`` is JSON-encoded unless it is bytes)."""
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return chunk(b"data: " + body + b"\n\n")


def token(i: int) -> dict[str, Any]:
    """A well-formed vLLM completion stream chunk carrying token ``i``."""
    return {
        "id": "cmpl-engine",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": f"t{i}", "token_ids": [i], "finish_reason": None}],
    }


def json_answer(obj: Any, status: str = "200 OK") -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


class HostileEngine:
    """Serves every connection with ``script`` (settable between requests); ``hold`` is how
    long a script that stalls keeps the connection; ``requests`` counts what it was asked."""

    def __init__(self, script: Script | None = None, hold: float = 30.0) -> None:
        self.script: Script = script or (lambda eng, c: None)
        self.hold = hold
        self.requests = 0
        # what each connection asked last: (request line, body), and every request so far
        self.last: dict[socket.socket, tuple[bytes, bytes]] = {}
        self.seen: list[tuple[bytes, bytes]] = []
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)
        self._accept.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._accept.join(5)
        self._listener.close()
        for c in self._conns:
            c.close()
        for t in self._threads:
            t.join(5)

    def stall(self, c: socket.socket) -> None:
        """Hold the connection open, sending nothing, until the peer closes it (or ``hold``)."""
        c.settimeout(0.1)
        deadline = time.monotonic() + self.hold
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                if c.recv(4096) == b"":
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._conns.append(c)
            t = threading.Thread(target=self._serve, args=(c,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, c: socket.socket) -> None:
        c.settimeout(10)
        try:
            while self._read_request(c):
                self.requests += 1
                self.script(self, c)
        except OSError:
            pass  # the gateway hung up: what a script that sends into a closed peer meets

    def body(self, c: socket.socket) -> Any:
        """The JSON body of the request this connection is being answered for."""
        return json.loads(self.last[c][1] or b"null")

    def _read_request(self, c: socket.socket) -> bool:
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = c.recv(65536)
            if not data:
                return False
            buf += data
        head, _, body = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            data = c.recv(65536)
            if not data:
                return False
            body += data
        line = head.split(b"\r\n", 1)[0]
        self.last[c] = (line, body)
        self.seen.append((line, body))
        return True
