"""Run a daemon object under trio until SIGINT/SIGTERM, with its status endpoint beside it."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol

import trio
from prometheus_client import CollectorRegistry
from xdc.transport.status_http import serve_status

log = logging.getLogger("xdc.daemon")


class Daemon(Protocol):
    async def serve(self, *, task_status: Any = ...) -> None: ...

    def status(self) -> dict[str, Any]: ...


async def run_daemon(
    daemon: Daemon,
    status_host: str,
    status_port: int,
    registry: CollectorRegistry,
    on_ready: Callable[[], None] | None = None,
) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            await nursery.start(daemon.serve)
            if status_port:
                await nursery.start(serve_status, status_host, status_port, daemon.status, registry)
            if on_ready is not None:
                on_ready()
            async for signum in signals:
                log.info("signal %s: shutting down", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
