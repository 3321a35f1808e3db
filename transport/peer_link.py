"""A sender's link to one receiver: N parallel TCP connections, the striping queue they
pull chunks from, reconnects, keepalives, pacing, the congestion monitor and (when selected)
the RDMA link that rides on them.

Striping is pull-based: every connection's writer takes the next chunk from one shared queue,
so a fast connection carries more and a stalled one carries nothing new. A chunk stays owned
by the connection that sent it until the receiver ACKs it (which it does only after checking
the checksum); a connection that dies or goes idle hands its unacked chunks back to the front
of the queue for the others. What the frames mean for a request is the sender's business
(``Sender.on_*``); this module only moves them.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import logging
import secrets
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Collection
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import trio
from xdc.monitor.link_metrics import LinkMetrics
from xdc.transport.data_workers import DataWorkers, WorkerLost
from xdc.transport.linkmon import PeerMonitor
from xdc.transport.rdma.peer_sender import PeerRdma
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.tls import TlsPolicy, TlsRefused, classify, client_handshake
from xdc.transport.wire import Digest, PeerClosed, WireConn, tune_socket

from xdc.config import Config, DataThreads
from xdc.errors import ErrorCode, ResultCode
from xdc.protocol import (
    Accept,
    Cancel,
    ChunkHeader,
    Complete,
    Error,
    Grant,
    Hello,
    LayerDone,
    Nack,
    Ping,
    Pong,
    ProtocolError,
    RdmaAnswer,
    RdmaClose,
    chunk_checksum,
)
from xdc.protocol import Ack as AckEv
from xdc.protocol import Event as WireEvent
from xdc.protocol.engine_control import wire_result
from xdc.protocol.wire.events import PROTOCOL_VERSION
from xdc.protocol.wire.limits import Limits

log = logging.getLogger("xdc.sender")

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
UNREACHABLE_AFTER_S = 1.0  # a peer with no connection this long, after a failed try, is dark
MAX_REOFFER_S = 600.0  # longest wait before RDMA is offered again after link failures


@dataclass(frozen=True, slots=True)
class Work:
    rid: str
    layer: int
    offset: int
    length: int
    busy_nacks: int = 0  # sends of this chunk the receiver declined as busy (NACK retry_after)
    # sent before (this is a resend): its CHUNK header says so (``ChunkHeader.copy``)
    copy: bool = False
    # the connections (slot numbers) this chunk was in flight on when they were lost
    lost_on: frozenset[int] = frozenset()


LOST_ON_SCAN = 64  # queued chunks a writer looks through for one not lost on its connection


def pick_for(queue: deque[Work], index: int, live: Collection[int]) -> int | None:
    """Which queued chunk connection ``index`` sends next (its place in ``queue``; None:
    none for it now). A chunk lost on this connection goes out on another while one of the
    ``live`` connections it was not lost on is up: a connection lost to a stalled path
    comes back on the same path (its slot's address, very likely its route), and a chunk
    resent there stalls again until the idle timeout, as often as it lands there. The
    front chunk otherwise, and a later one only when the front one is not for us."""
    for i in range(min(len(queue), LOST_ON_SCAN)):
        lost = queue[i].lost_on
        if index not in lost or all(n in lost for n in live if n != index):
            return i
    return None


class OpenChunk(NamedTuple):
    """A chunk's bytes, pinned until ``PeerHost.close_chunk`` (``token`` is the host's)."""

    payload: memoryview
    token: Any


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """What every link of one sender is set up with, fixed when the daemon starts."""

    cfg: Config
    session: str  # the sender's, sent in its first link's HELLOs (PeerLink.session)
    limits: Limits
    tls: TlsPolicy | None
    data_threads: DataThreads
    data_workers: DataWorkers | None
    pool_view: memoryview  # for RDMA, which registers the whole pool
    pool_name: str
    rdma_deps: RdmaDeps
    link_metrics: LinkMetrics


class PeerHost(Protocol):
    """The daemon a link works for, as much of it as the link needs: the bytes of the chunks
    it streams, and where what the receiver says about requests goes. The link moves frames;
    what they mean for a request is the host's business (``transport.sender.Sender``)."""

    def open_chunk(self, work: Work) -> OpenChunk | None:
        """The chunk's bytes, pinned against reuse while a send reads them; None when it is
        no longer wanted (its request ended, or the receiver has it)."""
        ...

    def close_chunk(self, work: Work, token: Any) -> None:
        """The send that read an open chunk returned: its buffer may be freed."""
        ...

    def count_send(self, chunks: int) -> None:
        """A connection sent ``chunks`` chunks in one write (one thread hand-off)."""
        ...

    def wants(self, work: Work) -> bool: ...
    def count_resent(self, rid: str) -> None: ...
    def begin_lost(self, rid: str) -> None: ...
    def on_accept(self, rid: str) -> None: ...
    def on_ack(self, ev: AckEv) -> None: ...
    def on_nack(self, ev: Nack, work: Work | None) -> None: ...
    def on_layer_done(self, ev: LayerDone) -> None: ...
    def on_peer_complete(self, ev: Complete) -> None: ...
    def on_grant(self, ev: Grant) -> None: ...
    def on_refused(self, rid: str, code: ResultCode, why: str) -> None:
        """The receiver failed or cancelled the request (no notice goes back)."""
        ...

    def peer_restarted(self, peer: PeerLink, session: str) -> None: ...
    def tell_peer(self, peer: PeerLink, ev: WireEvent) -> None: ...
    def rdma_batch_done(self, peer: PeerLink) -> None: ...
    def rdma_fallback(
        self, rid: str, unconfirmed: list[tuple[int, int, int]], done: set[int]
    ) -> Awaitable[None]: ...
    def connections_changed(self) -> None: ...
    def connection_failed(self, label: str) -> None: ...


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
    """The link to one receiver; ``extra_addresses`` are more addresses of the same receiver
    (its other NICs) the connections are spread over."""

    def __init__(
        self,
        owner: PeerHost,
        settings: PeerSettings,
        host: str,
        port: int,
        *,
        tls_name: str | None = None,
        extra_addresses: tuple[tuple[str, int], ...] = (),
        session: str | None = None,
    ) -> None:
        self.owner = owner
        # what this link's HELLOs say (default: the sender's session)
        self.session = session or settings.session
        self.settings = settings
        self.sc = settings.cfg.sender
        self.host = host
        self.port = port
        # the name the receiver's certificate must carry (None: tls.server_name or the host)
        self.tls_name = tls_name
        self.queue: deque[Work] = deque()
        self._work_ready = trio.Event()
        # chunks the receiver asked to have resent later: (due, seq, work), a heap
        self._deferred: list[tuple[float, int, Work]] = []
        self._deferred_seq = itertools.count()
        self._deferred_changed = trio.Event()
        self._idle_writers = 0  # writers waiting in next_work: fed before any writer batches
        addrs = [(host, port), *extra_addresses]
        self.slots = [ConnSlot(self, i, addrs[i % len(addrs)]) for i in range(self.sc.connections)]
        self.live: list[ConnSlot] = []
        # since when no connection has been up (None: one is), and connects failed since
        self.dark_since: float | None = trio.current_time()
        self.failed_connects = 0
        self._live_changed = trio.Event()
        self.pacing_bps = self.sc.pacing_rate_bps
        self.peer_session: str | None = None
        self._new_session = trio.Event()
        self.rdma: PeerRdma | None = None
        cfg = settings.cfg
        if cfg.rdma.enabled:
            self.rdma = PeerRdma(
                self.name,
                cfg.rdma,
                settings.pool_view,
                settings.pool_name,
                settings.rdma_deps.verbs,
                settings.rdma_deps.devices,
                owner.rdma_fallback,
                lambda: owner.rdma_batch_done(self),
            )
        else:
            log.info("peer %s: using tcp (rdma disabled in local config)", self.name)
        self.monitor = PeerMonitor(
            self.name, cfg, self.live_sockets, self._paced, settings.link_metrics
        )

    def _paced(self, aggregate_bps: int) -> None:
        """The monitor's pacing decision; a configured cap still bounds it."""
        cap = self.sc.pacing_rate_bps
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
            self._wake_writers()

    def defer(self, work: Work, delay_s: float) -> None:
        """Queue ``work`` again (at the front) in ``delay_s``: the receiver declined it for
        now (``Nack.retry_after_ms``). Sending it again at once would cross the link again
        only to be declined again, as long as the receiver stays busy."""
        heapq.heappush(
            self._deferred, (trio.current_time() + delay_s, next(self._deferred_seq), work)
        )
        self._deferred_changed.set()
        self._deferred_changed = trio.Event()

    @property
    def deferred_chunks(self) -> int:
        return len(self._deferred)

    async def _requeue_deferred(self) -> None:
        """Hand deferred chunks back to the writers as they come due (those of an ended
        request are dropped here, as the writers would skip them)."""
        while True:
            changed = self._deferred_changed
            if not self._deferred:
                await changed.wait()
                continue
            with trio.move_on_at(self._deferred[0][0]):
                await changed.wait()  # an earlier one may be deferred meanwhile
            now = trio.current_time()
            due: list[Work] = []
            while self._deferred and self._deferred[0][0] <= now:
                due.append(heapq.heappop(self._deferred)[2])
            due = [w for w in due if self.owner.wants(w)]
            if due:
                self.enqueue(due, front=True)

    def _wake_writers(self) -> None:
        self._work_ready.set()
        self._work_ready = trio.Event()

    async def next_work(self, index: int) -> Work:
        """The next chunk for connection ``index`` (``pick_for``), once there is one."""
        while True:
            if self.queue:
                at = pick_for(self.queue, index, [s.index for s in self.live])
                if at == 0:
                    return self.queue.popleft()
                if at is not None:
                    work = self.queue[at]
                    del self.queue[at]
                    return work
            self._idle_writers += 1
            try:
                await self._work_ready.wait()  # also set when a connection comes or goes
            finally:
                self._idle_writers -= 1

    def more_work(self, index: int) -> list[Work]:
        """Queued chunks a writer that just took one may send with it in one data-thread
        hand-off (``WireConn.send_chunks``): only what idle writers would not take, at most
        ``sender.send_batch_chunks`` in all, so batching never starves a connection and never
        delays a chunk another connection could send now.

        Why: with data threads each send is a thread hand-off (``trio.to_thread``: ~110-140
        us a round trip on the 2-core VM), and py-spy's GIL-holding samples of a threads-on
        transfer put the hand-off first on the sender (``start_thread_soon``, 14%)."""
        take = min(len(self.queue) - self._idle_writers, self.sc.send_batch_chunks - 1)
        out: list[Work] = []
        while len(out) < take and self.queue and index not in self.queue[0].lost_on:
            out.append(self.queue.popleft())
        return out

    async def wait_live(self) -> ConnSlot:
        while not self.live:
            await self._live_changed.wait()
        # spread BEGINs over connections
        return self.live[secrets.randbelow(len(self.live))]

    def unreachable(self, now: float) -> str | None:
        """Why a request for this peer would only wait (None: it may be shipped): no
        connection has been up for ``UNREACHABLE_AFTER_S`` and connecting has failed since.
        A peer just opened, or reconnecting after a blip, is not dark yet."""
        since = self.dark_since
        if self.live or since is None or self.failed_connects == 0:
            return None
        if now - since < UNREACHABLE_AFTER_S:
            return None
        last = next((s.reason for s in self.slots if s.reason), "no connection")
        return f"no connection to {self.name} for {now - since:.1f}s ({last[:120]})"

    def _set_live(self, slot: ConnSlot, live: bool) -> None:
        if live:
            self.live.append(slot)
            self.dark_since = None
            self.failed_connects = 0
        elif slot in self.live:
            self.live.remove(slot)
            if not self.live:
                self.dark_since = trio.current_time()
                if self.rdma is not None and self.rdma.active:
                    # the receiver drops its queue pair with the session's last connection
                    self.rdma.close_on_peer("every data connection to the receiver was lost")
        self._live_changed.set()
        self._live_changed = trio.Event()
        self._wake_writers()  # a chunk one writer passed over may now be its to send
        self.owner.connections_changed()

    # --- connections ----------------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as n:
                for slot in self.slots:
                    n.start_soon(self._slot_loop, slot)
                n.start_soon(self.monitor.run)
                n.start_soon(self._requeue_deferred)
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
            if await rdma.negotiate(slot.wire, session, self.sc.connect_timeout_s):
                t_up = trio.current_time()
                await rdma.run(lambda ev: self.owner.tell_peer(self, ev))
                if trio.current_time() - t_up > MAX_REOFFER_S:
                    failures = 0  # it ran well for long: this failure starts a new count
                reoffering = session
            elif rdma.tried_session is None:  # unanswered: try again after a pause
                await trio.sleep(self.sc.connect_timeout_s)
                continue
            elif reoffering != session:
                continue  # refused on first contact: not until the receiver restarts
            reoffer = self.settings.cfg.rdma.reoffer_s
            if reoffer > 0 and session == self.peer_session:
                failures += 1
                delay = min(reoffer * 2 ** (failures - 1), MAX_REOFFER_S)
                log.info("peer %s: rdma offered again in %.0fs", self.name, delay)
                with trio.move_on_after(delay):
                    await self._new_session.wait()
                if rdma.tried_session == session:
                    rdma.tried_session = None  # same receiver: offer again

    def live_sockets(self) -> list[trio.socket.SocketType]:
        return [s.wire.sock for s in self.live if s.wire is not None and not s.wire.closed]

    async def _slot_loop(self, slot: ConnSlot) -> None:
        sc = self.sc
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
                self.failed_connects += 1
                self.owner.connection_failed(f"tls_{e.reason}")
                await trio.sleep(backoff)
                backoff = min(max(backoff * 2, 0.05), 2.0)
                continue
            except (OSError, PeerClosed, ProtocolError, trio.TooSlowError) as e:
                slot.reason = f"connect: {e}"
                self.failed_connects += 1
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
            self.owner.connection_failed(_reason_label(slot.reason))
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
        sc, settings = self.sc, self.settings
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        try:
            tune_socket(
                sock,
                sndbuf=sc.sndbuf_bytes,
                notsent_lowat=sc.notsent_lowat_bytes,
                congestion=sc.tcp_congestion,
            )
            policy = settings.tls
            with trio.fail_after(sc.connect_timeout_s):
                await sock.connect(slot.address)
                if policy is None:
                    wire = WireConn(
                        sock, "sender", settings.limits, threaded=settings.data_threads.plain
                    )
                else:
                    stream = await client_handshake(sock, policy, self.host, self.tls_name)
                    wire = WireConn(
                        sock,
                        "sender",
                        settings.limits,
                        tls=stream,
                        threaded=settings.data_threads.sealed,
                    )
                try:
                    await wire.send(
                        Hello(
                            PROTOCOL_VERSION,
                            settings.cfg.node.id,
                            "sender",
                            self.session,
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
            self.owner.peer_restarted(self, hello.session)
        if hello.session != self.peer_session:
            self.peer_session = hello.session
            self._new_session.set()
            self._new_session = trio.Event()
        self.apply_pacing_to(sock)
        if settings.data_workers is not None:
            try:
                await wire.take_worker(settings.data_workers, idle_timeout=None)
            except WorkerLost as e:  # no worker left: this connection moves its own bytes
                log.warning("connection %d to %s: no data worker (%s)", slot.index, self.host, e)
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
        owner = self.owner
        lost = frozenset({slot.index})
        items = [
            dataclasses.replace(w, lost_on=w.lost_on | lost, copy=True)
            for w in slot.unacked.values()
            if owner.wants(w)
        ]
        slot.unacked.clear()
        for w in items:
            owner.count_resent(w.rid)
        self.enqueue(items, front=True)
        for rid in slot.pending_begins:
            owner.begin_lost(rid)
        slot.pending_begins.clear()

    async def _writer(self, slot: ConnSlot) -> None:
        wire = slot.wire
        assert wire is not None
        owner = self.owner
        while True:
            work = await self.next_work(slot.index)
            batch = [work, *self.more_work(slot.index)] if wire.threaded or wire.worker else [work]
            opened: list[tuple[Work, OpenChunk]] = []
            try:
                for w in batch:
                    chunk = owner.open_chunk(w)
                    if chunk is not None:
                        opened.append((w, chunk))
                        slot.unacked[(w.rid, w.layer, w.offset)] = w
                if opened:
                    await wire.send_chunks(
                        [(_header(w), c.payload, _digest(wire, w)) for w, c in opened]
                    )
                    owner.count_send(len(opened))
            finally:
                for w, chunk in opened:
                    owner.close_chunk(w, chunk.token)

    async def _reader(self, slot: ConnSlot) -> None:
        wire = slot.wire
        assert wire is not None
        owner = self.owner
        while True:
            ev = await wire.next_event()
            if isinstance(ev, AckEv):
                slot.unacked.pop((ev.rid, ev.layer, ev.offset), None)
                owner.on_ack(ev)
            elif isinstance(ev, Nack):
                owner.on_nack(ev, slot.unacked.pop((ev.rid, ev.layer, ev.offset), None))
            elif isinstance(ev, Accept):
                slot.pending_begins.discard(ev.rid)
                owner.on_accept(ev.rid)
            elif isinstance(ev, Error):
                if ev.rid is None:
                    raise PeerClosed(f"receiver error {ev.code}: {ev.message}")
                owner.on_refused(ev.rid, wire_result(ev.code), f"receiver: {ev.message}")
            elif isinstance(ev, Cancel):
                owner.on_refused(ev.rid, ResultCode.CANCELLED, f"receiver cancelled: {ev.reason}")
            elif isinstance(ev, Ping):
                await wire.send(Pong(ev.nonce))
            elif isinstance(ev, LayerDone):
                owner.on_layer_done(ev)
            elif isinstance(ev, Complete):
                owner.on_peer_complete(ev)
            elif isinstance(ev, Grant):
                owner.on_grant(ev)
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
        idle = self.sc.idle_timeout_s
        interval = min(1.0, idle / 3)
        nonce = 0
        while True:
            await trio.sleep(interval)
            if trio.current_time() - wire.last_rx > idle:
                raise PeerClosed(f"nothing received for {idle}s (blackholed or peer stalled)")
            nonce += 1
            with trio.move_on_after(interval):
                await wire.send(Ping(nonce))


def _reason_label(reason: str) -> str:
    for key in ("idle", "reset", "closed", "protocol", "refused", "connect"):
        if key in reason.lower():
            return key
    return "other"


def _header(work: Work) -> ChunkHeader:
    """A chunk's CHUNK header, its checksum filled in by the send (``_digest``)."""
    return ChunkHeader(work.rid, work.layer, work.offset, work.length, 0, work.copy)


def _digest(wire: WireConn, work: Work) -> Digest:
    """The chunk's checksum function where the connection carries one (``checksummed``)."""
    if not wire.checksummed(work.layer, work.offset):
        return None
    return functools.partial(chunk_checksum, rid=work.rid, layer=work.layer, offset=work.offset)
