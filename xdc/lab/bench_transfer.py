"""`xdc bench transfer`: xdc goodput next to iperf3 goodput, same link, same connection count,
measured in one run so the ratio means something on a shared, noisy machine.

Links: loopback, and a veth pair between two network namespaces shaped with ``tc tbf`` (1, 5
and 10 Gbit/s by default). For each link and repeat, iperf3 and xdc run back to back; the
table reports medians and the xdc/iperf3 ratio. It also measures the layer-wise tail (last
layer handed over -> request complete at the decode side) with a producer paced below the link
rate, daemon CPU seconds per GB, and the daemons' peak RSS against their configured pools.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from xdc.config import SenderConfig
from xdc.errors import XdcError
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError
from xdc.transport.launcher import (
    DaemonProcess,
    free_port,
    local_pair_config,
    pair_flag_problems,
)

MIB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="1,5,10", help="shaped link rates in Gbit/s ('' = none)")
    parser.add_argument("--no-loopback", action="store_true", help="skip the loopback run")
    parser.add_argument("--connections", type=int, default=8, help="TCP connections (both tools)")
    parser.add_argument(
        "--iperf3-procs",
        type=int,
        default=1,
        help="iperf3 as this many processes on as many ports, the connections split among "
        "them and the goodput summed (iperf3 3.x moves all its streams on one thread: the "
        "reference that uses the cores of a many-core machine)",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measurement")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per link (median)")
    parser.add_argument("--request-mib", type=int, default=64, help="request size (MiB)")
    parser.add_argument("--layers", type=int, default=32, help="layers per request")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=SenderConfig().chunk_bytes // 1024,
        help="xdc chunk size (KiB)",
    )
    parser.add_argument("--json-out", help="also write the results as JSON to this file")
    parser.add_argument(
        "--congestion-control",
        choices=("on", "off"),
        default="on",
        help="the sender's congestion response (AIMD pacing when the link is congested)",
    )


@dataclass
class XdcRun:
    gbps: float
    requests: int
    bytes: int
    cpu_s_per_gb: float
    peak_rss_mib: float  # the larger of the two daemons
    pools_mib: float  # both pools together
    failed: int
    sender_rss_mib: float = 0.0
    sender_pool_mib: float = 0.0
    receiver_rss_mib: float = 0.0
    receiver_pool_mib: float = 0.0
    # CPU of each daemon's event-loop thread alone (its main thread) per GB: what caps a
    # daemon on a many-core host, where workers and data threads have cores of their own
    sender_loop_s_per_gb: float = 0.0
    receiver_loop_s_per_gb: float = 0.0


@dataclass
class TailRun:
    rate_gbps: float
    layer_bytes: int
    tails_ms: list[float]  # warm requests
    bound_ms: float
    cold_ms: float = 0.0  # the first request on fresh connections and untouched pools

    @property
    def p50(self) -> float:
        return statistics.median(self.tails_ms)

    @property
    def worst(self) -> float:
        return max(self.tails_ms)


@dataclass
class LinkResult:
    link: str
    rate_gbps: float | None
    iperf3_gbps: list[float] = field(default_factory=list)
    xdc: list[XdcRun] = field(default_factory=list)
    tail: TailRun | None = None

    def summary(self) -> dict[str, Any]:
        ip = statistics.median(self.iperf3_gbps) if self.iperf3_gbps else None
        xg = statistics.median(r.gbps for r in self.xdc) if self.xdc else None
        ratios = [x.gbps / i for x, i in zip(self.xdc, self.iperf3_gbps, strict=False) if i > 0]
        out: dict[str, Any] = {
            "link": self.link,
            "rate_gbps": self.rate_gbps,
            "iperf3_gbps_median": ip,
            "xdc_gbps_median": xg,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratios": ratios,
            "cpu_s_per_gb_median": statistics.median(r.cpu_s_per_gb for r in self.xdc)
            if self.xdc
            else None,
            "loop_s_per_gb_median": {
                "sender": statistics.median(r.sender_loop_s_per_gb for r in self.xdc),
                "receiver": statistics.median(r.receiver_loop_s_per_gb for r in self.xdc),
            }
            if self.xdc
            else None,
            "peak_rss_mib_max": max((r.peak_rss_mib for r in self.xdc), default=None),
            "pools_mib": self.xdc[0].pools_mib if self.xdc else None,
            # RSS above the pool: interpreter, numpy, buffers; pool pages count once touched
            "rss_over_pool_mib_max": max(
                (
                    max(
                        r.sender_rss_mib - r.sender_pool_mib,
                        r.receiver_rss_mib - r.receiver_pool_mib,
                    )
                    for r in self.xdc
                ),
                default=None,
            ),
            "failed_requests": sum(r.failed for r in self.xdc),
            "runs": [asdict(r) for r in self.xdc],
            "iperf3_runs": self.iperf3_gbps,
        }
        if self.tail is not None:
            out["tail"] = {
                "layer_bytes": self.tail.layer_bytes,
                "p50_ms": self.tail.p50,
                "max_ms": self.tail.worst,
                "bound_ms": self.tail.bound_ms,
                "cold_first_request_ms": self.tail.cold_ms,
                "warm_requests": len(self.tail.tails_ms),
                "within_bound": self.tail.worst <= self.tail.bound_ms,
            }
        return out


# --- iperf3 --------------------------------------------------------------------------------


@dataclass
class Iperf3Run:
    gbps: float
    cpu_s_per_gb: float  # client and server together, from iperf3's own accounting


def run_iperf3(
    host: str,
    connections: int,
    seconds: float,
    server_ns: str | None,
    client_ns: str | None,
    congestion: str = "",
) -> Iperf3Run:
    """Goodput (received) and CPU per GB; iperf3 reports each end's CPU as a percentage of
    one core over the test, so CPU seconds = (host + remote) / 100 x test length."""
    port = free_port()

    def wrap(ns: str | None, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv] if ns else argv

    server = subprocess.Popen(
        wrap(server_ns, ["iperf3", "-s", "-1", "-B", host, "-p", str(port)]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        out = ""
        for _ in range(50):
            res = subprocess.run(
                wrap(
                    client_ns,
                    [
                        "iperf3",
                        "-c",
                        host,
                        "-p",
                        str(port),
                        "-P",
                        str(connections),
                        "-t",
                        str(seconds),
                        "-J",
                        *(["-C", congestion] if congestion else []),
                    ],
                ),
                capture_output=True,
                text=True,
                timeout=seconds + 30,
            )
            out = res.stdout
            try:
                data = json.loads(out)
            except json.JSONDecodeError:
                data = {"error": res.stderr.strip() or "no output"}
            if res.returncode == 0 and "sum_received" in data.get("end", {}):
                end = data["end"]
                recv = end["sum_received"]
                cpu = end.get("cpu_utilization_percent", {})
                cpu_s = (cpu.get("host_total", 0.0) + cpu.get("remote_total", 0.0)) / 100
                cpu_s *= float(recv["seconds"])
                gb = float(recv["bytes"]) / 1e9
                return Iperf3Run(float(recv["bits_per_second"]) / 1e9, cpu_s / gb if gb else 0.0)
            if server.poll() is not None:  # one-off server consumed by a failed attempt
                server = subprocess.Popen(
                    wrap(server_ns, ["iperf3", "-s", "-1", "-B", host, "-p", str(port)]),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            time.sleep(0.2)  # server not listening yet
        raise RuntimeError(f"iperf3 failed: {data.get('error')}")
    finally:
        server.kill()
        server.wait()


def run_iperf3_procs(
    host: str,
    procs: int,
    connections: int,
    seconds: float,
    server_ns: str | None,
    client_ns: str | None,
) -> Iperf3Run:
    """``procs`` iperf3 client/server pairs at once, each on its own port with its share of
    the connections; goodput summed, CPU per GB over all of them. One process is
    ``run_iperf3`` as it is."""
    if procs <= 1:
        return run_iperf3(host, connections, seconds, server_ns, client_ns)
    shares = [connections // procs + (i < connections % procs) for i in range(procs)]
    with concurrent.futures.ThreadPoolExecutor(procs) as pool:
        runs = list(pool.map(lambda n: run_iperf3(host, n, seconds, server_ns, client_ns), shares))
    gbps = sum(r.gbps for r in runs)
    cpu_s = sum(r.cpu_s_per_gb * r.gbps * seconds / 8 for r in runs)
    return Iperf3Run(gbps, cpu_s / (gbps * seconds / 8) if gbps else 0.0)


# --- xdc -----------------------------------------------------------------------------------


class _RssSampler:
    """Peak RSS per daemon (shared-memory pool pages count once touched)."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]
        self.peaks = [0] * len(pids)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for i, p in enumerate(self.procs):
                with suppress(psutil.Error):
                    self.peaks[i] = max(self.peaks[i], p.memory_info().rss)

    def stop(self) -> list[int]:
        self._stop.set()
        self._t.join()
        return self.peaks


