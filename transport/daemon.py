"""Run a daemon object under trio until SIGINT/SIGTERM, with its status endpoint beside it.

The first signal starts a graceful shutdown (the daemon stops taking new work and drains
in-flight transfers within its deadline), after which the process exits 0; a second signal
cuts the drain short and exits at once, for an operator who cannot wait.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol

import trio
from prometheus_client import CollectorRegistry
from xdc.transport.engine_socket import PASS_FD, EngineSocket
from xdc.transport.pool import BufferPool
from xdc.transport.shm import sweep_stale_segments
from xdc.transport.status_http import serve_status

from xdc.config import DataThreads
from xdc.errors import StartupError

log = logging.getLogger("xdc.daemon")


class Daemon(Protocol):
    async def serve(self, *, task_status: Any = ...) -> None: ...

    async def shutdown(self) -> None:
        """Stop taking new work, then drain or fail what is in flight; returns when done."""

    def status(self) -> dict[str, Any]: ...


def link_description(tls: bool, data_threads: DataThreads, workers: int = 0) -> str:
    """How a daemon's peer link is carried, for its start-up line (``workers``: the data
    worker processes it starts, which take every connection's payloads they can)."""
    if tls:
        on = data_threads.sealed
        text = "mutual TLS 1.3" + (", payloads in data threads (sealed records)" if on else "")
    else:
        text = "plain TCP: tls.mode = off" + (
            ", payloads in data threads" if data_threads.plain else ""
        )
    if workers:
        text += f", {workers} data worker process{'es' if workers > 1 else ''}"
    return text


def pool_hello(pool: BufferPool, pool_fd: bool | None, **more: Any) -> dict[str, Any]:
    """A daemon's answer to an engine's hello: its pool's name and size (and ``more``), and
    when the engine asked for it, the pool's descriptor to pass after the reply."""
    fields: dict[str, Any] = {"shm": pool.name, "size": pool.segment.size, **more}
    if pool_fd:
        fields.update({"pool_fd": True, PASS_FD: pool.segment.open_descriptor()})
    return fields


def claim_socket_and_pool(
    control_socket: str, *, group: bool, pool_bytes: int, prefix: str
) -> tuple[EngineSocket, BufferPool]:
    """What a daemon takes before it serves, in the order that keeps a mistake harmless:
    the engine socket first (a second daemon with the same config stops there, having
    touched nothing of the first one's), then the sweep of pools left by dead daemons, then
    its own pool, reserved (on failure the socket is given back)."""
    engine_socket = EngineSocket.bind(control_socket, group=group)
    for name in sweep_stale_segments():
        log.warning("removed shared memory %s left by a dead xdc process", name)
    try:
        return engine_socket, BufferPool(pool_bytes, prefix=prefix)
    except BaseException:
        engine_socket.close()
        raise


async def _drain_then_stop(daemon: Daemon, scope: trio.CancelScope) -> None:
    try:
        await daemon.shutdown()
    finally:
        scope.cancel()


def run(daemon: Daemon, status_host: str, status_port: int, registry: CollectorRegistry) -> int:
    """Run a daemon to its end. A StartupError (a port or socket taken, a pool that does not
    fit) comes out alone, not inside trio's exception group, so the CLI says it in one line."""
    try:
        trio.run(run_daemon, daemon, status_host, status_port, registry)
    except BaseExceptionGroup as group:
        startup, _rest = group.split(StartupError)
        if startup is None:
            raise
        first = startup.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return 0


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
            draining = False
            async for signum in signals:
                name = signal.Signals(signum).name
                if not draining:
                    log.info("signal %s: graceful shutdown", name)
                    draining = True
                    nursery.start_soon(_drain_then_stop, daemon, nursery.cancel_scope)
                else:
                    log.warning("second signal %s: exiting now without draining", name)
                    nursery.cancel_scope.cancel()
                    break
