"""One RDMA link without daemons: endpoints, a sender and a receiver of WRITEs over the fake
fabric or a real device, and a transfer through them."""

from __future__ import annotations

import gc
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.landing import LandingZone
from xdc.transport.rdma.qpinfo import QpInfo, decode_grant, encode_grant
from xdc.transport.rdma.session import RdmaReceiver, RdmaSender, exchange_qpinfo
from xdc.transport.rdma.verbs import Access, Verbs
from xdc.transport.rdma.writer import RdmaWriter
from xdc.transport.shm import Segment

from xdc.config import RdmaConfig
from xdc.lab.fake_verbs import FakeFabric, FakeVerbs
from xdc.protocol import (
    Begin,
    Event,
    ReceiveTracker,
)

LAYERS = (100_000, 0, 3 * 16384 + 17, 5000, 16384)


CHUNK = 16384


RX_OFFSET = 8192


@dataclass
class Rig:
    fabric: FakeFabric | None
    tx_pool: Segment
    rx_pool: Segment
    tx_ep: RdmaEndpoint
    rx_ep: RdmaEndpoint
    sender: RdmaSender
    receiver: RdmaReceiver
    tracker: ReceiveTracker
    zone: LandingZone
    payload: bytes
    events: list[Event] = field(default_factory=list)

    def landed(self) -> bytes:
        n = len(self.payload)
        return bytes(self.rx_pool.view[RX_OFFSET : RX_OFFSET + n])

    def close(self) -> None:
        self.tx_ep.close()
        self.rx_ep.close()
        self.sender.writer.clear()  # its views of the source pool (kept after a failure)
        gc.collect()  # trio's caught exceptions leave frame cycles that hold buffer views
        self.tx_pool.close()
        self.rx_pool.close()
        # unmapped for real: no registration (pin) outlived its endpoint
        assert self.tx_pool._mmap.closed and self.rx_pool._mmap.closed

    def assert_clean(self) -> None:
        assert self.fabric is not None
        assert self.fabric.violations == []
        assert self.fabric.live_registrations == 0
        assert self.fabric.registered == self.fabric.deregistered > 0
        assert self.fabric.open_objects == 0


async def _swap_over_tcp(a: QpInfo, b: QpInfo) -> tuple[QpInfo, QpInfo]:
    """Run the QP-info exchange over a real loopback TCP connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    got: dict[str, QpInfo] = {}
    async with trio.open_nursery() as n:

        async def server() -> None:
            stream = await listeners[0].accept()
            got["b_saw"] = await exchange_qpinfo(stream, b)
            await stream.aclose()

        n.start_soon(server)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        got["a_saw"] = await exchange_qpinfo(client, a)
        await client.aclose()
    await listeners[0].aclose()
    return got["a_saw"], got["b_saw"]


async def make_rig(
    verify_every: int,
    settings: RdmaConfig | None = None,
    verbs: Verbs | None = None,
    devices: tuple[str, str] = ("rxe0", "rxe1"),
) -> Rig:
    """A connected sender/receiver pair in this process (fake fabric unless ``verbs``)."""
    settings = settings or RdmaConfig(enabled=True, domain="d", max_inflight=8, recv_depth=16)
    fabric = None
    if verbs is None:
        fabric = FakeFabric()
        fabric.add_device("rxe0")
        fabric.add_device("rxe1")
        verbs = FakeVerbs(fabric)
    begin = Begin("req-1", LAYERS, CHUNK, (), 0, 0)
    payload = secrets.token_bytes(begin.total_bytes)
    tx_pool = Segment.create(1 << 20, prefix="xdc-test")
    rx_pool = Segment.create(1 << 20, prefix="xdc-test")
    tx_pool.view[: len(payload)] = payload
    tx_ep = RdmaEndpoint(verbs, devices[0], settings)
    rx_ep = RdmaEndpoint(verbs, devices[1], settings)
    tx_mr = tx_ep.register("pool", tx_pool.view, Access.LOCAL_WRITE)
    staging = memoryview(bytearray(8 * settings.max_inflight))
    st_mr = tx_ep.register("staging", staging, Access.LOCAL_WRITE)
    rx_mr = rx_ep.register("pool", rx_pool.view)
    tx_seen, rx_seen = await _swap_over_tcp(
        tx_ep.local_info(tx_pool.name), rx_ep.local_info(rx_pool.name, rx_mr)
    )
    tx_ep.connect(tx_seen)
    rx_ep.connect(rx_seen)
    tracker = ReceiveTracker(begin)
    zone = LandingZone(rx_pool.view, rx_mr.addr)
    sums_at = RX_OFFSET + begin.total_bytes + 64
    grant = zone.grant(tracker, RX_OFFSET, sums_at, verify_every)
    grant = decode_grant(encode_grant(grant))  # as it travels on the control connection
    writer = RdmaWriter(tx_mr, staging, st_mr, tx_seen.rkey, settings.max_inflight)
    writer.add(begin, grant, tx_pool.view[: len(payload)], tx_mr.addr)
    return Rig(
        fabric,
        tx_pool,
        rx_pool,
        tx_ep,
        rx_ep,
        RdmaSender(tx_ep, writer),
        RdmaReceiver(rx_ep, zone),
        tracker,
        zone,
        payload,
    )


async def run_transfer(
    rig: Rig, between_layers: Callable[[int], Awaitable[None]] | None = None
) -> None:
    send_ch, recv_ch = trio.open_memory_channel[Event](1000)

    async def to_sender(ev: Event) -> None:
        rig.events.append(ev)
        await send_ch.send(ev)

    async with trio.open_nursery() as n:
        n.start_soon(rig.receiver.run, to_sender)
        async with trio.open_nursery() as inner:
            inner.start_soon(rig.sender.run, recv_ch)
            for layer in range(len(LAYERS)):
                rig.sender.layer_ready("req-1", layer)
                if between_layers is not None:
                    await between_layers(layer)
        n.cancel_scope.cancel()
