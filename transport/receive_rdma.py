"""The receiver's RDMA sessions (same-domain senders only): a sender's queue-pair offer is
answered, its WRITEs' completions are read as the TCP path would read landed chunks (same
tracker, same book), and a pair that fails or is closed is destroyed before what it held is
freed; requests in flight go on over TCP. A mixin of ``receiver.Receiver``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import trio
from xdc.transport.daemon_metrics import ReceiverMetrics
from xdc.transport.pool import BufferPool
from xdc.transport.rdma.peer_receiver import SessionRdma, answer_offer
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.waits import WaitIndex
from xdc.transport.wire import WireConn

from xdc.config import Config
from xdc.protocol import (
    ChunkOutcome,
    Complete,
    Error,
    Event,
    Hello,
    LayerDone,
    Nack,
    RdmaClose,
    RdmaOffer,
)
from xdc.protocol.books.receive import ChunkVerdict, Effect, ReceiveBook, Send

log = logging.getLogger("xdc.receiver")


class RdmaSessions:
    """Each sender session's queue pair, by session (a mixin of ``receiver.Receiver``)."""

    if TYPE_CHECKING:  # the daemon's, read here
        cfg: Config
        book: ReceiveBook
        pool: BufferPool
        waits: WaitIndex
        metrics: ReceiverMetrics
        counts: dict[str, int]
        _nursery: trio.Nursery

        def _apply(self, effects: Iterable[Effect], via: WireConn | None = None) -> None: ...
        def _reply_wire(self, session: str, rid: str | None) -> WireConn | None: ...
        def _session_wire(self, session: str) -> WireConn | None: ...
        def _send_soon(self, frames: list[tuple[WireConn, Event]]) -> None: ...
        async def _notify(self, wire: WireConn, ev: Event) -> bool: ...

    def _init_rdma(self, deps: RdmaDeps | None) -> None:
        self.rdma: dict[str, SessionRdma] = {}  # sender session -> its queue pair
        self.rdma_deps = deps or RdmaDeps()  # verbs and device probe: injectable for tests

    def _release_rdma_slot(self, rid: str) -> None:
        req = self.book.get(rid)
        session = req.session if req is not None else None
        for sess in self.rdma.values():
            if rid in sess.slots and (session is None or sess.session == session):
                sess.release(rid)

    async def _on_rdma_offer(self, wire: WireConn, hello: Hello, offer: RdmaOffer) -> None:
        if hello.session in self.rdma:  # a renewed offer replaces the old queue pair
            self._close_rdma(hello.session, "sender offered again", tell=False)
        sess, answer = answer_offer(
            self.cfg.rdma,
            offer,
            hello.session,
            hello.peer_id,
            self.pool.view,
            self.pool.name,
            self.rdma_deps.verbs,
            self.rdma_deps.devices,
        )
        if sess is not None:
            self.rdma[hello.session] = sess
            self._nursery.start_soon(self._run_rdma, sess)
        await wire.send(answer)

    async def _run_rdma(self, sess: SessionRdma) -> None:
        with sess.scope:
            failure = await sess.run(lambda ev: self._on_rdma_event(sess, ev))
            if failure is not None and self.rdma.get(sess.session) is sess:
                log.warning("rdma from %s failed (%s); on tcp", sess.peer_id, failure)
                self._close_rdma(sess.session, failure, tell=True)

    async def _on_rdma_event(self, sess: SessionRdma, ev: Any) -> None:
        """What a landed WRITE means, as the TCP path would have decided it (same tracker,
        same book)."""
        rid = getattr(ev, "rid", None)
        verdict, req = self.book.chunk_verdict(sess.session, rid) if rid else (None, None)
        if verdict is not ChunkVerdict.LAND or req is None or req.tracker is None:
            if isinstance(ev, Error):
                log.warning("rdma from %s: %s", sess.peer_id, ev.message)
            return  # a write for a request that ended (quarantined): nothing to report
        wire = self._reply_wire(sess.session, rid)
        now = trio.current_time()
        if isinstance(ev, LayerDone):
            size = req.begin.layer_sizes[ev.layer]
            sess.bytes_landed += size
            sess.chunks_landed += len(req.tracker.grid.layer_indices(ev.layer))
            self.metrics.bytes_received.inc(size)
            effects = self.book.chunk_done(req, ChunkOutcome(True, ev.layer, False, False), now)
        elif isinstance(ev, Complete):
            effects = self.book.chunk_done(req, ChunkOutcome(True, None, True, False), now)
        elif isinstance(ev, Nack):
            req.chunks_rejected += 1
            self.counts["checksum_failures"] += 1
            self.metrics.checksum_failures.inc()
            log.warning(
                "rdma: %s layer %d offset %d failed its sample check", ev.rid, ev.layer, ev.offset
            )
            if wire is not None:
                await self._notify(wire, ev)
            return
        else:
            return
        for e in effects:
            if isinstance(e, Send):
                target = wire or self._session_wire(sess.session)
                if target is not None:
                    await self._notify(target, e.event)
        self._apply([e for e in effects if not isinstance(e, Send)])
        self.waits.wake([req.rid])

    def _close_rdma(self, session: str, reason: str, *, tell: bool) -> None:
        """Destroy the session's queue pair (no write can land after this), then free what
        was held for it. Requests in flight continue over TCP: their trackers are unchanged."""
        sess = self.rdma.pop(session, None)
        if sess is None:
            return
        log.info("rdma session of %s closed: %s", sess.peer_id, reason)
        granted = list(sess.slots)
        try:
            sess.close()
        except Exception as exc:
            log.warning("rdma teardown: %s", exc)
        self._apply(self.book.rdma_gone(granted))
        if tell and sess.qp_num:
            wire = self._session_wire(session)
            if wire is not None:
                self._send_soon([(wire, RdmaClose(sess.qp_num, reason))])