def _daemon_pid(d: DaemonProcess) -> int:
    """The python process itself (under `ip netns exec` it is the exec'd child)."""
    proc = psutil.Process(d.proc.pid)
    if proc.name() == "ip":
        kids = proc.children()
        if kids:
            return int(kids[0].pid)
    return d.proc.pid


def _cpu_seconds(pids: list[int]) -> float:
    """CPU time of the daemons and of the processes they started (data workers): a daemon
    that hands its work to children must be charged for it."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in (proc, *proc.children(recursive=True)):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _loop_cpu_seconds(pid: int) -> float:
    """CPU time of a daemon's main thread, which runs its event loop (0 when unreadable)."""
    try:
        for t in psutil.Process(pid).threads():
            if t.id == pid:
                return float(t.user_time + t.system_time)
    except psutil.Error:
        pass
    return 0.0


def _start_pair(
    args: argparse.Namespace,
    workdir: Path,
    ns_tx: str | None,
    ns_rx: str | None,
    rx_host: str,
    request_bytes: int,
) -> tuple[DaemonProcess, DaemonProcess, str, str, tuple[float, float]]:
    layer = request_bytes // args.layers
    tx_cfg, rx_cfg, _ = local_pair_config(
        workdir,
        connections=args.connections,
        chunk_bytes=args.chunk_kib * 1024,
        send_pool=max(256 * MIB, 8 * layer),
        recv_pool=max(256 * MIB, 4 * request_bytes),
    )
    rx_cfg.receiver.listen_host = rx_host
    tx_cfg.sender.peer_host = rx_host
    tx_cfg.sender.congestion_control = getattr(args, "congestion_control", "on") == "on"
    tx_cfg.sender.tcp_congestion = getattr(args, "tcp_congestion", "")
    # settings changed for an A/B run (bench/knob_ab.py): "section.field" -> value, already
    # coerced and range-checked by load_config; applied to both daemons' configs
    for dotted, value in getattr(args, "overrides", {}).items():
        section, _, name = dotted.partition(".")
        for cfg in (tx_cfg, rx_cfg):
            setattr(getattr(cfg, section), name, value)
    tx_cfg.node.log_level = rx_cfg.node.log_level = "warning"
    tls = getattr(args, "tls", None)  # (sender, receiver) TlsConfig for a mutual-TLS run
    if tls is not None:
        tx_cfg.tls, rx_cfg.tls = tls
    rx = DaemonProcess("receiver", rx_cfg, workdir, netns=ns_rx)
    rx.wait_ready()
    tx = DaemonProcess("sender", tx_cfg, workdir, netns=ns_tx)
    tx.wait_ready()
    pools = (tx_cfg.sender.pool_bytes / MIB, rx_cfg.receiver.pool_bytes / MIB)
    return tx, rx, tx_cfg.sender.control_socket, rx_cfg.receiver.control_socket, pools


