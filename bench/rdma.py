"""RDMA vs TCP goodput for one KV transfer, both ends in this process.

With a usable RDMA device and pyverbs, both queue pairs are opened on that device and
connected to each other (the device loops the traffic back; on soft-RoCE over one NIC that is
the NIC's path), and the same request is then sent over loopback TCP with the regular
WireConn path (every chunk checksummed). Without a device it prints why and exits 0.
``--fake`` runs the RDMA path over the in-process fake fabric instead: that measures the CPU
cost of xdc's RDMA bookkeeping (posting, immediate decoding, tracker, sampled checksums) with
memmove as the wire. It is not an RDMA number.

Usage: python bench/rdma.py [--mib 256] [--chunk-kib 1024] [--layers 32] [--verify-every 16]
       [--repeat 3] [--fake] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import secrets
import sys
import time
from typing import Any

import trio
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.fake import FakeFabric, FakeVerbs
from xdc.transport.rdma.landing import LandingZone
from xdc.transport.rdma.select import usable_devices
from xdc.transport.rdma.session import RdmaReceiver, RdmaSender
from xdc.transport.rdma.settings import RdmaSettings
from xdc.transport.rdma.verbs import Access, PyverbsBackend, Verbs
from xdc.transport.rdma.writer import RdmaWriter
from xdc.transport.shm import Segment
from xdc.transport.wire import WireConn

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


def _begin(total: int, layers: int, chunk: int) -> Begin:
    per = total // layers
    return Begin("bench", tuple([per] * layers), chunk, (), 0, 0)


async def rdma_run(
    verbs: Verbs, devices: tuple[str, str], begin: Begin, src: Segment, dst: Segment, every: int
) -> float:
    settings = RdmaSettings(enabled=True, domain="bench", max_inflight=64, recv_depth=128)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--verify-every", dest="every", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fake", action="store_true", help="RDMA path over the in-process fake")
    p.add_argument("--json", help="also write results here")
    args = p.parse_args(argv)

    devices, why = usable_devices()
    if importlib.util.find_spec("pyverbs") is None:
        devices, why = [], f"pyverbs not installed; {why}"
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
