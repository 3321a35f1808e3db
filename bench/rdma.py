"""RDMA vs TCP goodput, both ends in this process: one KV transfer between two endpoints, or
(``--daemons``) many requests through the real sender and receiver daemons.

Endpoint mode (default): with a usable RDMA device and pyverbs, both queue pairs are opened on
that device and connected to each other (the device loops the traffic back; on soft-RoCE over
one NIC that is the NIC's path), and the same request is then sent over loopback TCP with the
regular WireConn path (every chunk checksummed). Best of ``--repeat``.

Daemon mode (``--daemons``): the Sender and Receiver daemon classes run in this trio process,
fed by a prefill engine thread and drained by a decode engine thread over their real Unix
sockets and shared-memory pools, exactly as deployed engines talk to them. Each repeat runs two
fresh daemon pairs side by side: one with RDMA selected (same domain on both ends), one with
RDMA disabled (loopback TCP, TLS off). That prices RDMA where it will be used, with the
daemons' own scheduling, grants, control frames and engine hand-over around it, rather than
the bare data path. Median of ``--repeat``.

Without a device it prints why and exits 0. ``--fake`` runs the RDMA side over the
in-process fake fabric instead: that measures the CPU cost of xdc's RDMA bookkeeping
(posting, immediate decoding, trackers, sampled checksums) with memmove as the wire. It is not
an RDMA number.

Usage: python bench/rdma.py [--mib 256] [--chunk-kib 1024] [--layers 32] [--verify-every 16]
       [--repeat 3] [--fake] [--json FILE]
       python bench/rdma.py --daemons [--requests 8] [--in-flight 3] [--connections 8] [...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import psutil
import trio
from xdc.transport.engine_client import DecodeClient, PrefillClient, TransferError
from xdc.transport.launcher import local_pair_config
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.landing import LandingZone
from xdc.transport.rdma.select import RdmaDeps, usable_devices
from xdc.transport.rdma.session import RdmaReceiver, RdmaSender
from xdc.transport.rdma.verbs import Access, PyverbsBackend, Verbs
from xdc.transport.rdma.writer import RdmaWriter
from xdc.transport.receiver import Receiver
from xdc.transport.sender import PeerLink, Sender
from xdc.transport.shm import Segment
from xdc.transport.wire import WireConn

from xdc.config import Config, RdmaConfig
from xdc.lab.fake_verbs import FakeFabric, FakeVerbs
from xdc.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Begin,
    ChunkHeader,
    Complete,
    Event,
    Hello,
    Limits,
    ReceiveTracker,
    chunk_checksum,
)

FAKE_NOTE = "fake fabric: memmove as the wire; CPU cost of xdc's RDMA path, not an RDMA number"
MIB = 1 << 20


def _begin(total: int, layers: int, chunk: int) -> Begin:
    per = total // layers
    return Begin("bench", tuple([per] * layers), chunk, (), 0, 0)


async def rdma_run(
    verbs: Verbs, devices: tuple[str, str], begin: Begin, src: Segment, dst: Segment, every: int
) -> float:
    settings = RdmaConfig(enabled=True, domain="bench", max_inflight=64, recv_depth=128)
    tx = RdmaEndpoint(verbs, devices[0], settings)
    rx = RdmaEndpoint(verbs, devices[1], settings)
    try:
        tx_mr = tx.register("pool", src.view, Access.LOCAL_WRITE)
        staging = memoryview(bytearray(8 * settings.max_inflight))
        st_mr = tx.register("staging", staging, Access.LOCAL_WRITE)
        rx_mr = rx.register("pool", dst.view)
        rx_info = rx.local_info(dst.name, rx_mr)
        tx.connect(rx_info)
        rx.connect(tx.local_info(src.name))
        tracker = ReceiveTracker(begin)
        zone = LandingZone(dst.view, rx_mr.addr)
        grant = zone.grant(tracker, 0, begin.total_bytes, every)
        writer = RdmaWriter(tx_mr, staging, st_mr, rx_info.rkey, settings.max_inflight)
        writer.add(begin, grant, src.view[: begin.total_bytes], tx_mr.addr)
        sender, receiver = RdmaSender(tx, writer), RdmaReceiver(rx, zone)
        send_ch, recv_ch = trio.open_memory_channel[Event](10_000)
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            n.start_soon(receiver.run, send_ch.send)
            async with trio.open_nursery() as inner:
                inner.start_soon(sender.run, recv_ch)
                for layer in range(len(begin.layer_sizes)):
                    sender.layer_ready(begin.rid, layer)
            n.cancel_scope.cancel()
        elapsed = time.perf_counter() - t0
        assert tracker.complete
        writer.clear()
        del writer, grant, zone
        return elapsed
    finally:
        tx.close()
        rx.close()


async def tcp_run(begin: Begin, src: Segment, dst: Segment) -> float:
    a, b = trio.socket.socketpair()
    tx, rx = WireConn(a, "sender", Limits()), WireConn(b, "receiver", Limits())
    tracker = ReceiveTracker(begin)
    t0 = time.perf_counter()

    async def receive() -> None:
        await rx.next_event()
        await rx.send(Hello(PROTOCOL_VERSION, "rx", "receiver", "b", 0))
        while not tracker.complete:
            hdr = await rx.next_event()
            assert isinstance(hdr, ChunkHeader)
            pos, disp = tracker.locate(hdr)
            dest = dst.view[pos : pos + hdr.length]
            await rx.read_payload(dest)
            ok = chunk_checksum(dest, hdr.rid, hdr.layer, hdr.offset) == hdr.checksum
            tracker.finish(hdr, disp, ok)
            await rx.send(Ack(hdr.rid, hdr.layer, hdr.offset))
        await rx.send(Complete(begin.rid, begin.total_bytes))

    async def drain_acks() -> None:  # read while sending, or both socket buffers fill up
        while not isinstance(await tx.next_event(), Complete):
            pass

    async def send() -> None:
        await tx.send(Hello(PROTOCOL_VERSION, "tx", "sender", "b", 0))
        await tx.next_event()
        n_acks.start_soon(drain_acks)
        offsets = begin.layer_offsets
        for layer, size in enumerate(begin.layer_sizes):
            for off in range(0, size, begin.chunk_bytes):
                n = min(begin.chunk_bytes, size - off)
                pos = offsets[layer] + off
                data = src.view[pos : pos + n]
                csum = chunk_checksum(data, begin.rid, layer, off)
                await tx.send_chunk(ChunkHeader(begin.rid, layer, off, n, csum), data)

    async with trio.open_nursery() as n_acks:
        n_acks.start_soon(receive)
        n_acks.start_soon(send)
    elapsed = time.perf_counter() - t0
    tx.close()
    rx.close()
    return elapsed


# --- which RDMA device (both modes) --------------------------------------------------------


def real_devices() -> tuple[list[str], str]:
    """Usable devices, or none and why: the kernel's view first, then whether pyverbs is here."""
    devices, why = usable_devices()
    if importlib.util.find_spec("pyverbs") is None:
        return [], f"pyverbs not installed; {why}"
    return devices, why