def _wait_connected(tx_sock: str, n: int, timeout: float = 10) -> None:
    with PrefillClient(tx_sock) as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            peers = c.status()["peers"]
            if peers and all(p["live_connections"] == n for p in peers.values()):
                return
            time.sleep(0.05)
    raise RuntimeError("sender did not connect all its connections")


def run_xdc(args: argparse.Namespace, ns_tx: str | None, ns_rx: str | None, rx_host: str) -> XdcRun:
    """Saturating load: the producer keeps a few requests in flight, the consumer releases each
    complete request at once; goodput = bytes delivered / (first begin .. last complete)."""
    request_bytes = args.request_mib * MIB
    layer = request_bytes // args.layers
    sizes = [layer] * args.layers
    with tempfile.TemporaryDirectory(prefix="xdc-bench-") as wd:
        tx, rx, tx_sock, rx_sock, pools = _start_pair(
            args, Path(wd), ns_tx, ns_rx, rx_host, request_bytes
        )
        stop = threading.Event()
        consumer: threading.Thread | None = None
        try:
            _wait_connected(tx_sock, args.connections)
            pids = [_daemon_pid(tx), _daemon_pid(rx)]
            rss = _RssSampler(pids)
            cpu0 = _cpu_seconds(pids)
            loops0 = [_loop_cpu_seconds(p) for p in pids]
            delivered: list[tuple[float, int]] = []

            def consume() -> None:
                with DecodeClient(rx_sock) as dc:
                    while not stop.is_set():
                        try:
                            req = dc.await_request(timeout=0.5)
                        except TransferError:
                            continue
                        except XdcError:
                            if stop.is_set():  # the run was cut short (Ctrl-C, SIGTERM)
                                return
                            raise
                        delivered.append((time.monotonic(), req.total_bytes))
                        req.release()

            consumer = threading.Thread(target=consume, daemon=True)
            consumer.start()
            failed = 0
            with PrefillClient(tx_sock) as pc:
                t0 = time.monotonic()
                k = 0
                in_flight: list[str] = []
                while time.monotonic() - t0 < args.seconds:
                    rid = f"bench-{k}"
                    k += 1
                    t = pc.begin(rid, sizes, deadline_s=120)
                    for i in range(len(sizes)):
                        t.layer_buffer(i)  # contents are whatever the pool holds: no fill cost
                        t.layer_ready(i)
                    in_flight.append(rid)
                    while len(in_flight) >= 3:
                        o = pc.wait(in_flight.pop(0), 120)
                        failed += 0 if o.ok else 1
                for rid in in_flight:
                    o = pc.wait(rid, 120)
                    failed += 0 if o.ok else 1
            deadline = time.monotonic() + 30
            while len(delivered) < k - failed and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.set()
            consumer.join(5)
            cpu = _cpu_seconds(pids) - cpu0
            loops = [_loop_cpu_seconds(p) - t for p, t in zip(pids, loops0, strict=True)]
            peaks = rss.stop()
            t_end = max(t for t, _ in delivered)
            nbytes = sum(b for _, b in delivered)
            return XdcRun(
                gbps=nbytes * 8 / (t_end - t0) / 1e9,
                requests=len(delivered),
                bytes=nbytes,
                cpu_s_per_gb=cpu / (nbytes / 1e9),
                peak_rss_mib=max(peaks) / MIB,
                pools_mib=pools[0] + pools[1],
                failed=failed,
                sender_rss_mib=peaks[0] / MIB,
                sender_pool_mib=pools[0],
                receiver_rss_mib=peaks[1] / MIB,
                receiver_pool_mib=pools[1],
                sender_loop_s_per_gb=loops[0] / (nbytes / 1e9),
                receiver_loop_s_per_gb=loops[1] / (nbytes / 1e9),
            )
        finally:
            stop.set()  # the consumer ends before its daemon does, not with a traceback
            if consumer is not None:
                consumer.join(5)
            tx.stop()
            rx.stop()


