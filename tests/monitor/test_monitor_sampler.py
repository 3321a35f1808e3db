"""The trio sampling task over real loopback sockets."""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import trio
import trio.testing
from xdc.monitor.link_estimator import LinkEstimator, LinkSnapshot
from xdc.monitor.sampler import run_sampler, take_sample

from xdc.config import MonitorConfig
from xdc.linkreport import LinkHealth


@contextmanager
def flows(n: int) -> Iterator[list[socket.socket]]:
    """``n`` loopback connections, each with a thread sending and one draining."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=n)
    stop = threading.Event()
    clis, accs, threads = [], [], []

    def send(s: socket.socket) -> None:
        buf = b"\0" * 65536
        try:
            while not stop.is_set():
                s.sendall(buf)
        except OSError:
            pass

    def drain(s: socket.socket) -> None:
        try:
            while s.recv(1 << 20):
                pass
        except OSError:
            pass

    for _ in range(n):
        c = socket.create_connection(srv.getsockname())
        a, _ = srv.accept()
        clis.append(c)
        accs.append(a)
        threads += [
            threading.Thread(target=send, args=(c,)),
            threading.Thread(target=drain, args=(a,)),
        ]
    for th in threads:
        th.start()
    try:
        yield clis
    finally:
        stop.set()
        for s in clis + accs:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        for th in threads:
            th.join(timeout=5)
        for s in [*clis, *accs, srv]:
            s.close()


def collect(
    provider: Any, hz: float, seconds: float, *, clock: Any = None, **kw: Any
) -> tuple[list[LinkSnapshot], LinkEstimator]:
    snaps: list[LinkSnapshot] = []
    started: list[LinkEstimator] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            est = await nursery.start(
                lambda task_status: run_sampler(
                    provider,
                    MonitorConfig(sample_hz=hz),
                    snaps.append,
                    task_status=task_status,
                    **kw,
                )
            )
            started.append(est)
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    return snaps, started[0]


def test_samples_real_traffic_at_the_configured_rate() -> None:
    with flows(3) as socks:
        snaps, est = collect(lambda: socks, hz=20.0, seconds=0.5, host_interval_s=0.0)
    assert 9 <= len(snaps) <= 12
    assert est.state is snaps[-1].state
    active = snaps[1:]
    assert all(s.sockets == 3 for s in snaps)
    assert all(s.goodput_bps > 0 and s.active_sockets >= 1 for s in active)
    assert all(s.interval_s > 0 for s in active)
    assert max(s.interval_s for s in active) < 0.2
    assert all(s.host_retrans_ratio is not None for s in active[1:])
    assert all(s.min_rtt_ms is not None and s.min_rtt_ms > 0 for s in active)


def test_socket_closed_mid_run_is_dropped_not_fatal() -> None:
    with flows(3) as socks:
        fd = os.dup(socks[2].fileno())
        handles: list[Any] = [socks[0], socks[1], fd]
        calls = itertools.count()

        def provider() -> list[Any]:
            if next(calls) == 3:
                socks[1].close()  # closed between the provider call and the read
                os.close(fd)
            return handles

        snaps, _ = collect(provider, hz=50.0, seconds=0.3, host_root=None)
    counts = [s.sockets for s in snaps]
    assert counts[:3] == [3, 3, 3] and set(counts[3:]) == {1}
    assert all(s.host_retrans_ratio is None for s in snaps)
    assert snaps[-1].goodput_bps > 0  # the surviving socket is still measured


def test_empty_and_failing_sockets() -> None:
    dead = socket.socket()
    dead.close()
    sample = take_sample([dead, -1, 10**6], t=1.0, host_root=None)
    assert sample.infos == [] and sample.host is None
    snaps, _ = collect(lambda: [], hz=100.0, seconds=0.05)
    assert snaps and all(s.sockets == 0 and s.state is LinkHealth.OK for s in snaps)


def test_cadence_on_a_virtual_clock_skips_missed_ticks() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    with flows(1) as socks:
        snaps, _ = collect(lambda: socks, hz=10.0, seconds=2.05, clock=clock, host_root=None)
    ts = [s.t for s in snaps]
    assert len(ts) == 21  # t = 0.0, 0.1, ..., 2.0
    assert all(abs((b - a) - 0.1) < 1e-9 for a, b in itertools.pairwise(ts))

    # a callback that stalls the loop for 0.35 s: the next samples stay on the 0.1 grid
    clock2 = trio.testing.MockClock(autojump_threshold=0)
    stalled: list[LinkSnapshot] = []

    def slow(s: LinkSnapshot) -> None:
        stalled.append(s)
        if len(stalled) == 2:
            clock2.jump(0.35)

    async def main() -> None:
        with trio.move_on_after(1.0):
            await run_sampler(lambda: [], MonitorConfig(sample_hz=10.0), slow, host_root=None)

    trio.run(main, clock=clock2)
    ts2 = [round(s.t, 6) for s in stalled]
    assert ts2[:3] == [0.0, 0.1, 0.5]
    assert all(round(t * 10, 6).is_integer() for t in ts2)


def test_host_counters_read_at_their_own_interval() -> None:
    """Host counters every 0.2 s at 20 Hz: the ratio is carried forward between reads."""
    with flows(1) as socks:
        snaps, _ = collect(lambda: socks, hz=20.0, seconds=0.5, host_interval_s=0.2)
    ratios = [s.host_retrans_ratio for s in snaps]
    assert ratios[0] is None and ratios[-1] is not None
    changes = sum(1 for a, b in itertools.pairwise(ratios) if a != b)
    assert 1 <= changes <= 3  # reads near t = 0, 0.2, 0.4 only, not one per sample
    with flows(1) as socks:
        snaps, _ = collect(lambda: socks, hz=20.0, seconds=0.5, host_interval_s=0.0)
    assert all(s.host_retrans_ratio is not None for s in snaps[1:])
