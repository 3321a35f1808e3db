"""Prefill-side daemon: takes layers from the prefill engine as they are computed and stripes
their chunks over N parallel TCP connections to the receiver.

Striping is pull-based: every connection's writer takes the next chunk from one shared queue,
so a fast connection carries more and a stalled one carries nothing new. A chunk stays owned
by the connection that sent it until the receiver ACKs it (which it does only after checking
the checksum); a connection that dies or goes idle hands its unacked chunks back to the front
of the queue for the others. A layer's buffer returns to the pool once all its chunks are
acked, which is what bounds sender memory and pushes back on the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import struct
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import trio
from xdc.monitor.metrics import LinkMetrics
from xdc.transport.control import (
    TrioChannel,
    accept_engines,
    bind_unix_listener,
    engine_uids,
    serve_engine,
)
from xdc.transport.linkmon import PeerMonitor
from xdc.transport.metrics import SenderMetrics
from xdc.transport.pool import BufferPool, PoolTooSmall
from xdc.transport.rdma.peer_sender import PeerRdma
from xdc.transport.rdma.qpinfo import SlotGrant
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.shm import sweep_stale_segments
from xdc.transport.tls import TlsRefused, classify, client_handshake, load_policy
from xdc.transport.wire import PeerClosed, WireConn, tune_socket

from xdc.config import Config
from xdc.protocol import (
    Accept,
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    End,
    Error,
    Grant,
    Hello,
    LayerDone,
    Limits,
    Nack,
    Ping,
    Pong,
    ProtocolError,
    RdmaAnswer,
    RdmaClose,
    SendTracker,
    chunk_checksum,
)
from xdc.protocol import Ack as AckEv
from xdc.protocol.control import (
    SENDER_OPS,
    Alloc,
    BeginRequest,
    CancelRequest,
    EngineHello,
    Outcome,
    Ready,
    Request,
    Status,
    outcome_event,
)
from xdc.protocol.errors import ErrorCode, TransferError
from xdc.protocol.events import PROTOCOL_VERSION

log = logging.getLogger("xdc.sender")

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
MAX_REOFFER_S = 600.0  # longest wait before RDMA is offered again after link failures


RequestFailed = TransferError  # what the sender raises for an engine to see


@dataclass(frozen=True, slots=True)
class Work:
    rid: str
    layer: int
    offset: int
    length: int


@dataclass(eq=False)
class OutRequest:
    begin: Begin
    tracker: SendTracker
    peer: PeerLink
    owner: _PrefillEngine | None
    t_begin: float
    deadline: float
    layer_slot: list[int | None]
    handed: list[bool]
    # bytes [0, ready_upto[l]) of layer l are final (the engine may hand a layer over in
    # parts, e.g. as chunked prefill completes its blocks); queued_upto[l]: how much of that
    # has been given to the data path (chunk queue or RDMA writer)
    ready_upto: list[int] = field(default_factory=list)
    queued_upto: list[int] = field(default_factory=list)
    state: str = "pending"  # pending (BEGIN not accepted yet) | sending | complete | failed
    accepted: trio.Event = field(default_factory=trio.Event)
    retry_begin: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    acked: set[tuple[int, int]] = field(default_factory=set)
    error_code: str = ""
    error: str = ""
    t_last_handed: float = 0.0
    t_done: float = 0.0
    resent: int = 0
    # chunks of each layer currently inside sendmsg: their buffer must not be reused yet
    inflight: list[int] = field(default_factory=list)
    mode: str = "tcp"  # "rdma": its bytes go by RDMA WRITE (granted by the receiver)
    grant: SlotGrant | None = None  # usable grant of the current BEGIN
    granted: bool = False  # the receiver granted a slot (usable or not): it may quarantine
    grant_qpn: int = 0  # the receiver QP the grant was made under (a grant is only good there)
    rdma_done: set[int] = field(default_factory=set)  # layers the receiver reported done
    rdma_free_wait: set[int] = field(default_factory=set)  # done, source still being read
    # LAYER_DONE came before our WRITE completions for it were polled: applied when they are
    rdma_done_early: set[int] = field(default_factory=set)

    @property
    def rid(self) -> str:
        return self.begin.rid


class ConnSlot:
    """One of the N connections to a peer; reconnects for as long as the daemon runs."""

    def __init__(self, peer: PeerLink, index: int, address: tuple[str, int]) -> None:
        self.peer = peer
        self.index = index
        self.address = address
        self.wire: WireConn | None = None
        self.unacked: dict[tuple[str, int, int], Work] = {}
        self.pending_begins: set[str] = set()
        self.reason = ""
        self.connects = 0


class PeerLink:
    def __init__(self, sender: Sender, host: str, port: int) -> None:
        self.sender = sender
        self.host = host
        self.port = port
        self.queue: deque[Work] = deque()
        self._work_ready = trio.Event()
        addrs = [(host, port)]
        if (host, port) == (sender.sc.peer_host, sender.sc.peer_port):
            for a in filter(None, (x.strip() for x in sender.sc.peer_extra_addresses.split(","))):
                h, _, p = a.rpartition(":")
                addrs.append((h, int(p)))
        self.slots = [
            ConnSlot(self, i, addrs[i % len(addrs)]) for i in range(sender.sc.connections)
        ]
        self.live: list[ConnSlot] = []
        self._live_changed = trio.Event()
        self.pacing_bps = sender.sc.pacing_rate_bps
        self.peer_session: str | None = None
        self._new_session = trio.Event()
        self.rdma: PeerRdma | None = None
        if sender.cfg.rdma.enabled:
            self.rdma = PeerRdma(
                self.name,
                sender.cfg.rdma,
                sender.pool.view,
                sender.pool.name,
                sender.rdma_deps.verbs,
                sender.rdma_deps.devices,
                sender.rdma_fallback,
                self._rdma_batch,
            )
        else:
            log.info("peer %s: using tcp (rdma disabled in local config)", self.name)
        self.monitor = PeerMonitor(
            self.name, sender.cfg, self.live_sockets, self._paced, sender.link_metrics
        )

    def _paced(self, aggregate_bps: int) -> None:
        """The monitor's pacing decision; a configured cap still bounds it."""
        cap = self.sender.sc.pacing_rate_bps
        rate = min(r for r in (aggregate_bps, cap) if r > 0) if (aggregate_bps or cap) else 0
        self.apply_pacing(rate)

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    # --- work queue -----------------------------------------------------------------------

    def enqueue(self, items: list[Work], *, front: bool = False) -> None:
        if front:
            self.queue.extendleft(reversed(items))
        else:
            self.queue.extend(items)
        if items:
            self._work_ready.set()
            self._work_ready = trio.Event()

    async def next_work(self) -> Work:
        while not self.queue:
            await self._work_ready.wait()
        return self.queue.popleft()

    async def wait_live(self) -> ConnSlot:
        while not self.live:
            await self._live_changed.wait()
        # spread BEGINs over connections
        return self.live[secrets.randbelow(len(self.live))]

    def _set_live(self, slot: ConnSlot, live: bool) -> None:
        if live:
            self.live.append(slot)
        elif slot in self.live:
            self.live.remove(slot)
            if not self.live and self.rdma is not None and self.rdma.active:
                # the receiver drops its queue pair with the session's last connection
                self.rdma.close_on_peer("every data connection to the receiver was lost")
        self._live_changed.set()
        self._live_changed = trio.Event()
        self.sender.metrics.connections.set(sum(len(p.live) for p in self.sender.peers.values()))

    # --- connections ----------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as n:
                for slot in self.slots:
                    n.start_soon(self._slot_loop, slot)
                n.start_soon(self.monitor.run)
                if self.rdma is not None:
                    n.start_soon(self._rdma_loop, self.rdma)
        finally:
            if self.rdma is not None:
                self.rdma.close()

    async def _rdma_loop(self, rdma: PeerRdma) -> None:
        """Offer RDMA to each receiver session; run it until it fails, then stay on TCP
        and offer again after ``rdma.reoffer_s``, doubling per failure (a refused re-offer
        counts as one) up to 10 min; a new receiver session starts a new count."""
        failures = 0
        reoffering: str | None = None  # the session whose link failed
        while True:
            slot = await self.wait_live()
            session = self.peer_session
            if slot.wire is None or session is None:
                continue
            if reoffering is not None and session != reoffering:
                failures, reoffering = 0, None
            if session == rdma.tried_session:
                await self._new_session.wait()
                continue
            if await rdma.negotiate(slot.wire, session, self.sender.sc.connect_timeout_s):
                t_up = trio.current_time()
                await rdma.run(lambda ev: self.sender._tell_peer(self, ev))
                if trio.current_time() - t_up > MAX_REOFFER_S:
                    failures = 0  # it ran well for long: this failure starts a new count
                reoffering = session
            elif rdma.tried_session is None:  # unanswered: try again after a pause
                await trio.sleep(self.sender.sc.connect_timeout_s)
                continue
            elif reoffering != session:
                continue  # refused on first contact: not until the receiver restarts
            reoffer = self.sender.cfg.rdma.reoffer_s
            if reoffer > 0 and session == self.peer_session:
                failures += 1
                delay = min(reoffer * 2 ** (failures - 1), MAX_REOFFER_S)
                log.info("peer %s: rdma offered again in %.0fs", self.name, delay)
                with trio.move_on_after(delay):
                    await self._new_session.wait()
                if rdma.tried_session == session:
                    rdma.tried_session = None  # same receiver: offer again

    def _rdma_batch(self) -> None:
        """Send completions arrived: layers done at the receiver may now be reused."""
        for req in list(self.sender.requests.values()):
            if req.peer is self and req.rdma_done_early:
                for layer in list(req.rdma_done_early):
                    self.sender.on_layer_done(LayerDone(req.rid, layer))
            if req.peer is self and req.rdma_free_wait:
                for layer in list(req.rdma_free_wait):
                    self.sender.maybe_free_layer(req, layer)

    def live_sockets(self) -> list[trio.socket.SocketType]:
        return [s.wire.sock for s in self.live if s.wire is not None and not s.wire.closed]

    async def _slot_loop(self, slot: ConnSlot) -> None:
        sc = self.sender.sc
        backoff = sc.reconnect_backoff_s
        while True:
            try:
                wire = await self._connect(slot)
            except TlsRefused as e:
                # logged when it changes, not on every retry of every connection
                if slot.reason != f"tls {e.reason}: {e.detail}":
                    log.warning(
                        "conn %d to %s refused at the TLS handshake (%s): %s",
                        slot.index,
                        self.name,
                        e.reason,
                        e.detail,
                    )
                slot.reason = f"tls {e.reason}: {e.detail}"
                self.sender.metrics.connection_failures.labels(f"tls_{e.reason}").inc()
                await trio.sleep(backoff)
                backoff = min(max(backoff * 2, 0.05), 2.0)
                continue
            except (OSError, PeerClosed, ProtocolError, trio.TooSlowError) as e:
                slot.reason = f"connect: {e}"
                log.debug("conn %d to %s: %s", slot.index, self.name, slot.reason)
                await trio.sleep(backoff)
                backoff = min(max(backoff * 2, 0.05), 2.0)
                continue
            backoff = sc.reconnect_backoff_s
            slot.wire = wire
            slot.connects += 1
            self._set_live(slot, True)
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(self._guard, slot, self._reader, n.cancel_scope)
                    n.start_soon(self._guard, slot, self._writer, n.cancel_scope)
                    n.start_soon(self._guard, slot, self._keepalive, n.cancel_scope)
            finally:
                self._set_live(slot, False)
                wire.close()
                slot.wire = None
                self._orphan(slot)
            self.sender.metrics.connection_failures.labels(_reason_label(slot.reason)).inc()
            log.warning("conn %d to %s lost: %s", slot.index, self.name, slot.reason)
            await trio.sleep(backoff)

    async def _guard(self, slot: ConnSlot, fn: Any, scope: trio.CancelScope) -> None:
        """Run one of the connection's tasks; any failure closes the whole connection."""
        try:
            await fn(slot)
            slot.reason = f"{fn.__name__} ended"
        except PeerClosed as e:
            slot.reason = str(e)
        except ProtocolError as e:
            slot.reason = f"protocol error {e.code.name}: {e.message}"
            if slot.wire is not None:
                await slot.wire.send_error_and_close(e.code, e.message)
        scope.cancel()

    async def _connect(self, slot: ConnSlot) -> WireConn:
        sc = self.sender.sc
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        try:
            tune_socket(
                sock,
                sndbuf=sc.sndbuf_bytes,
                notsent_lowat=sc.notsent_lowat_bytes,
                congestion=sc.tcp_congestion,
            )
            policy = self.sender.tls
            with trio.fail_after(sc.connect_timeout_s):
                await sock.connect(slot.address)
                if policy is None:
                    wire = WireConn(sock, "sender", self.sender.limits)
                else:
                    stream = await client_handshake(sock, policy, self.host)
                    wire = WireConn(sock, "sender", self.sender.limits, tls=stream)
                try:
                    await wire.send(
                        Hello(
                            PROTOCOL_VERSION,
                            self.sender.cfg.node.id,
                            "sender",
                            self.sender.session,
                            slot.index,
                        )
                    )
                    hello = await wire.next_event()
                except PeerClosed as e:
                    # TLS 1.3: the receiver judges our certificate after our side of the
                    # handshake is done, so its refusal arrives here, on the first read
                    if policy is None:
                        raise
                    raise classify(e) from e
            if not isinstance(hello, Hello):
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "expected HELLO")
        except BaseException:
            sock.close()
            raise
        if self.peer_session is not None and hello.session != self.peer_session:
            self.sender.peer_restarted(self, hello.session)
        if hello.session != self.peer_session:
            self.peer_session = hello.session
            self._new_session.set()
            self._new_session = trio.Event()
        self.apply_pacing_to(sock)
        return wire

    def apply_pacing(self, aggregate_bps: int) -> None:
        """Spread an aggregate pacing rate (0 = unlimited) over the live sockets."""
        self.pacing_bps = aggregate_bps
        for slot in self.live:
            if slot.wire is not None:
                self.apply_pacing_to(slot.wire.sock)

    def apply_pacing_to(self, sock: trio.socket.SocketType) -> None:
        if self.pacing_bps <= 0:
            rate = 0xFFFFFFFFFFFFFFFF  # the kernel's "unlimited"
        else:
            rate = max(1, self.pacing_bps // 8 // max(1, len(self.slots)))
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=Q", rate))
        except OSError as e:
            log.debug("SO_MAX_PACING_RATE not applied: %s", e)

    def _orphan(self, slot: ConnSlot) -> None:
        """Hand a dead connection's unacked chunks back to the others, oldest first."""
        items = [w for w in slot.unacked.values() if self.sender.wants(w)]
        slot.unacked.clear()
        for w in items:
            req = self.sender.requests.get(w.rid)
            if req is not None:
                req.resent += 1
        self.sender.metrics.resent_chunks.inc(len(items))
        self.enqueue(items, front=True)
        for rid in slot.pending_begins:
            req = self.sender.requests.get(rid)
            if req is not None:
                req.retry_begin.set()
        slot.pending_begins.clear()

    async def _writer(self, slot: ConnSlot) -> None:
        wire = slot.wire
        assert wire is not None
        sender = self.sender
        view = sender.pool.view
        while True:
            work = await self.next_work()
            req = sender.requests.get(work.rid)
            if req is None or req.state != "sending" or (work.layer, work.offset) in req.acked:
                continue
            base = req.layer_slot[work.layer]
            if base is None:
                continue
            payload = view[base + work.offset : base + work.offset + work.length]
            digest = chunk_checksum(payload, work.rid, work.layer, work.offset)
            hdr = ChunkHeader(work.rid, work.layer, work.offset, work.length, digest)
            slot.unacked[(work.rid, work.layer, work.offset)] = work
            req.inflight[work.layer] += 1
            try:
                await wire.send_chunk(hdr, payload)
            finally:
                req.inflight[work.layer] -= 1
                sender.maybe_free_layer(req, work.layer)
            sender.metrics.bytes_sent.inc(work.length)

    async def _reader(self, slot: ConnSlot) -> None:
        wire = slot.wire
        assert wire is not None
        sender = self.sender
        while True:
            ev = await wire.next_event()
            if isinstance(ev, AckEv):
                slot.unacked.pop((ev.rid, ev.layer, ev.offset), None)
                sender.on_ack(ev)
            elif isinstance(ev, Nack):
                work = slot.unacked.pop((ev.rid, ev.layer, ev.offset), None)
                req = sender.requests.get(ev.rid)
                if req is not None and req.mode == "rdma" and self.rdma is not None:
                    if self.rdma.on_nack(ev.rid, ev.layer, ev.offset):
                        req.resent += 1
                        sender.metrics.resent_chunks.inc()
                    continue
                if work is not None and req is not None and sender.wants(work):
                    req.resent += 1
                    sender.metrics.resent_chunks.inc()
                    log.warning(
                        "%s layer %d offset %d NACKed (%s); resending",
                        ev.rid,
                        ev.layer,
                        ev.offset,
                        ev.reason,
                    )
                    self.enqueue([work], front=True)
            elif isinstance(ev, Accept):
                slot.pending_begins.discard(ev.rid)
                sender.on_accept(ev.rid)
            elif isinstance(ev, Error):
                if ev.rid is None:
                    raise PeerClosed(f"receiver error {ev.code}: {ev.message}")
                sender.fail(ev.rid, _code_name(ev.code), f"receiver: {ev.message}", notify=False)
            elif isinstance(ev, Cancel):
                sender.fail(ev.rid, "CANCELLED", f"receiver cancelled: {ev.reason}", notify=False)
            elif isinstance(ev, Ping):
                await wire.send(Pong(ev.nonce))
            elif isinstance(ev, LayerDone):
                sender.on_layer_done(ev)
            elif isinstance(ev, Complete):
                sender.on_peer_complete(ev)
            elif isinstance(ev, Grant):
                sender.on_grant(ev)
            elif isinstance(ev, RdmaAnswer):
                if self.rdma is not None:
                    self.rdma.on_answer(ev)
            elif isinstance(ev, RdmaClose):
                if self.rdma is not None:
                    self.rdma.close_on_peer(ev.reason, ev.qp_num)
            elif isinstance(ev, Pong):
                pass

    async def _keepalive(self, slot: ConnSlot) -> None:
        """PING often enough that the receiver's idle timer never fires on a healthy link, and
        declare the connection dead when nothing at all came back for idle_timeout."""
        wire = slot.wire
        assert wire is not None
        idle = self.sender.sc.idle_timeout_s
        interval = min(1.0, idle / 3)
        nonce = 0
        while True:
            await trio.sleep(interval)
            if trio.current_time() - wire.last_rx > idle:
                raise PeerClosed(f"nothing received for {idle}s (blackholed or peer stalled)")
            nonce += 1
            with trio.move_on_after(interval):
                await wire.send(Ping(nonce))


def _code_name(code: int) -> str:
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"E{code}"


def _reason_label(reason: str) -> str:
    for key in ("idle", "reset", "closed", "protocol", "refused", "connect"):
        if key in reason.lower():
            return key
    return "other"


class Sender:
    def __init__(
        self,
        cfg: Config,
        *,
        rdma: RdmaDeps | None = None,
    ) -> None:
        self.cfg = cfg
        # RDMA (same-domain peers only): verbs and device probe are injectable for tests
        self.rdma_deps = rdma or RdmaDeps()
        self.sc = cfg.sender
        self.limits = Limits(**dataclasses.asdict(cfg.limits))
        for name in sweep_stale_segments():
            log.warning("removed shared memory %s left by a dead xdc process", name)
        # before any resource is taken: a mutual-TLS config without usable files is fatal
        self.tls = load_policy(cfg.tls, server=False)
        self.engine_uids = engine_uids(cfg.node.allowed_uids)
        self.pool = BufferPool(self.sc.pool_bytes, prefix="xdc-tx")
        self.requests: dict[str, OutRequest] = {}
        self.peers: dict[tuple[str, int], PeerLink] = {}
        self.metrics = SenderMetrics()
        self.link_metrics = LinkMetrics(self.metrics.registry)
        self.session = f"{os.getpid():x}-{secrets.token_hex(6)}"
        self.completed = 0
        self.failed = 0
        # why recent requests ended, so a late call from the engine gets the real reason
        self.ended: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self.draining = False
        self._notifying = 0  # CANCELs to the receiver still being sent

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        ctl = trio.socket.from_stdlib_socket(
            bind_unix_listener(
                self.sc.control_socket, group=bool(self.cfg.node.allowed_uids.strip())
            )
        )
        log.info(
            "sender %s: peer %s:%d over %d connections (%s), control %s, pool %d MiB",
            self.cfg.node.id,
            self.sc.peer_host,
            self.sc.peer_port,
            self.sc.connections,
            "mutual TLS 1.3" if self.tls else "plain TCP: tls.mode = off",
            self.sc.control_socket,
            self.sc.pool_bytes >> 20,
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.peer(None)
                nursery.start_soon(
                    accept_engines, ctl, self.engine_uids, "prefill", self._serve_engine, nursery
                )
                task_status.started()
                await trio.sleep_forever()
        finally:
            ctl.close()
            self.pool.close()
            with contextlib.suppress(OSError):
                os.unlink(self.sc.control_socket)

    async def shutdown(self) -> None:
        """SIGTERM: refuse new requests, give in-flight ones ``node.shutdown_drain_s`` to be
        delivered (their engines may still be handing over layers), then fail the rest so
        each engine gets an outcome and the receiver frees their buffers."""
        self.draining = True
        drain = self.cfg.node.shutdown_drain_s
        log.info("draining: %d requests in flight, up to %.1fs", len(self.requests), drain)
        with trio.move_on_after(drain):
            while self.requests:
                await trio.sleep(0.02)
        left = list(self.requests)
        for rid in left:
            self.fail(
                rid, "SHUTDOWN", f"sender shut down before the transfer finished (drain {drain:g}s)"
            )
        # outcomes reach the engines from each request's own task; CANCELs go to the peer
        with trio.move_on_after(2.0):
            while self.requests or self._notifying:
                await trio.sleep(0.01)
        log.info("drained: %d requests failed at the deadline", len(left))

    def peer(self, spec: str | None) -> PeerLink:
        if spec:
            host, _, port_s = spec.rpartition(":")
            key = (host or self.sc.peer_host, int(port_s))
        else:
            key = (self.sc.peer_host, self.sc.peer_port)
        link = self.peers.get(key)
        if link is None:
            assert self._nursery is not None
            link = PeerLink(self, *key)
            self.peers[key] = link
            self._nursery.start_soon(link.run)
        return link

    def peer_restarted(self, peer: PeerLink, session: str) -> None:
        """A new receiver session means the old one's partial requests are gone: fail the
        accepted ones now instead of waiting for their deadline. Not-yet-accepted requests
        simply BEGIN again on the new session."""
        log.warning(
            "receiver %s restarted (session %s -> %s)", peer.name, peer.peer_session, session
        )
        if peer.rdma is not None:
            peer.rdma.close_on_peer("receiver restarted")
        for req in list(self.requests.values()):
            if req.peer is peer and req.state == "sending":
                self.fail(
                    req.rid,
                    "PEER_RESTARTED",
                    "receiver restarted; partial transfer lost",
                    notify=False,
                )

    def wants(self, w: Work) -> bool:
        req = self.requests.get(w.rid)
        return req is not None and req.state == "sending" and (w.layer, w.offset) not in req.acked

    # --- protocol callbacks ---------------------------------------------------------------

    def on_accept(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.state != "pending":
            return
        req.state = "sending"
        req.accepted.set()
        rdma = req.peer.rdma
        if (
            req.grant is not None
            and rdma is not None
            and rdma.active
            and rdma.remote is not None
            and rdma.remote.qp_num == req.grant_qpn  # not a grant of a pair since replaced
        ):
            req.mode = "rdma"
            rdma.add(req.begin, req.grant)
        for layer in range(len(req.handed)):
            self._enqueue_layer(req, layer)

    def on_ack(self, ev: AckEv) -> None:
        req = self.requests.get(ev.rid)
        if req is None or req.state != "sending":
            return
        key = (ev.layer, ev.offset)
        try:
            new = req.tracker.ack(ev.layer, ev.offset)
        except ProtocolError as e:
            self.fail(ev.rid, "PROTOCOL", f"bad ack: {e.message}")
            return
        if not new:
            return
        req.acked.add(key)
        if req.tracker.layer_acked(ev.layer):
            self.maybe_free_layer(req, ev.layer)
        if req.tracker.all_acked and all(req.handed):
            self._complete(req)

    def on_grant(self, ev: Grant) -> None:
        req = self.requests.get(ev.rid)
        if req is not None and req.state == "pending" and req.peer.rdma is not None:
            req.granted = True
            req.grant = req.peer.rdma.accept_grant(req.begin, ev.grant)
            remote = req.peer.rdma.remote
            req.grant_qpn = remote.qp_num if remote is not None else 0

    def on_layer_done(self, ev: LayerDone) -> None:
        """Informational over TCP (ACKs decide); for an RDMA request it confirms a layer."""
        req = self.requests.get(ev.rid)
        if req is None or req.mode != "rdma" or not 0 <= ev.layer < len(req.handed):
            return
        if req.peer.rdma is not None and not req.peer.rdma.layer_written(ev.rid, ev.layer):
            log.warning(
                "LAYER_DONE for %s layer %d before it was written; ignored", ev.rid, ev.layer
            )
            return
        if not req.handed[ev.layer]:  # its buffer is still the engine's: never free that
            log.warning(
                "LAYER_DONE for %s layer %d before its hand-over; ignored", ev.rid, ev.layer
            )
            return
        req.rdma_done.add(ev.layer)
        if req.peer.rdma is not None:
            req.peer.rdma.on_layer_done(ev.rid, ev.layer)
        self.maybe_free_layer(req, ev.layer)

    def on_peer_complete(self, ev: Complete) -> None:
        """Informational over TCP; for an RDMA request, the receiver verified everything."""
        req = self.requests.get(ev.rid)
        if req is None or req.mode != "rdma" or req.state != "sending" or not all(req.handed):
            return
        if req.peer.rdma is not None:
            req.peer.rdma.stop(req.rid)
        self._complete(req)

    async def rdma_fallback(
        self, rid: str, unconfirmed: list[tuple[int, int, int]], done: set[int]
    ) -> None:
        """The RDMA link failed: layers the receiver confirmed count as acked; the rest of
        what was handed over goes over TCP (duplicates of landed chunks are acked cheaply)."""
        req = self.requests.get(rid)
        if req is None or req.mode != "rdma":
            return
        req.mode = "tcp"
        if req.state != "sending":
            return
        for layer in sorted(done):
            for off, _n in req.tracker.chunks(layer):
                if req.tracker.ack(layer, off):
                    req.acked.add((layer, off))
            self.maybe_free_layer(req, layer)
        req.resent += len(unconfirmed)
        self.metrics.resent_chunks.inc(len(unconfirmed))
        req.peer.enqueue([Work(rid, layer, off, n) for layer, off, n in unconfirmed])
        for layer in range(len(req.handed)):  # parts handed over but never given to RDMA
            self._enqueue_layer(req, layer)
        if req.tracker.all_acked and all(req.handed):
            self._complete(req)

    def _enqueue_layer(self, req: OutRequest, layer: int) -> None:
        """Give the data path what the engine has made final of ``layer`` since last time:
        over TCP every chunk-grid cell lying wholly in the ready prefix; over RDMA the whole
        layer once it is handed over."""
        size = req.begin.layer_sizes[layer]
        if req.queued_upto[layer] >= size:
            return
        if req.mode == "rdma" and req.peer.rdma is not None:
            if req.handed[layer]:
                req.queued_upto[layer] = size
                req.peer.rdma.layer_ready(req.rid, layer, req.layer_slot[layer], size)
            return
        cells = req.tracker.grid.cells_within(layer, req.queued_upto[layer], req.ready_upto[layer])
        work = [Work(req.rid, layer, off, n) for off, n in cells]
        if work:
            req.queued_upto[layer] = work[-1].offset + work[-1].length
            req.peer.enqueue(work)

    def maybe_free_layer(self, req: OutRequest, layer: int) -> None:
        """Return a layer's buffer once no chunk of it can be needed again (all acked, or the
        request ended) and no sendmsg is still reading from it."""
        base = req.layer_slot[layer]
        if base is None or req.inflight[layer]:
            return
        if req.mode == "rdma":
            rdma = req.peer.rdma
            ended = req.state in ("complete", "failed")
            if not ended and layer not in req.rdma_done:
                return
            if rdma is not None and rdma.layer_busy(req.rid, layer):
                req.rdma_free_wait.add(layer)  # the NIC still reads it: after completions
                return
            req.rdma_free_wait.discard(layer)
            req.layer_slot[layer] = None
            self.pool.free(base)
            self.metrics.pool_used.set(self.pool.allocator.used_bytes)
            return
        if req.state in ("complete", "failed") or req.tracker.layer_acked(layer):
            req.layer_slot[layer] = None
            self.pool.free(base)
            self.metrics.pool_used.set(self.pool.allocator.used_bytes)

    def fail(self, rid: str, code: str, message: str, *, notify: bool = True) -> None:
        req = self.requests.get(rid)
        if req is None or req.state in ("complete", "failed"):
            return
        req.state = "failed"
        req.error_code = code
        req.error = message
        req.done.set()
        if req.mode == "rdma" and req.peer.rdma is not None:
            # no more WRITEs for it; the CANCEL (which lets the receiver reuse the buffer)
            # goes out from _finish once the ones in flight have completed
            req.peer.rdma.stop(rid)
        elif notify or req.granted:
            # granted but sent by TCP: the receiver holds its buffer for RDMA safety until a
            # CANCEL says no WRITE is coming, even when it is the receiver that failed it
            self._tell_peer(req.peer, Cancel(rid, message[:200]))

    def _complete(self, req: OutRequest) -> None:
        """Every chunk acked (so verified at the receiver) and every layer handed over."""
        req.state = "complete"
        req.t_done = trio.current_time()
        req.done.set()

    def _tell_peer(self, peer: PeerLink, ev: Any) -> None:
        """Send a notice (CANCEL, END) on any live connection, in the background; best effort,
        since the protocol never depends on it arriving."""
        slot = peer.live[0] if peer.live else None
        if slot is not None and slot.wire is not None and self._nursery is not None:
            self._notifying += 1  # counted from now: a shutdown waits for it to go out
            self._nursery.start_soon(self._notify, slot.wire, ev)

    async def _notify(self, wire: WireConn, ev: Any) -> None:
        try:
            await wire.send_quietly(ev, timeout=2.0)
        finally:
            self._notifying -= 1

    # --- requests -------------------------------------------------------------------------

    def begin(self, msg: BeginRequest, owner: _PrefillEngine | None) -> OutRequest:
        rid = msg.rid
        sizes = list(msg.layer_sizes)
        if rid in self.requests:
            raise RequestFailed("DUPLICATE_REQUEST", f"request {rid} is already in flight")
        if len(sizes) > self.limits.max_layers:
            raise RequestFailed(
                "LIMIT", f"{len(sizes)} layers exceed the limit of {self.limits.max_layers}"
            )
        total = sum(sizes)
        if not 0 < total <= self.limits.max_request_bytes:
            raise RequestFailed(
                "LIMIT", f"request of {total} bytes outside 1..{self.limits.max_request_bytes}"
            )
        biggest = max(sizes)
        if not self.pool.allocator.fits_ever(biggest):
            raise RequestFailed(
                "NO_SPACE",
                f"a layer of {biggest} bytes can never fit the send pool of "
                f"{self.pool.allocator.capacity} bytes",
            )
        if self.draining:
            raise RequestFailed("SHUTTING_DOWN", "the sender is shutting down; send it elsewhere")
        if len(self.requests) >= self.limits.max_concurrent_transfers:
            raise RequestFailed("TOO_BUSY", "too many concurrent transfers")
        if len(msg.block_hashes) > self.limits.max_block_hashes:
            raise RequestFailed(
                "LIMIT",
                f"{len(msg.block_hashes)} block hashes exceed the limit of "
                f"{self.limits.max_block_hashes}",
            )
        deadline_s = msg.deadline_s or self.sc.transfer_deadline_s
        begin = Begin(
            rid,
            tuple(sizes),
            self.sc.chunk_bytes,
            msg.block_hashes,
            msg.cached_blocks,
            max(1, int(deadline_s * 1000)),
            msg.layout,
        )
        peer = self.peer(msg.peer)
        now = trio.current_time()
        req = OutRequest(
            begin=begin,
            tracker=SendTracker(rid, sizes, self.sc.chunk_bytes),
            peer=peer,
            owner=owner,
            t_begin=now,
            deadline=now + deadline_s,
            layer_slot=[None] * len(sizes),
            handed=[False] * len(sizes),
            ready_upto=[0] * len(sizes),
            queued_upto=[0] * len(sizes),
            inflight=[0] * len(sizes),
        )
        self.requests[rid] = req
        assert self._nursery is not None
        self._nursery.start_soon(self._run_request, req)
        return req

    async def _run_request(self, req: OutRequest) -> None:
        try:
            with trio.move_on_at(req.deadline):
                while req.state == "pending":
                    slot = await req.peer.wait_live()
                    wire = slot.wire
                    if wire is None:
                        continue
                    req.retry_begin = trio.Event()
                    # a grant is only good with the ACCEPT of its own session
                    req.grant, req.granted = None, False
                    slot.pending_begins.add(req.rid)
                    try:
                        await wire.send(req.begin)
                    except (PeerClosed, trio.ClosedResourceError):
                        await trio.sleep(0)
                        continue
                    async with trio.open_nursery() as n:
                        n.start_soon(_wait_then_cancel, req.accepted, n.cancel_scope)
                        n.start_soon(_wait_then_cancel, req.retry_begin, n.cancel_scope)
                        n.start_soon(_wait_then_cancel, req.done, n.cancel_scope)
                await req.done.wait()
            if req.state not in ("complete", "failed"):
                self.fail(
                    req.rid,
                    "DEADLINE",
                    f"not delivered within {req.begin.deadline_ms / 1000:.1f}s "
                    f"({req.tracker.acked_bytes}/{req.begin.total_bytes} bytes acked; "
                    f"peer {req.peer.name}: {len(req.peer.live)} live connections)",
                )
        finally:
            await self._finish(req)

    async def _finish(self, req: OutRequest) -> None:
        if req.state not in ("complete", "failed"):  # cancelled from outside (shutdown)
            req.state = "failed"
            req.error_code, req.error = "SHUTDOWN", "sender shutting down"
        rdma = req.peer.rdma
        if req.mode == "rdma" and rdma is not None:
            rdma.stop(req.rid)
            with trio.move_on_after(self.cfg.rdma.stall_timeout_s) as scope:
                scope.shield = True  # a buffer must not be freed under a WRITE
                await rdma.drained(req.rid)
            if scope.cancelled_caught:
                rdma.close_on_peer(f"writes of {req.rid} did not complete")
                with trio.move_on_after(2.0) as scope2:
                    scope2.shield = True
                    await rdma.drained(req.rid)
            if req.state == "failed":
                self._tell_peer(req.peer, Cancel(req.rid, req.error[:200] or "failed"))
        for layer in range(len(req.layer_slot)):
            self.maybe_free_layer(req, layer)
        self.requests.pop(req.rid, None)
        self.ended[req.rid] = (
            ("COMPLETE", "") if req.state == "complete" else (req.error_code, req.error)
        )
        while len(self.ended) > 4096:
            self.ended.popitem(last=False)
        self.metrics.pool_used.set(self.pool.allocator.used_bytes)
        ok = req.state == "complete"
        self.metrics.requests.labels("complete" if ok else "failed").inc()
        if ok:
            self.completed += 1
            self.metrics.transfer_seconds.observe(req.t_done - req.t_begin)
            if req.t_last_handed:
                self.metrics.tail_seconds.observe(req.t_done - req.t_last_handed)
            log.info(
                "request %s delivered: %d bytes in %.3fs, tail %.1f ms, %d resent",
                req.rid,
                req.begin.total_bytes,
                req.t_done - req.t_begin,
                (req.t_done - req.t_last_handed) * 1e3,
                req.resent,
            )
        else:
            self.failed += 1
            log.warning("request %s failed: %s: %s", req.rid, req.error_code, req.error)
        outcome = Outcome(
            rid=req.rid,
            ok=ok,
            code=req.error_code,
            error=req.error,
            bytes=req.begin.total_bytes,
            elapsed_s=(req.t_done or trio.current_time()) - req.t_begin,
            tail_s=(req.t_done - req.t_last_handed) if ok and req.t_last_handed else None,
            resent_chunks=req.resent,
        )
        if req.owner is not None:
            with trio.move_on_after(1.0) as scope:
                scope.shield = True
                await req.owner.push(outcome_event(outcome))

    async def alloc_layer(self, rid: str, layer: int) -> int:
        req = self._live_request(rid)
        if not 0 <= layer < len(req.handed):
            raise RequestFailed("BAD_REQUEST", f"request {rid} has no layer {layer}")
        if req.layer_slot[layer] is not None or req.handed[layer]:
            raise RequestFailed("BAD_REQUEST", f"layer {layer} of {rid} was already allocated")
        size = req.begin.layer_sizes[layer]
        try:
            timeout = max(0.0, req.deadline - trio.current_time())
            off = await self.pool.alloc(max(1, size), timeout=timeout)
        except PoolTooSmall as e:
            raise RequestFailed("NO_SPACE", str(e)) from None
        except trio.TooSlowError:
            raise RequestFailed("DEADLINE", "send pool stayed full until the deadline") from None
        if req.state in ("complete", "failed"):
            self.pool.free(off)
            raise RequestFailed(req.error_code or "FAILED", req.error or "request ended")
        req.layer_slot[layer] = off
        self.metrics.pool_used.set(self.pool.allocator.used_bytes)
        return off

    def try_alloc_layer(self, rid: str, layer: int) -> int | None:
        """Allocate without waiting; None if the pool is short or the layer is not pending."""
        req = self.requests.get(rid)
        if (
            req is None
            or req.state in ("complete", "failed")
            or not 0 <= layer < len(req.handed)
            or req.layer_slot[layer] is not None
            or req.handed[layer]
        ):
            return None
        off = self.pool.allocator.try_alloc(max(1, req.begin.layer_sizes[layer]))
        if off is not None:
            req.layer_slot[layer] = off
            self.metrics.pool_used.set(self.pool.allocator.used_bytes)
        return off

    def layer_ready(self, rid: str, layer: int, upto: int | None = None) -> None:
        """Bytes [0, upto) of the layer are final (None: all of it, the hand-over is done)."""
        req = self._live_request(rid)
        if not 0 <= layer < len(req.handed) or req.handed[layer]:
            raise RequestFailed("BAD_REQUEST", f"layer {layer} of {rid} is not awaiting hand-over")
        if req.layer_slot[layer] is None and req.begin.layer_sizes[layer] > 0:
            raise RequestFailed("BAD_REQUEST", f"layer {layer} of {rid} has no buffer (call alloc)")
        size = req.begin.layer_sizes[layer]
        upto = size if upto is None else upto
        if not req.ready_upto[layer] <= upto <= size:
            raise RequestFailed(
                "BAD_REQUEST",
                f"layer {layer} of {rid}: upto {upto} outside {req.ready_upto[layer]}..{size}",
            )
        req.ready_upto[layer] = upto
        req.handed[layer] = upto == size
        if req.state == "sending":
            self._enqueue_layer(req, layer)
        if not req.handed[layer]:
            return
        if all(req.handed):
            req.t_last_handed = trio.current_time()
            self._tell_peer(req.peer, End(rid))
            if req.state == "sending" and req.tracker.all_acked:
                self._complete(req)

    def _live_request(self, rid: str) -> OutRequest:
        req = self.requests.get(rid)
        if req is None:
            if rid in self.ended:
                code, why = self.ended[rid]
                raise RequestFailed(code, why or "request already finished")
            raise RequestFailed("UNKNOWN_REQUEST", f"no request {rid!r} in flight")
        if req.state == "failed":
            raise RequestFailed(req.error_code, req.error)
        return req

    # --- engine control -------------------------------------------------------------------

    async def _serve_engine(self, stream: trio.SocketStream) -> None:
        chan = TrioChannel(stream)
        await serve_engine(chan, SENDER_OPS, _PrefillEngine(self, chan), "prefill")

    def status(self) -> dict[str, Any]:
        a = self.pool.allocator
        return {
            "node": self.cfg.node.id,
            "session": self.session,
            "tls": "mutual" if self.tls else "off",
            "peers": {
                p.name: {
                    "live_connections": len(p.live),
                    "queued_chunks": len(p.queue),
                    "unacked_chunks": sum(len(s.unacked) for s in p.slots),
                    "connects": sum(s.connects for s in p.slots),
                    "pacing_bps": p.pacing_bps,
                    "link": p.monitor.status(),
                    "rdma": p.rdma.status()
                    if p.rdma is not None
                    else {"backend": "tcp", "reason": "rdma disabled in local config"},
                }
                for p in self.peers.values()
            },
            "requests": {rid: r.state for rid, r in self.requests.items()},
            # the default peer's link state, for `xdc monitor`
            "link": self.peer(None).monitor.status() if self._nursery is not None else {},
            "completed": self.completed,
            "failed": self.failed,
            "pool": {"capacity": a.capacity, "used": a.used_bytes, "allocations": a.allocations},
            "time": time.time(),
        }


class _PrefillEngine:
    """One prefill engine's connection: the requests it began are failed if it vanishes
    before handing all their layers over (it never could any more)."""

    def __init__(self, sender: Sender, chan: TrioChannel) -> None:
        self.sender = sender
        self.chan = chan
        self.mine: list[OutRequest] = []

    async def push(self, frame: bytes) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.chan.send(frame)

    async def handle(self, request: Request) -> dict[str, Any]:
        sender = self.sender
        if isinstance(request, EngineHello):
            return {
                "shm": sender.pool.name,
                "size": sender.pool.segment.size,
                "chunk_bytes": sender.sc.chunk_bytes,
            }
        if isinstance(request, BeginRequest):
            req = sender.begin(request, self)
            self.mine = [r for r in self.mine if r.state in ("pending", "sending")] + [req]
            return {"rid": req.rid}
        if isinstance(request, Alloc):
            # the first layer is waited for (backpressure); the rest, a look-ahead that
            # saves the engine round trips, are taken only if they fit right now
            first, *ahead = request.layers
            offsets = {first: await sender.alloc_layer(request.rid, first)}
            for extra in ahead:
                off = sender.try_alloc_layer(request.rid, extra)
                if off is None:
                    break
                offsets[extra] = off
            return {"offset": offsets[first], "offsets": list(offsets.items())}
        if isinstance(request, Ready):
            sender.layer_ready(request.rid, request.layer, request.upto)
            return {}
        if isinstance(request, CancelRequest):
            ours = sender.requests.get(request.rid)
            if ours is not None and ours.owner is not self:
                raise RequestFailed("NOT_OWNER", f"request {request.rid} is another engine's")
            sender.fail(request.rid, "CANCELLED", request.reason or "cancelled by the engine")
            return {}
        if isinstance(request, Status):
            return sender.status()
        raise RequestFailed("BAD_OP", f"{type(request).__name__} is not served here")

    def closed(self) -> None:
        # an engine that vanished can never hand over its missing layers
        for req in self.mine:
            if req.state in ("pending", "sending") and not all(req.handed):
                self.sender.fail(req.rid, "ENGINE_GONE", "prefill engine disconnected mid-request")
            req.owner = None


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


__all__ = ["ConnSlot", "OutRequest", "PeerLink", "RequestFailed", "Sender", "Work"]