def run_tail(
    args: argparse.Namespace, ns_tx: str | None, ns_rx: str | None, rx_host: str, rate_gbps: float
) -> TailRun:
    """Layer-wise tail with KV produced slower than the link (half its rate): the time from the
    last layer handed over to the request being complete at the decode side."""
    request_bytes = args.request_mib * MIB
    layer = request_bytes // args.layers
    sizes = [layer] * args.layers
    layer_time = layer * 8 / (rate_gbps * 1e9) * 2  # produce at half the link rate
    tails: list[float] = []
    with tempfile.TemporaryDirectory(prefix="xdc-bench-") as wd:
        tx, rx, tx_sock, rx_sock, _ = _start_pair(
            args, Path(wd), ns_tx, ns_rx, rx_host, request_bytes
        )
        try:
            _wait_connected(tx_sock, args.connections)
            with PrefillClient(tx_sock) as pc, DecodeClient(rx_sock) as dc:
                for k in range(6):  # request 0 is the cold one: fresh cwnd, first-touch pools
                    rid = f"tail-{k}"
                    t = pc.begin(rid, sizes, deadline_s=120)
                    nxt = time.monotonic()
                    for i in range(len(sizes)):
                        nxt += layer_time
                        time.sleep(max(0.0, nxt - time.monotonic()))
                        t.layer_buffer(i)
                        t.layer_ready(i)
                    handed = time.monotonic()
                    req = dc.await_request(rid, timeout=60)
                    tails.append((time.monotonic() - handed) * 1e3)
                    req.release()
                    pc.wait(rid, 60)
        finally:
            tx.stop()
            rx.stop()
    bound = 1.2 * (layer * 8 / (rate_gbps * 1e9)) * 1e3 + 5.0
    return TailRun(rate_gbps, layer, tails[1:], bound, cold_ms=tails[0])


# --- driver --------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def parse_rates(text: str) -> list[float]:
    """``--rates``: comma-separated Gbit/s, each > 0 ("" = no shaped link); ValueError says
    which entry is wrong."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number of Gbit/s") from None
        if not 0 < rate <= 1000:
            raise ValueError(f"--rates: {part} Gbit/s is outside 0 < rate <= 1000")
        rates.append(rate)
    return rates


def check_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each naming its flag, before anything starts (a bad value
    otherwise surfaces minutes later as a daemon refusing its config, or as a division by
    zero). The bounds are the sender's own where the flag becomes a sender setting."""
    p = pair_flag_problems(args.connections, args.chunk_kib)
    if not 0 < args.seconds <= 3600:
        p.append("--seconds: 0 < s <= 3600")
    if not 1 <= args.repeats <= 100:
        p.append("--repeats: 1..100")
    too_many = 1 <= args.connections <= 256 and args.iperf3_procs > args.connections
    if args.iperf3_procs < 1 or too_many:
        p.append("--iperf3-procs: 1..--connections (each process takes at least one)")
    if not 1 <= args.request_mib <= 16384:
        p.append("--request-mib: 1..16384")
    elif not 1 <= args.layers <= args.request_mib * MIB // 4096:
        p.append("--layers: 1..(request bytes / 4096), so that each layer is at least 4 KiB")
    try:
        parse_rates(args.rates)
    except ValueError as e:
        p.append(str(e))
    return p


