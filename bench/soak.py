"""Soak: sustained verified transfers for N minutes under a rotating mix of real toxiproxy
faults on half of the sender's connections. Not part of CI (it runs for 10 minutes).

    python bench/soak.py --minutes 10 --json-out bench/results/soak_plain_10min_2core.json
    python bench/soak.py --minutes 10 --tls --json-out bench/results/soak_tls_4min_2core.json
    python bench/soak.py --minutes 4 --data-threads on --json-out bench/results/soak_threads.json
    python bench/soak.py --minutes 4 --hostile --json-out bench/results/soak_hostile.json
    python bench/soak.py --minutes 3 --data-workers 2 --json-out bench/results/soak_workers.json
    python bench/soak.py --minutes 4 --data-workers 2 --worker-runs [--tls]

``--hostile`` runs issue 26's hostile load beside the traffic, against a receiver limited to
512 descriptors: floods of 600 unauthenticated data connections (a decode engine must still
connect during each), a duplicate 4 MiB chunk on 40 connections, and a session that BEGINs
256 transfers and never sends a byte; it reports each, and the receiver's peak RSS.

Reports requests completed and failed, bytes, p50/p99 transfer time, and each daemon's RSS
at the start and the end (growth beyond noise would be a leak). Once the traffic stops, the
receiver must come to rest within 15 s: no request, no pool byte, no run, no leased buffer and
no stop flag still held (``at_rest``; anything else is a leak and fails the soak).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from xdc.transport.launcher import DaemonProcess, free_port, local_pair_config

from xdc.config import DATA_THREADS
from xdc.lab.transfer_load import Streamer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from xdc.lab.raw_peer import RawSender

MIB = 1 << 20
HOSTILE_NOFILE = 512

# (name, toxic spec or None); each phase lasts --phase-s seconds on the "faulty" path
PHASES: list[tuple[str, dict[str, Any] | None]] = [
    ("clean", None),
    ("latency 50+-10ms", {"type": "latency", "attributes": {"latency": 50, "jitter": 10}}),
    ("bandwidth 200 Mbit/s per conn", {"type": "bandwidth", "attributes": {"rate": 25000}}),
    ("reset_peer", {"type": "reset_peer", "attributes": {"timeout": 0}}),
    ("blackhole", {"type": "timeout", "attributes": {"timeout": 0}}),
    ("slicer", {"type": "slicer", "attributes": {"average_size": 256, "delay": 0}}),
    ("limit_data 4 MiB", {"type": "limit_data", "attributes": {"bytes": 4 * MIB}}),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--tls", action="store_true", help="mutual TLS (sealed records) on the link")
    ap.add_argument(
        "--data-threads",
        choices=DATA_THREADS,
        default="auto",
        help="sender.data_threads and receiver.data_threads (plain TCP and sealed records)",
    )
    ap.add_argument(
        "--data-workers",
        type=int,
        default=0,
        help="sender.data_workers and receiver.data_workers (worker processes per daemon)",
    )
    ap.add_argument(
        "--worker-runs",
        action="store_true",
        help="receiver.worker_runs: the receiver's workers read frames themselves (needs "
        "--data-workers)",
    )
    ap.add_argument("--hostile", action="store_true", help="issue 26's hostile load beside it")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.worker_runs and not args.data_workers:
        ap.error("--worker-runs needs --data-workers N (runs are a data worker's)")
    binary = shutil.which("toxiproxy-server")
    if binary is None:
        print("toxiproxy-server not installed (deploy/setup-test-env.sh)", file=sys.stderr)
        return 2
    from toxiproxy import Toxiproxy

    api_port = free_port()
    server = subprocess.Popen(
        [binary, "-host", "127.0.0.1", "-port", str(api_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wd = Path(tempfile.mkdtemp(prefix="xdc-soak-"))
    procs: list[DaemonProcess] = []
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", api_port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        tox = Toxiproxy()
        tox.update_api_consumer("127.0.0.1", api_port)
        tox.destroy_all()
        tx_cfg, rx_cfg, _ = local_pair_config(
            wd, connections=8, chunk_bytes=512 * 1024, send_pool=256 * MIB, recv_pool=512 * MIB
        )
        tx_cfg.sender.idle_timeout_s = 2.0
        tx_cfg.node.log_level = rx_cfg.node.log_level = "warning"
        tx_cfg.sender.data_threads = rx_cfg.receiver.data_threads = args.data_threads
        tx_cfg.sender.data_workers = rx_cfg.receiver.data_workers = args.data_workers
        rx_cfg.receiver.worker_runs = args.worker_runs
        if args.tls:
            from tls import make_pki  # bench/tls.py: certificates from a throwaway CA

            tx_cfg.tls, rx_cfg.tls = make_pki(wd)
        wrap = ["prlimit", f"--nofile={HOSTILE_NOFILE}:{HOSTILE_NOFILE}"] if args.hostile else []
        rx = DaemonProcess("receiver", rx_cfg, wd, wrap=wrap)
        procs.append(rx)
        rx.wait_ready()
        up = rx_cfg.receiver.listen_port
        clean_port, faulty_port = free_port(), free_port()
        tox.create(upstream=f"127.0.0.1:{up}", name="clean", listen=f"127.0.0.1:{clean_port}")
        faulty = tox.create(
            upstream=f"127.0.0.1:{up}", name="faulty", listen=f"127.0.0.1:{faulty_port}"
        )
        tx_cfg.sender.peer_port = clean_port
        tx_cfg.sender.peer_extra_addresses = (f"127.0.0.1:{faulty_port}",)
        tx = DaemonProcess("sender", tx_cfg, wd)
        procs.append(tx)
        tx.wait_ready()

        def rss() -> dict[str, dict[str, float]]:
            """Total RSS and its private part: pool pages are shared memory and count in RSS
            once first touched (bounded by the pool); a leak shows in the private part."""
            out = {}
            for d in procs:
                m = psutil.Process(d.proc.pid).memory_info()
                out[d.kind] = {
                    "rss": round(m.rss / MIB, 1),
                    "private": round((m.rss - m.shared) / MIB, 1),
                }
            return out

        sizes = [2 * MIB] * 16
        t_end = time.monotonic() + args.minutes * 60
        phases_run: list[str] = []
        hostile = Hostile(up, rx_cfg.receiver.control_socket, rx.proc.pid)
        with Streamer(
            tx_cfg.sender.control_socket, rx_cfg.receiver.control_socket, sizes, deadline_s=30
        ) as s:
            time.sleep(5)
            rss_start = rss()
            if args.hostile:
                hostile.start()
            k = 0
            while time.monotonic() < t_end:
                name, spec = PHASES[k % len(PHASES)]
                k += 1
                for toxic in list(faulty.toxics()):
                    faulty.destroy_toxic(toxic)
                if spec is not None:
                    faulty.add_toxic(stream="upstream", **spec)
                phases_run.append(name)
                print(
                    f"[{time.strftime('%H:%M:%S')}] phase {name}: delivered "
                    f"{s.stats.delivered}, failed {len(s.stats.failed)}",
                    file=sys.stderr,
                )
                time.sleep(min(args.phase_s, max(0.0, t_end - time.monotonic())))
            for toxic in list(faulty.toxics()):
                faulty.destroy_toxic(toxic)
            hostile.stop()
            stats = s.stop()
        rss_end = rss()
        at_rest = receiver_at_rest(rx_cfg.receiver.control_socket, 15.0)
        times = sorted(stats.transfer_s)
        report = {
            "minutes": args.minutes,
            "tls": "mutual, " + tx_cfg.tls.record_layer + " records" if args.tls else "off",
            "data_threads": args.data_threads,
            "data_workers": args.data_workers,
            "worker_runs": args.worker_runs,
            "phases": phases_run,
            "requests_completed": stats.delivered,
            "requests_failed": len(stats.failed),
            "failures": dict(list(stats.failed.items())[:20]),
            "corrupted": len(stats.corrupt),
            "bytes": stats.bytes,
            "transfer_s_p50": statistics.median(times) if times else None,
            "transfer_s_p99": times[min(len(times) - 1, int(len(times) * 0.99))] if times else None,
            "rss_mib_start": rss_start,
            "rss_mib_end": rss_end,
            "daemons_up": all(d.proc.poll() is None for d in procs),
            "at_rest": at_rest,
        }
        if args.data_workers:
            # workers alive and lost over the whole run (a worker lost is a lost connection,
            # but one lost without a fault to explain it is a bug: docs/data_workers.md)
            from xdc.transport.engine_client import DecodeClient, PrefillClient

            with PrefillClient(tx_cfg.sender.control_socket, timeout=5) as tx_engine:
                report["sender_data_workers"] = tx_engine.status()["data_workers"]
            with DecodeClient(rx_cfg.receiver.control_socket, timeout=5) as rx_engine:
                report["receiver_data_workers"] = rx_engine.status()["data_workers"]
        if args.hostile:
            report["hostile"] = hostile.report()
        print(json.dumps(report, indent=2))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=2))
        bad = stats.corrupt or not report["daemons_up"] or not at_rest["rest"]
        for side in ("sender_data_workers", "receiver_data_workers"):
            w = report.get(side)
            bad = bad or (w is not None and (w["alive"] < w["workers"] or w["lost"] > 0))
        if args.hostile:
            bad = bad or bool(hostile.engine_refused)
        return 1 if bad else 0
    finally:
        for d in procs:
            d.stop()
        server.terminate()
        server.wait()
        shutil.rmtree(wd, ignore_errors=True)


def receiver_at_rest(control_socket: str, within_s: float) -> dict[str, Any]:
    """The receiver's leftovers once the traffic stopped, polled until none is left or
    ``within_s`` passed: requests, pool bytes, runs, leased buffers, stop flags held."""
    from xdc.transport.engine_client import DecodeClient

    deadline = time.monotonic() + within_s
    with DecodeClient(control_socket, timeout=5) as rx_engine:
        while True:
            st = rx_engine.status()
            workers = st.get("data_workers") or {}
            left = {
                "requests": len(st["requests"]),
                "pool_used": st["pool"]["used"],
                "runs_under_way": st.get("runs_under_way", 0),
                "leased_buffers": st.get("leased_buffers", 0),
                "stop_flags_held": workers.get("stop_flags_held", 0),
            }
            if not any(left.values()) or time.monotonic() > deadline:
                return {
                    "rest": not any(left.values()),
                    **left,
                    "runs": st.get("runs", 0),
                    "run_chunks": st.get("run_chunks", 0),
                }
            time.sleep(0.2)


class Hostile:
    """Issue 26's findings 1, 2 and 5 as a loop of attacks on the receiver's data port, in a
    thread, while the soak's traffic runs: every wait bounded, every socket closed."""

    def __init__(self, port: int, rx_sock: str, rx_pid: int) -> None:
        self.port, self.rx_sock = port, rx_sock
        self.proc = psutil.Process(rx_pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.cycles = 0
        self.flood_connected: list[int] = []  # connections the kernel took, per flood
        self.engine_ok = 0  # decode engines that connected during a flood
        self.engine_refused: list[str] = []
        self.duplicates_acked = 0
        self.hog_accepted: list[int] = []  # of 256 BEGINs, per cycle
        self.rss_peak_mib = 0.0
        self.errors: list[str] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # (never started when --hostile is not given)
            self._thread.join(60)

    def _rss(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.rss_peak_mib = max(self.rss_peak_mib, self.proc.memory_info().rss / MIB)

    def _run(self) -> None:
        from xdc.transport.engine_client import DecodeClient

        from xdc.protocol import Accept, Ack, Begin, Error, Ping, Pong

        while not self._stop.is_set():
            self.cycles += 1
            n = self.cycles
            try:
                # 1: a flood of data connections, then a decode engine must get in
                flood: list[socket.socket] = []
                try:
                    for _ in range(600):
                        c = socket.socket()
                        c.setblocking(False)
                        with contextlib.suppress(BlockingIOError, OSError):
                            c.connect(("127.0.0.1", self.port))
                        flood.append(c)
                    time.sleep(1.0)
                    self.flood_connected.append(len(flood))
                    try:
                        with DecodeClient(self.rx_sock, timeout=5) as eng:
                            eng.status()
                        self.engine_ok += 1
                    except Exception as e:
                        self.engine_refused.append(f"{type(e).__name__}: {e}"[:200])
                    self._rss()
                finally:
                    for c in flood:
                        c.close()
                # 2: one duplicate 4 MiB chunk on 40 connections
                payload = os.urandom(4 * MIB)
                dups = [RawSender(self.port, f"dup-{n}") for _ in range(40)]
                try:
                    dups[0].send(Begin(f"dup-{n}", (4 * MIB, 4 * MIB), 4 * MIB, (), 0, 20_000))
                    dups[0].events_until(lambda ev: isinstance(ev, Accept | Error))
                    dups[0].send_chunk(f"dup-{n}", 0, 0, payload)
                    dups[0].events_until(lambda ev: isinstance(ev, Ack | Error))
                    for d in dups[1:]:
                        d.send_chunk(f"dup-{n}", 0, 0, payload)
                    for d in dups[1:]:
                        said = d.events_until(lambda ev: isinstance(ev, Ack | Error))
                        self.duplicates_acked += isinstance(said[-1], Ack)
                    self._rss()
                finally:
                    for d in dups:
                        d.close()
                # 3: a session that begins every slot and never sends a byte
                hog = RawSender(self.port, f"hog-{n}")
                try:
                    for i in range(256):
                        hog.send(Begin(f"hog-{n}-{i}", (MIB,), MIB, (), 0, 10_000))
                    hog.send(Ping(n))
                    said = hog.events_until(lambda ev: isinstance(ev, Pong), timeout=15)
                    self.hog_accepted.append(sum(isinstance(ev, Accept) for ev in said))
                    self._stop.wait(2.0)
                finally:
                    hog.close()
            except Exception as e:
                self.errors.append(f"cycle {n}: {type(e).__name__}: {e}"[:300])
                self._stop.wait(1.0)

    def report(self) -> dict[str, Any]:
        return {
            "receiver_nofile": HOSTILE_NOFILE,
            "cycles": self.cycles,
            "flood_connections_each": max(self.flood_connected, default=0),
            "engine_connects_during_floods": self.engine_ok,
            "engine_refused": self.engine_refused[:5],
            "duplicates_acked": self.duplicates_acked,
            "hog_begins_accepted_per_cycle": sorted(set(self.hog_accepted)),
            "receiver_rss_peak_mib": round(self.rss_peak_mib, 1),
            "errors": self.errors[:5],
        }


if __name__ == "__main__":
    sys.exit(main())
