"""CPU cost of the congestion monitor: ``run_sampler`` at 10 Hz over 64 busy TCP sockets.

The sockets are real loopback connections owned by a child process that keeps each busy
(paced to 2 MB/s per socket with SO_MAX_PACING_RATE so the 2 vCPUs are not saturated) and
passes their fds to this process (SCM_RIGHTS); this process runs only the sampler, in the
trio thread, and its CPU is read with ``time.thread_time()`` in steady state. Also reports
the same loop with no sockets (the VM's wake-up floor) and a per-part breakdown (getsockopt
and decode per socket, /proc counters per read, estimator update per sample).

    python bench/monitor_cost.py [--sockets 64] [--hz 10] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time
import timeit
from typing import Any

import trio
from xdc.monitor.link_estimator import LinkEstimator, LinkSnapshot, Sample
from xdc.monitor.pacing import apply_pacing
from xdc.monitor.procnet import HostCounters
from xdc.monitor.sampler import run_sampler, take_sample
from xdc.monitor.tcpinfo import TCP_INFO, decode_tcp_info, read_tcp_info

from xdc.config import MonitorConfig


def _driver(n: int, rate: int, parent: socket.socket) -> None:
    """Child process: open ``n`` connections to a sink, hand their fds to the parent, then
    keep them busy until the parent closes the control socket."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=n)
    socks = [socket.create_connection(srv.getsockname()) for _ in range(n)]
    peers = [srv.accept()[0] for _ in range(n)]
    stop = threading.Event()

    def send(s: socket.socket) -> None:
        buf = b"\0" * 65536
        with contextlib.suppress(OSError):
            while not stop.is_set():
                s.sendall(buf)

    def drain(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while s.recv(1 << 20):
                pass

    for s in socks:
        apply_pacing(s, rate)
    for s in socks:
        threading.Thread(target=send, args=(s,), daemon=True).start()
    for s in peers:
        threading.Thread(target=drain, args=(s,), daemon=True).start()
    socket.send_fds(parent, [b"fds"], [s.fileno() for s in socks])
    parent.recv(1)  # blocks until the parent is done
    stop.set()


def measure(n: int, hz: float, seconds: float) -> dict[str, Any]:
    # Traffic comes from a child process; the parent only holds duplicates of the sender
    # fds, so the sampler thread is the only thing running here.
    ctl_parent, ctl_child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        ctl_parent.close()
        try:
            _driver(n, 2_000_000, ctl_child)
        finally:
            os._exit(0)
    ctl_child.close()
    _, fds, _, _ = socket.recv_fds(ctl_parent, 16, n)
    socks = [socket.socket(fileno=fd) for fd in fds]
    time.sleep(0.5)

    durations: list[float] = []
    snaps: list[LinkSnapshot] = []
    marks: list[tuple[float, float]] = []  # (thread CPU, wall) at each snapshot
    mark = [0.0]

    def provider() -> list[socket.socket]:
        mark[0] = time.perf_counter()
        return socks

    def on_snapshot(s: LinkSnapshot) -> None:
        durations.append(time.perf_counter() - mark[0])
        snaps.append(s)
        marks.append((time.thread_time(), time.perf_counter()))

    async def main() -> None:
        with trio.move_on_after(seconds):
            await run_sampler(provider, MonitorConfig(sample_hz=hz), on_snapshot)

    try:
        trio.run(main)
        # steady state: from the 10th snapshot on (first reads, imports and caches warm up)
        (cpu0, wall0), (cpu1, wall1) = marks[min(10, len(marks) - 2)], marks[-1]
        core_frac = (cpu1 - cpu0) / (wall1 - wall0)
        # the same trio loop with no sockets: the floor this VM charges for waking up
        marks.clear()

        def on_idle(_: LinkSnapshot) -> None:
            marks.append((time.thread_time(), time.perf_counter()))

        async def idle() -> None:
            with trio.move_on_after(min(seconds, 3.0)):
                await run_sampler(lambda: [], MonitorConfig(sample_hz=hz), on_idle)

        trio.run(idle)
        (cpu0, wall0), (cpu1, wall1) = marks[min(10, len(marks) - 2)], marks[-1]
        idle_frac = (cpu1 - cpu0) / (wall1 - wall0)
        # breakdown, measured on the same live sockets
        reps = 2000
        raw = socks[0].getsockopt(socket.IPPROTO_TCP, TCP_INFO, 512)
        t_getsockopt = timeit.timeit(
            lambda: socks[0].getsockopt(socket.IPPROTO_TCP, TCP_INFO, 512), number=reps
        )
        t_decode = timeit.timeit(lambda: decode_tcp_info(raw), number=reps)
        t_read = timeit.timeit(lambda: read_tcp_info(socks[0]), number=reps)
        t_proc = timeit.timeit(HostCounters.read, number=200) / 200
        est = LinkEstimator(MonitorConfig())
        samples = [take_sample(socks, float(i), host_root=None) for i in range(50)]
        t0 = time.perf_counter()
        for smp in samples:
            est.update(Sample(smp.t, smp.infos, smp.keys))
        t_update = (time.perf_counter() - t0) / len(samples)
    finally:
        for s in socks:
            s.close()
        ctl_parent.close()
        os.waitpid(pid, 0)

    us = 1e6
    return {
        "sockets": n,
        "sample_hz": hz,
        "seconds": seconds,
        "samples": len(snaps),
        "cpu_pct_of_one_core": round(core_frac * 100, 3),
        "cpu_pct_empty_loop": round(idle_frac * 100, 3),
        "sample_us_mean": round(statistics.mean(durations) * us, 1),
        "sample_us_p99": round(sorted(durations)[int(0.99 * (len(durations) - 1))] * us, 1),
        "getsockopt_us": round(t_getsockopt / reps * us, 2),
        "decode_us": round(t_decode / reps * us, 2),
        "read_tcp_info_us": round(t_read / reps * us, 2),
        "proc_counters_us": round(t_proc * us, 1),
        "estimator_update_us": round(t_update * us, 1),
        "goodput_gbps_seen": round(statistics.median(s.goodput_bps for s in snaps[1:]) / 1e9, 3),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sockets", type=int, default=64)
    p.add_argument("--hz", type=float, default=10.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    a = p.parse_args()
    r = measure(a.sockets, a.hz, a.seconds)
    if not a.json:
        print(f"monitor cost: {a.sockets} sockets at {a.hz:g} Hz for {a.seconds:g} s")
        for k, v in r.items():
            print(f"  {k:<22} {v}")
        verdict = "OK" if r["cpu_pct_of_one_core"] < 2.0 else "OVER BUDGET"
        print(f"  target < 2% of one core: {verdict}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