def machine(rdma_probe: str) -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "rdma_devices": rdma_probe,
    }


# --- daemon mode ----------------------------------------------------------------------------

SHIFT_STEP = 4_099  # bytes; each request reads the random source at its own shift
SHIFT_SPAN = 1 << 20


@dataclass(eq=False)
class Workload:
    """N equal requests of equal layers. Layer bytes are windows into one random source made
    once up front (so the prefill engine only copies, and is not what gets measured), shifted
    per request and per layer, so a layer landing in the wrong place fails the spot checks."""

    requests: int
    layers: int
    layer_bytes: int
    in_flight: int
    source: npt.NDArray[np.uint8] = field(repr=False)

    @classmethod
    def make(cls, total: int, requests: int, layers: int, in_flight: int) -> Workload:
        layer_bytes = total // (requests * layers)
        if layer_bytes <= 0:
            raise SystemExit(f"--mib too small for {requests} requests x {layers} layers")
        size = layers * layer_bytes + SHIFT_SPAN
        source = np.frombuffer(np.random.default_rng().bytes(size), dtype=np.uint8)
        return cls(requests, layers, layer_bytes, in_flight, source)

    @property
    def request_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def total_bytes(self) -> int:
        return self.requests * self.request_bytes

    def rid(self, k: int) -> str:
        return f"bench-{k}"

    def layer(self, k: int, i: int) -> npt.NDArray[np.uint8]:
        off = (k * SHIFT_STEP) % SHIFT_SPAN + i * self.layer_bytes
        return self.source[off : off + self.layer_bytes]

    def checked_layers(self) -> list[int]:
        return sorted({0, self.layers // 2, self.layers - 1})


@dataclass
class Marks:
    """What the engine threads record for the measurement window."""

    t0: float = 0.0  # perf_counter at the first BEGIN
    cpu0: float = 0.0  # process_time at the first BEGIN
    t_last: float = 0.0  # perf_counter when the last outcome arrived
    delivered: int = 0  # bytes of requests whose outcome was ok
    checked_layers: int = 0
    engine_cpu: list[float] = field(default_factory=list)  # thread_time of each engine thread
    abort: threading.Event = field(default_factory=threading.Event)


def prefill_engine(sock: str, wl: Workload, marks: Marks) -> None:
    """Begin each request, fill and hand over its layers one by one, keep ``in_flight``
    requests outstanding; the window ends when the last outcome arrives."""
    sizes = [wl.layer_bytes] * wl.layers
    with PrefillClient(sock) as pc:
        c0 = time.thread_time()
        pending: list[str] = []

        def settle(rid: str) -> None:
            o = pc.wait(rid, 120)
            if not o.ok:
                raise RuntimeError(f"{rid} failed: {o.code} {o.error}")
            marks.delivered += o.bytes

        marks.t0, marks.cpu0 = time.perf_counter(), time.process_time()
        for k in range(wl.requests):
            if marks.abort.is_set():
                return
            t = pc.begin(wl.rid(k), sizes, deadline_s=120)
            for i in range(wl.layers):
                buf = t.layer_buffer(i)
                buf[:] = wl.layer(k, i)
                del buf
                t.layer_ready(i)
            pending.append(t.rid)
            while len(pending) >= wl.in_flight:
                settle(pending.pop(0))
        for rid in pending:
            settle(rid)
        marks.t_last = time.perf_counter()
        marks.engine_cpu.append(time.thread_time() - c0)


def decode_engine(sock: str, wl: Workload, marks: Marks) -> None:
    """Await every request in order, compare a few of its layers with what was sent, and
    release it at once so the receiver pool never pushes back."""
    with DecodeClient(sock) as dc:
        c0 = time.thread_time()
        for k in range(wl.requests):
            rid, waited = wl.rid(k), 0.0
            while True:  # short waits, so a failed prefill thread does not leave us hanging
                try:
                    req = dc.await_request(rid, timeout=1.0)
                    break
                except TransferError as e:
                    waited += 1.0
                    if e.code != "TIMEOUT" or marks.abort.is_set() or waited > 120:
                        raise
            for i in wl.checked_layers():
                if not np.array_equal(req.layer(i), wl.layer(k, i)):
                    raise RuntimeError(f"{rid} layer {i}: delivered bytes differ from those sent")
            marks.checked_layers += len(wl.checked_layers())
            req.release()
        marks.engine_cpu.append(time.thread_time() - c0)


async def _engine(
    fn: Callable[[str, Workload, Marks], None], sock: str, wl: Workload, m: Marks
) -> None:
    try:
        await trio.to_thread.run_sync(fn, sock, wl, m)
    except BaseException:
        m.abort.set()  # the other engine thread cannot be cancelled; tell it to stop
        raise


@dataclass
class DaemonRun:
    mode: str  # "rdma" or "tcp": what was configured
    backend: str  # what the sender reports it used
    reason: str
    bytes: int
    wall_s: float
    cpu_s: float  # whole process: both daemons and both engine threads
    engine_cpu_s: float  # the two engine threads alone
    tcp_payload_bytes: int  # sender metric xdc_sender_bytes: chunk payloads sent over TCP
    rdma_bytes_written: int
    checked_layers: int

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.wall_s / 1e9

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.bytes / 1e9)

    @property
    def daemon_cpu_s_per_gb(self) -> float:
        return (self.cpu_s - self.engine_cpu_s) / (self.bytes / 1e9)


@dataclass(frozen=True)
class RdmaSide:
    """How the RDMA pair gets its verbs and devices: the real ones, or a fresh fake fabric."""

    fake: bool
    label: str

    def open(self) -> tuple[RdmaDeps, RdmaDeps, FakeFabric | None]:
        """(sender's, receiver's, the fake fabric to check afterwards)."""
        if not self.fake:
            return RdmaDeps(), RdmaDeps(), None  # pyverbs and the sysfs probe
        fabric = FakeFabric()
        fabric.add_device("fake0")
        fabric.add_device("fake1")
        verbs = FakeVerbs(fabric)
        tx = RdmaDeps(lambda: verbs, lambda: (["fake0"], "fake fabric"))
        rx = RdmaDeps(lambda: verbs, lambda: (["fake1"], "fake fabric"))
        return tx, rx, fabric


def pair_configs(
    wd: Path, wl: Workload, args: argparse.Namespace, rdma: bool
) -> tuple[Config, Config]:
    """``local_pair_config`` (loopback, TLS off) with pools sized for the window; the RDMA pair
    differs from the TCP pair only in its ``[rdma]`` section."""
    pool = max(256 * MIB, -(-(wl.in_flight + 1) * wl.request_bytes // MIB) * MIB)
    tx, rx, _ = local_pair_config(
        wd,
        connections=args.connections,
        chunk_bytes=args.chunk_kib << 10,
        send_pool=pool,
        recv_pool=2 * pool,
    )
    if rdma:
        tx.rdma = rx.rdma = RdmaConfig(enabled=True, domain="bench", verify_every=args.every)
    return tx, rx


async def _until_ready(peer: PeerLink, connections: int, timeout: float = 20.0) -> None:
    """All data connections up and, with RDMA configured, the offer answered either way."""
    with trio.fail_after(timeout):
        while len(peer.live) < connections:
            await trio.sleep(0.01)
        while peer.rdma is not None and (
            peer.rdma.tried_session is None or peer.rdma.reason == "not negotiated yet"
        ):
            await trio.sleep(0.01)


async def daemon_run(
    mode: str, wl: Workload, args: argparse.Namespace, side: RdmaSide
) -> DaemonRun:
    """One fresh daemon pair in this trio loop, both engines in threads, one measured window."""
    rdma = mode == "rdma"
    tx_deps, rx_deps, fabric = side.open() if rdma else (None, None, None)
    with tempfile.TemporaryDirectory(prefix="xdc-bench-rdma-") as wd:
        tx, rx = pair_configs(Path(wd), wl, args, rdma)
        receiver = Receiver(rx, rdma=rx_deps)
        sender = Sender(tx, rdma=tx_deps)
        marks = Marks()
        async with trio.open_nursery() as n:
            await n.start(receiver.serve)
            await n.start(sender.serve)
            peer = next(iter(sender.peers.values()))
            await _until_ready(peer, tx.sender.connections)
            before = sender.status()["peers"][peer.name]["rdma"]
            if before["backend"] != mode:
                raise RuntimeError(
                    f"{mode} pair negotiated {before['backend']}: {before['reason']}"
                )
            async with trio.open_nursery() as engines:
                engines.start_soon(_engine, decode_engine, rx.receiver.control_socket, wl, marks)
                engines.start_soon(_engine, prefill_engine, tx.sender.control_socket, wl, marks)
            cpu = time.process_time() - marks.cpu0
            after = sender.status()["peers"][peer.name]["rdma"]
            tcp_bytes = sender.metrics.registry.get_sample_value("xdc_sender_bytes_total")
            n.cancel_scope.cancel()
    run = DaemonRun(
        mode=mode,
        backend=str(after["backend"]),
        reason=str(after["reason"]),
        bytes=marks.delivered,
        wall_s=marks.t_last - marks.t0,
        cpu_s=cpu,
        engine_cpu_s=sum(marks.engine_cpu),
        tcp_payload_bytes=int(tcp_bytes or 0),
        rdma_bytes_written=int(after.get("bytes_written", 0)),
        checked_layers=marks.checked_layers,
    )
    _check_run(run, wl, fabric)
    return run


def _check_run(run: DaemonRun, wl: Workload, fabric: FakeFabric | None) -> None:
    """The figure is only worth printing if the bytes went the way the label says."""
    problems = []
    if run.bytes != wl.total_bytes:
        problems.append(f"delivered {run.bytes} of {wl.total_bytes} bytes")
    if run.backend != run.mode:
        problems.append(f"ended on {run.backend}: {run.reason}")
    if run.mode == "rdma":
        if run.tcp_payload_bytes != 0:
            problems.append(f"{run.tcp_payload_bytes} payload bytes went over TCP")
        if run.rdma_bytes_written < wl.total_bytes:
            problems.append(f"only {run.rdma_bytes_written} bytes written by RDMA")
    elif run.tcp_payload_bytes < wl.total_bytes:
        problems.append(f"only {run.tcp_payload_bytes} payload bytes sent over TCP")
    if fabric is not None and fabric.violations:
        problems.append(f"fake fabric violations: {fabric.violations}")
    if fabric is not None and (fabric.live_registrations or fabric.open_objects):
        problems.append(
            f"daemons left {fabric.live_registrations} registrations and "
            f"{fabric.open_objects} verbs objects open"
        )
    if problems:
        raise RuntimeError(f"{run.mode} run invalid: " + "; ".join(problems))


def _summary(label: str, runs: list[DaemonRun]) -> dict[str, Any]:
    return {
        "label": label,
        "backend": runs[0].backend,
        "reason": runs[0].reason,
        "gbps_median": round(statistics.median(r.gbps for r in runs), 3),
        "cpu_s_per_gb_median": round(statistics.median(r.cpu_s_per_gb for r in runs), 3),
        "daemon_cpu_s_per_gb_median": round(
            statistics.median(r.daemon_cpu_s_per_gb for r in runs), 3
        ),
        "runs": [
            {
                **asdict(r),
                "gbps": round(r.gbps, 3),
                "cpu_s_per_gb": round(r.cpu_s_per_gb, 3),
                "daemon_cpu_s_per_gb": round(r.daemon_cpu_s_per_gb, 3),
            }
            for r in runs
        ],
    }


def daemons_main(args: argparse.Namespace) -> int:
    devices, why = real_devices()
    if args.fake:
        side = RdmaSide(True, "rdma (fake fabric)")
    elif devices:
        side = RdmaSide(False, f"rdma ({devices[0]})")
    else:
        print(f"bench/rdma.py --daemons: cannot run: no RDMA device ({why}).")
        print("Use --fake to measure xdc's RDMA path over the in-process fake fabric.")
        return 0
    if min(args.requests, args.in_flight, args.layers, args.repeat, args.connections) < 1:
        raise SystemExit("--requests, --in-flight, --layers, --repeat, --connections: >= 1")
    wl = Workload.make(args.mib * MIB, args.requests, args.layers, args.in_flight)
    tcp_label = f"tcp (loopback, {args.connections} conns)"
    if side.fake:
        print(f"NOTE {FAKE_NOTE}")
    print(
        f"{wl.requests} requests x {wl.layers} layers x {wl.layer_bytes >> 10} KiB "
        f"= {wl.total_bytes / MIB:.0f} MiB per run, {wl.in_flight} in flight, "
        f"chunk {args.chunk_kib} KiB, rdma verify_every {args.every}, {args.repeat} repeats"
    )
    runs: dict[str, list[DaemonRun]] = {"rdma": [], "tcp": []}
    for rep in range(args.repeat):
        order = ["rdma", "tcp"] if rep % 2 == 0 else ["tcp", "rdma"]  # drift hits both alike
        for mode in order:
            run = trio.run(daemon_run, mode, wl, args, side)
            runs[mode].append(run)
            print(
                f"  repeat {rep + 1} {mode:4}: {run.gbps:6.2f} Gbit/s, "
                f"{run.cpu_s_per_gb:5.2f} CPU s/GB (daemons alone {run.daemon_cpu_s_per_gb:5.2f})"
            )
    ratios = [r.gbps / t.gbps for r, t in zip(runs["rdma"], runs["tcp"], strict=True)]
    results: dict[str, Any] = {
        "mode": "daemons",
        "note": FAKE_NOTE if side.fake else f"real device {devices[0]}",
        "cpu_note": "CPU = time.process_time of this process over the window: both daemons "
        "and both engine threads run here; 'daemon' subtracts the engine threads' thread_time",
        "workload": {
            "requests": wl.requests,
            "layers": wl.layers,
            "layer_bytes": wl.layer_bytes,
            "bytes_per_run": wl.total_bytes,
            "in_flight": wl.in_flight,
            "chunk_bytes": args.chunk_kib << 10,
            "connections": args.connections,
            "rdma_verify_every": args.every,
            "repeat": args.repeat,
        },
        "rdma": _summary(side.label, runs["rdma"]),
        "tcp": _summary(tcp_label, runs["tcp"]),
        "rdma_over_tcp_median": round(statistics.median(ratios), 3),
        "rdma_over_tcp_per_repeat": [round(r, 3) for r in ratios],
        "machine": machine(why),
        "command": " ".join(["python", "bench/rdma.py", *sys.argv[1:]]),
    }
    print(f"\n{'mode':30} {'backend':8} {'Gbit/s':>7} {'CPU s/GB':>9} {'daemons':>8}")
    for key in ("rdma", "tcp"):
        s = results[key]
        print(
            f"{s['label']:30} {s['backend']:8} {s['gbps_median']:7.2f} "
            f"{s['cpu_s_per_gb_median']:9.2f} {s['daemon_cpu_s_per_gb_median']:8.2f}"
        )
    print(
        f"RDMA / TCP goodput: {results['rdma_over_tcp_median']:.2f} "
        f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)}); medians of {args.repeat}"
    )
    print("CPU s/GB: this whole process (daemons + engine threads); 'daemons' excludes engines")
    if side.fake:
        print(f"NOTE {FAKE_NOTE}")
    m = results["machine"]
    print(f"machine: {m['cpus']} cores, {m['memory_gib']} GiB, kernel {m['kernel']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
    return 0


# --- command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="bytes per run, in MiB")
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32, help="layers per request")
    p.add_argument("--verify-every", dest="every", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fake", action="store_true", help="RDMA path over the in-process fake")
    p.add_argument("--json", help="also write results here")
    p.add_argument("--daemons", action="store_true", help="through the real daemons (see above)")
    p.add_argument("--requests", type=int, default=8, help="--daemons: requests per run")
    p.add_argument("--in-flight", type=int, default=3, help="--daemons: requests outstanding")
    p.add_argument("--connections", type=int, default=8, help="--daemons: TCP connections")
    args = p.parse_args(argv)
    if args.daemons:
        return daemons_main(args)
    return endpoint_main(args)


def endpoint_main(args: argparse.Namespace) -> int:
    devices, why = real_devices()
    verbs: Verbs
    if args.fake:
        fabric = FakeFabric()
        fabric.add_device("fake0")
        fabric.add_device("fake1")
        verbs, pair, label = FakeVerbs(fabric), ("fake0", "fake1"), "rdma(fake fabric)"
    elif devices:
        verbs, pair, label = PyverbsBackend(), (devices[0], devices[0]), f"rdma({devices[0]})"
    else:
        print(f"bench/rdma.py: cannot run: no RDMA device ({why}).")
        print("Use --fake to measure the RDMA bookkeeping path over the in-process fake.")
        return 0

    begin = _begin(args.mib << 20, args.layers, args.chunk_kib << 10)
    total = begin.total_bytes
    src = Segment.create(total, prefix="xdc-bench")
    dst = Segment.create(total + 8 * (total // begin.chunk_bytes + 1) + 4096, prefix="xdc-bench")
    results: dict[str, Any] = {
        "bytes": total,
        "chunk_bytes": begin.chunk_bytes,
        "verify_every": args.every,
        "repeat": args.repeat,
    }
    try:
        src.view[:total] = secrets.token_bytes(total)
        rdma_s = tcp_s = float("inf")
        for _ in range(args.repeat):  # best of N; the destination is zeroed (and so faulted
            dst.view[:total] = bytes(total)  # in) before every run, for both paths alike
            rdma_s = min(rdma_s, trio.run(rdma_run, verbs, pair, begin, src, dst, args.every))
            assert bytes(dst.view[:total]) == bytes(src.view[:total])
            dst.view[:total] = bytes(total)
            tcp_s = min(tcp_s, trio.run(tcp_run, begin, src, dst))
            assert bytes(dst.view[:total]) == bytes(src.view[:total])
    finally:
        src.close()
        dst.close()
    rows = [(label, rdma_s), ("tcp(loopback, WireConn)", tcp_s)]
    print(f"{'path':28} {'MiB':>6} {'seconds':>8} {'Gbit/s':>8}")
    for name, secs in rows:
        gbps = total * 8 / secs / 1e9
        results[name] = {"seconds": round(secs, 4), "gbps": round(gbps, 2)}
        print(f"{name:28} {total >> 20:>6} {secs:>8.3f} {gbps:>8.2f}")
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