def run(args: argparse.Namespace) -> int:
    problems = check_args(args)
    if problems:
        print("xdc bench transfer: " + "; ".join(problems), file=sys.stderr)
        return 2
    if shutil.which("iperf3") is None:
        print(
            "xdc bench transfer: iperf3 is not installed (deploy/setup-test-env.sh)",
            file=sys.stderr,
        )
        return 2
    try:
        return _run(args, parse_rates(args.rates))
    except (RuntimeError, XdcError) as e:
        print(f"xdc bench transfer: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, rates: list[float]) -> int:
    results: list[LinkResult] = []
    if not args.no_loopback:
        res = LinkResult("loopback", None)
        for rep in range(args.repeats):
            res.iperf3_gbps.append(
                run_iperf3_procs(
                    "127.0.0.1", args.iperf3_procs, args.connections, args.seconds, None, None
                ).gbps
            )
            res.xdc.append(run_xdc(args, None, None, "127.0.0.1"))
            _report_progress(res, rep)
        results.append(res)
    from xdc.lab.netlab import shaped_links

    for rate, lab in shaped_links(rates):
        res = LinkResult(f"veth tbf {rate:g} Gbit/s", rate)
        for rep in range(args.repeats):
            res.iperf3_gbps.append(
                run_iperf3_procs(
                    lab.addr_b,
                    args.iperf3_procs,
                    args.connections,
                    args.seconds,
                    lab.ns_b,
                    lab.ns_a,
                ).gbps
            )
            res.xdc.append(run_xdc(args, lab.ns_a, lab.ns_b, lab.addr_b))
            _report_progress(res, rep)
        res.tail = run_tail(args, lab.ns_a, lab.ns_b, lab.addr_b, rate)
        results.append(res)
    report: dict[str, Any] = {
        "machine": _machine(),
        "params": {
            "connections": args.connections,
            "iperf3_procs": args.iperf3_procs,
            "seconds": args.seconds,
            "repeats": args.repeats,
            "request_mib": args.request_mib,
            "layers": args.layers,
            "chunk_kib": args.chunk_kib,
        },
        "links": [r.summary() for r in results],
    }
    _print_table(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    bad = any(r["failed_requests"] for r in report["links"])
    return 1 if bad else 0


def _report_progress(res: LinkResult, rep: int) -> None:
    x = res.xdc[-1]
    print(
        f"  {res.link:<22} repeat {rep + 1}: iperf3 {res.iperf3_gbps[-1]:6.2f} Gbit/s, "
        f"xdc {x.gbps:6.2f} Gbit/s ({x.requests} requests, {x.cpu_s_per_gb:.2f} CPU s/GB; "
        f"event loops {x.sender_loop_s_per_gb:.3f} / {x.receiver_loop_s_per_gb:.3f} s/GB)",
        file=sys.stderr,
    )


def _print_table(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"\nmachine: {m['cpus']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}")
    print(
        f"{'link':<22}{'iperf3':>10}{'xdc':>10}{'ratio':>8}{'CPU s/GB':>10}{'loops s/GB':>12}"
        f"{'RSS MiB':>9}{'tail p50/max (bound) ms':>27}"
    )
    for r in report["links"]:
        tail = r.get("tail")
        tail_s = (
            f"{tail['p50_ms']:.1f}/{tail['max_ms']:.1f} ({tail['bound_ms']:.1f})" if tail else "-"
        )
        loops = r.get("loop_s_per_gb_median")  # each daemon's event loop: sender/receiver
        loops_s = f"{loops['sender']:.2f}/{loops['receiver']:.2f}" if loops else "-"
        print(
            f"{r['link']:<22}{r['iperf3_gbps_median']:>10.2f}{r['xdc_gbps_median']:>10.2f}"
            f"{r['ratio_median']:>8.2f}{r['cpu_s_per_gb_median']:>10.2f}{loops_s:>12}"
            f"{r['peak_rss_mib_max']:>9.0f}{tail_s:>27}"
        )
