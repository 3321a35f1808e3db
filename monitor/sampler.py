"""The periodic trio task that feeds the link estimator.

A sample is a handful of getsockopt calls and two small /proc reads (tens of microseconds for
64 sockets), so it runs inline in the trio thread instead of paying for a worker thread. The
loop keeps a fixed cadence on trio's clock (missed ticks are skipped, never bunched) and is
cancelled like any trio task.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import trio
from xdc.monitor.link_estimator import LinkEstimator, LinkSnapshot, Sample
from xdc.monitor.procnet import HostCounters
from xdc.monitor.tcpinfo import TcpInfo, read_tcp_info

from xdc.config import MonitorConfig

SocketLike = Any  # a socket.socket, a trio socket, or a raw fd (int)


def _key(sock: SocketLike) -> Hashable:
    """The fd: stable even if the provider hands out fresh wrapper objects each time. A
    reused fd is caught by the estimator (its counters go backwards)."""
    if isinstance(sock, int):
        return sock
    try:
        return int(sock.fileno())
    except (AttributeError, OSError, ValueError):
        return ("obj", id(sock))


def take_sample(
    socks: Sequence[SocketLike],
    t: float,
    *,
    host_root: str | None = "/proc",
    wall: float | None = None,
) -> Sample:
    """Read every socket once; sockets that closed meanwhile are simply absent."""
    infos: list[TcpInfo] = []
    keys: list[Hashable] = []
    for sock in socks:
        info = read_tcp_info(sock)
        if info is not None:
            infos.append(info)
            keys.append(_key(sock))
    host = HostCounters.read(host_root) if host_root is not None else None
    return Sample(t=t, infos=infos, keys=keys, host=host, wall=wall)


async def run_sampler(
    sockets_provider: Callable[[], Sequence[SocketLike]],
    cfg: MonitorConfig,
    on_snapshot: Callable[[LinkSnapshot], None],
    *,
    estimator: LinkEstimator | None = None,
    host_root: str | None = "/proc",
    host_interval_s: float = 1.0,
    task_status: trio.TaskStatus[LinkEstimator] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Sample ``sockets_provider()`` at ``cfg.sample_hz`` until cancelled.

    ``task_status.started`` hands back the estimator (its ``state`` is the current link
    state). Host-wide /proc counters are read every ``host_interval_s`` (they are context,
    not the congestion signal, and reading /proc/net/netstat costs as much as 30 sockets);
    ``host_root=None`` skips them.
    """
    est = estimator if estimator is not None else LinkEstimator(cfg)
    period = 1.0 / cfg.sample_hz
    task_status.started(est)
    next_t = trio.current_time()
    next_host = next_t
    while True:
        now = trio.current_time()
        root = None
        if host_root is not None and now >= next_host:
            root = host_root
            next_host = now + host_interval_s
        sample = take_sample(sockets_provider(), now, host_root=root, wall=time.time())
        on_snapshot(est.update(sample))
        next_t += period
        now = trio.current_time()
        if next_t <= now:
            # Overran (or the process was stopped): resume the cadence, skip missed ticks.
            next_t += period * (int((now - next_t) / period) + 1)
        await trio.sleep_until(next_t)
