"""A minimal HTTP/1.1 endpoint inside the trio daemons: ``GET /status`` (JSON), ``GET /metrics``
(Prometheus text), ``GET /healthz``.

The daemons are trio programs and aiohttp is asyncio, so rather than run a second event loop
in a thread, this serves the three read-only GETs a scraper and ``xdc monitor`` need, with
hard limits on request size and time so a slow or hostile client cannot tie it up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from xdc.errors import StartupError

log = logging.getLogger("xdc.status")
MAX_REQUEST = 8192


async def serve_status(
    host: str,
    port: int,
    status: Callable[[], dict[str, Any]],
    registry: CollectorRegistry,
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as e:
        raise StartupError(f"status endpoint {host}:{port}: {e.strerror or e}") from None
    bound = listeners[0].socket.getsockname()[1]
    log.info("status endpoint on http://%s:%d/status", host, bound)
    task_status.started(bound)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(5):
                data = b""
                while b"\r\n\r\n" not in data and len(data) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    data += chunk
                line = data.split(b"\r\n", 1)[0].decode("latin-1").split()
                code, ctype, body = 404, "text/plain", b"not found\n"
                if len(line) < 2 or line[0] != "GET":
                    code, body = 405, b"only GET\n"
                elif line[1].split("?")[0] == "/status":
                    code, ctype = 200, "application/json"
                    body = json.dumps(status(), default=str).encode()
                elif line[1].split("?")[0] == "/metrics":
                    code, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(registry)
                elif line[1].split("?")[0] == "/healthz":
                    code, body = 200, b"ok\n"
                reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}[code]
                head = (
                    f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                )
                await stream.send_all(head.encode() + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    await trio.serve_listeners(handle, listeners)
