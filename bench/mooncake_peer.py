"""xdc next to Mooncake's Transfer Engine (TCP transport) and iperf3, on the same links in the
same run: loopback, and a veth pair between two namespaces shaped with ``tc tbf``. Per link and
repeat the tools run back to back (so machine noise hits all alike); reported are medians of
goodput and of CPU seconds per GB moved, both ends together:

- iperf3: ``-P connections``, CPU from its own JSON (``cpu_utilization_percent`` of client
  and server);
- xdc: the sender and receiver daemons, plain TCP, ``connections`` connections, 2 MiB chunks,
  64 MiB requests of 32 layers (the same load as ``xdc bench transfer``);
- Mooncake TE: ``mooncake-transfer-engine-non-cuda`` with the P2P handshake (no metadata
  server), ``batch_transfer_sync_write`` of ``connections`` blocks of 4 MiB per call, which
  Mooncake sends over that many TCP connections; CPU of the initiator and target processes
  over the timed window (bench/mooncake_worker.py);
- bare (``--no-bare`` skips it): bench/bare_tcp.py, blocking threads that move chunks of the
  same ``--chunk-kib`` with xxh3 on both ends and an ack each, and nothing else: the floor any
  Python data path with xdc's integrity pays on this machine, so the distance from xdc to it
  is xdc's own.

    bash deploy/install-mooncake.sh        # once: the wheel in its own venv
    python bench/mooncake_peer.py --repeats 3 --json-out bench/results/mooncake_peer_2core.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
from xdc.transport.launcher import free_port

from xdc.config import SenderConfig
from xdc.lab import bench_transfer as bt
from xdc.lab.netlab import shaped_links

DEFAULT_PYTHON = os.environ.get("XDC_MOONCAKE_PYTHON", "/opt/xdc-mooncake/bin/python")
WORKER = Path(__file__).with_name("mooncake_worker.py")
BARE = Path(__file__).with_name("bare_tcp.py")


@dataclass
class Sample:
    gbps: float
    cpu_s_per_gb: float


def _wrap(ns: str | None, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv] if ns else argv


def _line(stream: IO[str], what: str) -> dict[str, Any]:
    text = stream.readline()
    if not text:
        raise RuntimeError(f"mooncake {what}: exited without answering (see its log)")
    out: dict[str, Any] = json.loads(text)
    return out


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def run_mooncake(
    python: str,
    args: argparse.Namespace,
    ns_target: str | None,
    ns_initiator: str | None,
    target_host: str,
    initiator_host: str,
    log: Path,
) -> Sample:
    """One timed Mooncake TE transfer; raises RuntimeError when a side fails."""
    env = {**os.environ, "GLOG_minloglevel": "2", "MC_LOG_LEVEL": "ERROR"}
    with log.open("a") as err:
        target = subprocess.Popen(
            _wrap(ns_target, [python, str(WORKER), "target", "--host", target_host]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
        initiator: subprocess.Popen[str] | None = None
        try:
            assert target.stdout is not None
            info = _line(target.stdout, "target")
            initiator = subprocess.Popen(
                _wrap(
                    ns_initiator,
                    [
                        python,
                        str(WORKER),
                        "initiator",
                        "--host",
                        initiator_host,
                        "--session",
                        f"{target_host}:{info['port']}",
                        "--ptr",
                        str(info["ptr"]),
                        "--blocks",
                        str(args.connections),
                        "--seconds",
                        str(args.seconds),
                    ],
                ),
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
            assert initiator.stdout is not None
            start = _line(initiator.stdout, "initiator")
            pids = [int(info["pid"]), int(start["pid"])]
            cpu0 = sum(_cpu(p) for p in pids)
            end = _line(initiator.stdout, "initiator")
            cpu = sum(_cpu(p) for p in pids) - cpu0
            initiator.wait(30)
            gb = end["bytes"] / 1e9
            return Sample(end["bytes"] * 8 / end["seconds"] / 1e9, cpu / gb)
        finally:
            for p in (initiator, target):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait(10)


def run_bare(args: argparse.Namespace, ns_tx: str | None, ns_rx: str | None, host: str) -> Sample:
    """bench/bare_tcp.py: threads, xxh3, acks, nothing else (the floor for Python)."""
    port = free_port()
    common = [host, str(port), str(args.connections), str(args.chunk_kib)]
    rx = subprocess.Popen(
        _wrap(ns_rx, [sys.executable, str(BARE), "rx", *common]), stdout=subprocess.PIPE, text=True
    )
    tx: subprocess.Popen[str] | None = None
    try:
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError("bare_tcp receiver did not start")
        tx = subprocess.Popen(
            _wrap(ns_tx, [sys.executable, str(BARE), "tx", *common, str(args.seconds)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert tx.stdout is not None
        if tx.stdout.readline().strip() != "go":
            raise RuntimeError("bare_tcp sender did not connect")
        pids = [rx.pid, tx.pid]  # ip netns exec execs the command: same pid
        cpu0 = sum(_cpu(p) for p in pids)
        line = tx.stdout.readline()
        cpu = sum(_cpu(p) for p in pids) - cpu0
        if not line:
            raise RuntimeError("bare_tcp sender failed")
        end = json.loads(line)
        if tx.wait(30) or rx.wait(30):
            raise RuntimeError("bare_tcp: a side failed (a checksum, or a lost connection)")
        return Sample(end["bytes"] * 8 / end["seconds"] / 1e9, cpu / (end["bytes"] / 1e9))
    finally:
        for p in (tx, rx):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def run_iperf3(
    host: str, args: argparse.Namespace, server_ns: str | None, client_ns: str | None
) -> Sample:
    r = bt.run_iperf3(host, args.connections, args.seconds, server_ns, client_ns)
    return Sample(r.gbps, r.cpu_s_per_gb)


def run_xdc(args: argparse.Namespace, ns_tx: str | None, ns_rx: str | None, rx_host: str) -> Sample:
    r = bt.run_xdc(args, ns_tx, ns_rx, rx_host)
    if r.failed:
        raise RuntimeError(f"xdc: {r.failed} requests failed")
    return Sample(r.gbps, r.cpu_s_per_gb)


def _tools(
    args: argparse.Namespace,
    base: argparse.Namespace,
    log: Path,
    ns_tx: str | None,
    ns_rx: str | None,
    tx_host: str,
    rx_host: str,
) -> dict[str, Callable[[], Sample]]:
    """Every tool on one link, data flowing from the tx side to the rx side."""
    tools: dict[str, Callable[[], Sample]] = {
        "iperf3": lambda: run_iperf3(rx_host, args, ns_rx, ns_tx),
        "xdc": lambda: run_xdc(base, ns_tx, ns_rx, rx_host),
        "mooncake": lambda: run_mooncake(
            args.mooncake_python, args, ns_rx, ns_tx, rx_host, tx_host, log
        ),
    }
    if not args.no_bare:
        tools["bare"] = lambda: run_bare(args, ns_tx, ns_rx, rx_host)
    return tools


def _link(name: str, repeats: int, tools: dict[str, Callable[[], Sample]]) -> dict[str, Any]:
    runs: dict[str, list[Sample]] = {t: [] for t in tools}
    for rep in range(repeats):
        parts = []
        for tool, fn in tools.items():
            s = fn()
            runs[tool].append(s)
            parts.append(f"{tool} {s.gbps:6.2f} Gbit/s ({s.cpu_s_per_gb:.2f} CPU s/GB)")
        print(f"  {name:<20} repeat {rep + 1}: " + ", ".join(parts), file=sys.stderr)
    out: dict[str, Any] = {"link": name}
    for tool, samples in runs.items():
        out[tool] = {
            "gbps": [round(s.gbps, 3) for s in samples],
            "cpu_s_per_gb": [round(s.cpu_s_per_gb, 3) for s in samples],
            "gbps_median": round(statistics.median(s.gbps for s in samples), 3),
            "cpu_s_per_gb_median": round(statistics.median(s.cpu_s_per_gb for s in samples), 3),
        }
    # per repeat, side by side, then the median: (key, numerator tool, denominator tool, field)
    for key, num, den, attr in (
        ("xdc_vs_iperf3_gbps", "xdc", "iperf3", "gbps"),
        ("xdc_vs_mooncake_gbps", "xdc", "mooncake", "gbps"),
        ("xdc_vs_mooncake_cpu", "xdc", "mooncake", "cpu_s_per_gb"),
        ("bare_vs_mooncake_cpu", "bare", "mooncake", "cpu_s_per_gb"),
        ("xdc_vs_bare_cpu", "xdc", "bare", "cpu_s_per_gb"),
    ):
        if runs.get(num) and runs.get(den):
            pairs = zip(runs[num], runs[den], strict=True)
            out[key] = round(
                statistics.median(getattr(a, attr) / getattr(b, attr) for a, b in pairs), 3
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="10", help="shaped link rates in Gbit/s ('' = none)")
    ap.add_argument("--no-loopback", action="store_true")
    ap.add_argument("--connections", type=int, default=8, help="TCP connections, all three")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--request-mib", type=int, default=64, help="xdc request size")
    ap.add_argument("--layers", type=int, default=32, help="xdc layers per request")
    ap.add_argument(
        "--chunk-kib", type=int, default=SenderConfig().chunk_bytes // 1024, help="xdc chunk size"
    )
    ap.add_argument(
        "--no-bare", action="store_true", help="skip bench/bare_tcp.py (the Python floor)"
    )
    ap.add_argument("--mooncake-python", default=DEFAULT_PYTHON, help="venv with Mooncake TE")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if not Path(args.mooncake_python).exists():
        print(
            f"no Mooncake interpreter at {args.mooncake_python}: run deploy/install-mooncake.sh "
            "or pass --mooncake-python",
            file=sys.stderr,
        )
        return 2
    base = argparse.Namespace(**vars(args), congestion_control="on", tcp_congestion="", tls=None)
    links: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="xdc-mooncake-") as d:
        log = Path(d) / "mooncake.log"
        try:
            if not args.no_loopback:
                lo = "127.0.0.1"
                tools = _tools(args, base, log, None, None, lo, lo)
                links.append(_link("loopback", args.repeats, tools))
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
            for rate, lab in shaped_links(rates):
                tools = _tools(args, base, log, lab.ns_a, lab.ns_b, lab.addr_a, lab.addr_b)
                links.append(_link(f"veth tbf {rate:g} Gbit/s", args.repeats, tools))
        except RuntimeError as e:
            tail = log.read_text()[-2000:] if log.exists() else ""
            print(f"failed: {e}\n{tail}", file=sys.stderr)
            return 1
    report = {
        "machine": bt._machine(),
        "params": {k: v for k, v in vars(args).items() if k not in ("json_out", "mooncake_python")},
        "mooncake_block_mib": 4,
        "links": links,
    }
    print(
        f"\n{'link':<20}{'iperf3':>9}{'xdc':>9}{'Mooncake':>10}"
        f"{'   CPU s/GB iperf3/xdc/Mooncake':>32}{'xdc/iperf3':>12}{'xdc/MC CPU':>12}"
    )
    for r in links:
        cpu = "/".join(f"{r[t]['cpu_s_per_gb_median']:.2f}" for t in ("iperf3", "xdc", "mooncake"))
        print(
            f"{r['link']:<20}{r['iperf3']['gbps_median']:>9.2f}{r['xdc']['gbps_median']:>9.2f}"
            f"{r['mooncake']['gbps_median']:>10.2f}{cpu:>32}{r['xdc_vs_iperf3_gbps']:>12.2f}"
            f"{r['xdc_vs_mooncake_cpu']:>12.2f}"
        )
        if "bare" in r:
            print(
                f"{'':<20}bare threads (bench/bare_tcp.py): {r['bare']['gbps_median']:.2f} Gbit/s, "
                f"{r['bare']['cpu_s_per_gb_median']:.2f} CPU s/GB = "
                f"{r['bare_vs_mooncake_cpu']:.2f}x Mooncake's CPU; "
                f"xdc {r['xdc_vs_bare_cpu']:.2f}x bare"
            )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
