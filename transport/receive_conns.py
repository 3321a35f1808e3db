"""The receiver's data connections: what arrives from senders and what goes back to them.

Each accepted socket (TLS handshake, HELLO, then the connection loop) feeds the request
book frames and lands chunk payloads straight into the request's buffer (``recv_into``, in a
data thread when ``receiver.data_threads`` is on; a copy that races another goes through a
scratch buffer); notices to a sender session (ACK, NACK, LAYER_DONE, COMPLETE, ERROR) go out
in order on the connection the request last used, or another of the same session's when that
one died. The request lifecycle (the book, the pool, the engines) is ``receiver.Receiver``'s;
this part only drives it. A mixin of ``Receiver``: its state is the connections' own (set up
by ``_init_connections``) and what it reads of the daemon is declared below.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import trio
from xdc.transport.daemon_metrics import ReceiverMetrics
from xdc.transport.data_workers import DataWorkers, StopFlag, WorkerLost
from xdc.transport.fd_budget import ACCEPT_EXHAUSTED
from xdc.transport.pool import BufferPool
from xdc.transport.rdma.peer_receiver import SessionRdma
from xdc.transport.scratch import ScratchPool
from xdc.transport.tls import RefusalLog, TlsPolicy, TlsRefused, server_handshake_identified
from xdc.transport.waits import WaitIndex
from xdc.transport.wire import PeerClosed, WireConn, tune_socket

from xdc.config import Config, DataThreads, ReceiverConfig
from xdc.errors import ErrorCode
from xdc.protocol import Ack as AckEv
from xdc.protocol import (
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    Disposition,
    End,
    Error,
    Event,
    Hello,
    Keep,
    Limits,
    Nack,
    Ping,
    Pong,
    ProtocolError,
    RdmaClose,
    RdmaOffer,
    chunk_checksum,
)
from xdc.protocol.books.receive import (
    ChunkVerdict,
    Effect,
    ReceiveBook,
    RxRequest,
    RxState,
    Send,
)
from xdc.protocol.books.tracker import ChunkOutcome
from xdc.protocol.wire.events import PROTOCOL_VERSION

log = logging.getLogger("xdc.receiver")

# A scratch buffer is held for about one chunk's read: the sender is asked to wait that long
# before resending a chunk declined for want of one (and doubles it for each further decline)
SCRATCH_BUSY_RETRY_MS = 20


class DataConnections:
    """Sender connections of a receiver daemon (a mixin of ``receiver.Receiver``)."""

    if TYPE_CHECKING:  # the daemon's, read here
        cfg: Config
        rc: ReceiverConfig
        limits: Limits
        tls: TlsPolicy | None
        book: ReceiveBook
        pool: BufferPool
        waits: WaitIndex
        metrics: ReceiverMetrics
        counts: dict[str, int]
        session: str
        data_threads: DataThreads
        data_workers: DataWorkers | None
        rdma: dict[str, SessionRdma]
        _nursery: trio.Nursery
        _sending: int

        _runs: dict[int, Any]

        def _apply(self, effects: Iterable[Effect], via: WireConn | None = None) -> None: ...
        def _stop_runs_soon(self, base: int) -> list[Any]: ...
        def _close_lease(self, base: int) -> None: ...
        async def _runs_ended(self, base: int) -> None: ...
        async def _run(self, wire: WireConn, session: str, first: RxRequest) -> None: ...
        async def _on_rdma_offer(self, wire: WireConn, hello: Hello, offer: RdmaOffer) -> None: ...
        def _close_rdma(self, session: str, reason: str, *, tell: bool) -> None: ...

    def _init_connections(self, max_connections: int, scratch_buffers: int) -> None:
        self.refusals = RefusalLog()
        self.conns: set[WireConn] = set()
        self.session_wires: dict[str, set[WireConn]] = {}
        self.reply_to: dict[str, WireConn] = {}  # rid -> the connection its sender last used
        self.wire_session: dict[WireConn, str] = {}
        # frames queued to go out in the background, per connection: a PONG waits for them,
        # so "my PING was answered" means "everything before it was handled and answered"
        self._queued: Counter[WireConn] = Counter()
        self._queue_empty: dict[WireConn, trio.Event] = {}
        # the COMPLETEs each connection carried lately: sent again on another of the
        # session's connections if it dies (an RDMA request learns of its delivery only so)
        self._completes_on: dict[WireConn, deque[str]] = {}
        self._reads: Counter[int] = Counter()  # buffer offset -> chunk reads landing in it
        # in-place chunk reads under way in data threads, by cell: each one's guard
        self._landing: dict[tuple[str, int, int], threading.Lock] = {}
        # in-place chunk reads under way in data worker processes, by cell: an event set when
        # each ends, and the stop flag that ends it early
        self._landing_w: dict[tuple[str, int, int], tuple[trio.Event, StopFlag | None]] = {}
        self._free_after_read: set[int] = set()
        # (session, the sender's number for the connection) -> the cancel scope of the one
        # connection serving it now
        self._slot_scopes: dict[tuple[str, int], trio.CancelScope] = {}
        self.scratch = ScratchPool(self.limits.max_chunk_bytes, scratch_buffers)
        self._accepting = trio.CancelScope()
        self._accept_stopped = trio.Event()  # the listener is closed: connects are refused
        self._accept_errors = 0
        # data sockets held from accept() to close (TLS handshakes included), and how many
        # the descriptor limit allows while leaving room for engines (set in serve())
        self.data_sockets = 0
        self.max_data_sockets = max_connections

    def _free(self, offset: int) -> None:
        """Give a buffer back, once no chunk read (or run leasing it) is still landing in it."""
        if self._reads[offset]:
            self._free_after_read.add(offset)
            self._stop_runs_soon(offset)
        else:
            self.pool.free(offset)

    def _read_done(self, base: int) -> None:
        """A chunk read (or a run) that could land in the buffer at ``base`` is over."""
        self._reads[base] -= 1
        if not self._reads[base]:
            del self._reads[base]
            if base in self._free_after_read:
                self._free_after_read.discard(base)
                self.pool.free(base)

    async def _accept_loop(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        with self._accepting:
            while True:
                try:
                    sock, addr = await listener.accept()
                except OSError as e:
                    if e.errno not in ACCEPT_EXHAUSTED:
                        raise
                    # Out of file descriptors (or kernel memory): the pending connection stays
                    # in the backlog; serving the ones we have frees descriptors, so wait.
                    self._accept_errors += 1
                    if self._accept_errors in (1, 10, 100) or self._accept_errors % 1000 == 0:
                        log.warning(
                            "cannot accept data connections: %s (%d times); retrying",
                            os.strerror(e.errno or 0),
                            self._accept_errors,
                        )
                    why = errno.errorcode.get(e.errno or 0, "error").lower()
                    self.metrics.rejected_connections.labels(f"accept_{why}").inc()
                    await trio.sleep(0.1)
                    continue
                if self.data_sockets >= self.max_data_sockets:
                    self.metrics.rejected_connections.labels("max_connections").inc()
                    quiet = self.refusals.admit("*", "max_connections", trio.current_time())
                    if quiet is not None:
                        log.warning(
                            "data connection from %s refused: %d connections open "
                            "(receiver.max_connections, or the descriptor limit)%s",
                            addr,
                            self.data_sockets,
                            f" [{quiet} more like it not logged]" if quiet else "",
                        )
                    sock.close()
                    continue
                tune_socket(sock, rcvbuf=self.rc.rcvbuf_bytes)
                self.data_sockets += 1
                nursery.start_soon(self._serve_counted, sock, addr)
        # shutting down: new connections are refused by the kernel from here on
        listener.close()
        log.info("data listener closed: new connections are refused")
        self._accept_stopped.set()

    # --- notices to senders ------------------------------------------------------------

    def _session_wire(self, session: str) -> WireConn | None:
        """Any open data connection of a sender session."""
        return next((w for w in self.session_wires.get(session, ()) if not w.closed), None)

    def _reply_wire(self, session: str, rid: str | None) -> WireConn | None:
        """Where to tell a sender session about a request: the connection it last used, or
        another of that session's when that one died (never another session's)."""
        wire = self.reply_to.get(rid) if rid is not None else None
        if wire is not None and not wire.closed and self.wire_session.get(wire) == session:
            return wire
        return self._session_wire(session)

    def _send_soon(self, frames: list[tuple[WireConn, Event]]) -> None:
        self._sending += 1  # counted from now: a shutdown waits for it to go out
        for wire, _ev in frames:
            self._queued[wire] += 1
        self._nursery.start_soon(self._send_in_order, frames)

    async def _send_in_order(self, frames: list[tuple[WireConn, Event]]) -> None:
        try:
            for wire, ev in frames:
                try:
                    await self._notify(wire, ev)
                finally:
                    self._sent_one(wire)
        finally:
            self._sending -= 1

    async def _notify(self, wire: WireConn, ev: Event) -> bool:
        """Send a notice to a sender session on ``wire``; if that connection fails, on
        another of the same session's (a sender must not miss a COMPLETE, an ERROR or a NACK
        because one of its connections died under it)."""
        session = self.wire_session.get(wire)
        if await self._send_quiet(wire, ev):
            self._sent_notice(wire, ev)
            return True
        for other in list(self.session_wires.get(session or "", ())):
            if other is not wire and not other.closed and await self._send_quiet(other, ev):
                self._sent_notice(other, ev)
                return True
        return False

    def _sent_notice(self, wire: WireConn, ev: Event) -> None:
        if isinstance(ev, Complete):
            self._completes_on.setdefault(wire, deque(maxlen=256)).append(ev.rid)

    def _resend_completes(self, wire: WireConn, session: str) -> None:
        """``wire`` died: what it said COMPLETE for may never have been read."""
        rids = self._completes_on.pop(wire, ())
        frames: list[tuple[WireConn, Event]] = []
        for rid in rids:
            req = self.book.get(rid)
            fin = self.book.finished.get(rid)
            delivered = (
                req is not None
                and req.session == session
                and req.state in (RxState.COMPLETE, RxState.CLAIMED, RxState.DONE)
            ) or (req is None and fin is not None and fin.delivered and fin.session == session)
            other = self._session_wire(session)
            if delivered and other is not None:
                size = req.begin.total_bytes if req is not None else 0
                frames.append((other, Complete(rid, size)))
        if frames:
            self._send_soon(frames)

    def _sent_one(self, wire: WireConn) -> None:
        self._queued[wire] -= 1
        if self._queued[wire] <= 0:
            del self._queued[wire]
            ev = self._queue_empty.pop(wire, None)
            if ev is not None:
                ev.set()

    async def _flushed(self, wire: WireConn) -> None:
        """Until every frame queued for ``wire`` before now has gone out (or failed)."""
        with trio.move_on_after(self.rc.idle_timeout_s):
            while self._queued.get(wire):
                await self._queue_empty.setdefault(wire, trio.Event()).wait()

    async def _send_quiet(self, wire: WireConn, ev: Any) -> bool:
        return await wire.send_quietly(ev, timeout=self.rc.idle_timeout_s)

    # --- one connection ------------------------------------------------------------------

    async def _serve_counted(self, sock: trio.socket.SocketType, addr: Any) -> None:
        """One accepted data socket, counted against the budget until it is closed."""
        try:
            await self._serve_conn(sock, addr)
        finally:
            sock.close()
            self.data_sockets -= 1

    async def _serve_conn(self, sock: trio.socket.SocketType, addr: Any) -> None:
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        if self.tls is not None:
            try:
                with trio.fail_after(self.rc.handshake_timeout_s):
                    stream, identity = await server_handshake_identified(sock, self.tls)
            except (TlsRefused, trio.TooSlowError) as e:
                refused = (
                    e
                    if isinstance(e, TlsRefused)
                    else TlsRefused(
                        "timeout", f"no TLS handshake within {self.rc.handshake_timeout_s}s"
                    )
                )
                host = addr[0] if isinstance(addr, tuple) else where
                quiet = self.refusals.admit(host, refused.reason, trio.current_time())
                if quiet is not None:
                    log.warning(
                        "connection from %s refused at the TLS handshake (%s): %s%s",
                        where,
                        refused.reason,
                        refused.detail,
                        f" [{quiet} more like it not logged]" if quiet else "",
                    )
                self.metrics.rejected_connections.labels(f"tls_{refused.reason}").inc()
                sock.close()
                return
            wire = WireConn(
                sock, "receiver", self.limits, tls=stream, threaded=self.data_threads.sealed
            )
        else:
            wire = WireConn(sock, "receiver", self.limits, threaded=self.data_threads.plain)
            identity = f"address {addr[0]}" if isinstance(addr, tuple) else f"address {where}"
        self.conns.add(wire)
        self.metrics.connections.inc()
        session = ""
        slot: tuple[str, int] | None = None
        scope = trio.CancelScope()
        try:
            with trio.fail_after(self.rc.handshake_timeout_s):
                hello = await wire.next_event()
            if not isinstance(hello, Hello):  # the state machine already enforces this
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "expected HELLO")
            taken = self.book.connection_up(hello.session, identity)
            if taken:
                raise ProtocolError(ErrorCode.SESSION_OWNER, taken)
            session = hello.session  # counted up: the finally below counts it down
            slot = (session, hello.conn_index)
            self._supersede(slot, where)
            self._slot_scopes[slot] = scope
            with scope:  # cancelled when the sender opens this connection anew
                await wire.send(
                    Hello(PROTOCOL_VERSION, self.cfg.node.id, "receiver", self.session, 0)
                )
                log.info(
                    "data connection %s from %s (peer %s session %s)",
                    hello.conn_index,
                    where,
                    hello.peer_id,
                    hello.session,
                )
                # from here on a sender that falls silent (it PINGs when idle) is dropped
                wire.idle_timeout = self.rc.idle_timeout_s
                if self.data_workers is not None:
                    try:
                        await wire.take_worker(self.data_workers, self.rc.idle_timeout_s)
                    except WorkerLost as e:  # no worker left: this connection reads its own bytes
                        log.warning("connection from %s: no data worker (%s)", where, e)
                self.wire_session[wire] = session
                self.session_wires.setdefault(session, set()).add(wire)
                await self._conn_loop(wire, hello)
        except trio.TooSlowError:
            log.warning(
                "connection from %s: no handshake within %ss", where, self.rc.handshake_timeout_s
            )
            self.metrics.rejected_connections.labels("handshake_timeout").inc()
        except ProtocolError as e:
            log.warning("connection from %s: protocol error %s: %s", where, e.code.name, e.message)
            self.metrics.rejected_connections.labels(e.code.name.lower()).inc()
            await wire.send_error_and_close(e.code, e.message)
        except PeerClosed as e:
            log.info("connection from %s closed: %s", where, e)
        finally:
            wire.close()
            self.conns.discard(wire)
            self.wire_session.pop(wire, None)
            if slot is not None and self._slot_scopes.get(slot) is scope:
                del self._slot_scopes[slot]
            self.metrics.connections.dec()
            if session:
                self.book.connection_down(session, trio.current_time())
                wires = self.session_wires.get(session, set())
                wires.discard(wire)
                self._resend_completes(wire, session)
                if not wires:
                    self.session_wires.pop(session, None)
                    if session in self.rdma:
                        self._close_rdma(session, "sender's connections are gone", tell=False)

    def _supersede(self, slot: tuple[str, int], where: str) -> None:
        """A sender opens its connection number ``n`` again only after it gave the previous
        one up (its idle timeout, a failed send), so an older connection of the same session
        and number still open here is dead to the sender: close it now. Otherwise it lives
        on for as long as a middlebox or a slow path still trickles the bytes the sender
        wrote before it gave up (minutes at a few KB/s): an in-place read that holds its
        chunk's cell, or a resend's read that holds a scratch buffer, which is how the
        resends of one stuck chunk once took every scratch buffer and every later copy of
        it was declined as busy until the deadline."""
        old = self._slot_scopes.pop(slot, None)
        if old is None:
            return
        old.cancel()
        self.counts["superseded_connections"] += 1
        self.metrics.superseded_connections.inc()
        log.info(
            "connection %d of session %s opened again from %s: the older one is closed",
            slot[1],
            slot[0],
            where,
        )

    async def _conn_loop(self, wire: WireConn, hello: Hello) -> None:
        session = hello.session
        while True:
            ev = await wire.next_event()
            if isinstance(ev, ChunkHeader):
                await self._on_chunk(wire, session, ev)
            elif isinstance(ev, Begin):
                self._on_begin(wire, hello, ev)
            elif isinstance(ev, Ping):
                await self._flushed(wire)
                await wire.send(Pong(ev.nonce))
            elif isinstance(ev, Cancel):
                self._on_cancel(session, ev)
            elif isinstance(ev, RdmaOffer):
                await self._on_rdma_offer(wire, hello, ev)
            elif isinstance(ev, RdmaClose):
                sess = self.rdma.get(session)
                if sess is not None and sess.remote_qp_num == ev.qp_num:
                    log.warning("sender %s closed rdma: %s; on tcp", hello.peer_id, ev.reason)
                    self._close_rdma(session, f"sender closed it: {ev.reason}", tell=False)
                else:  # late, for a pair already replaced: keep the current one
                    log.info(
                        "sender %s: RDMA_CLOSE for queue pair %#x ignored", hello.peer_id, ev.qp_num
                    )
            elif isinstance(ev, (End, Keep)):  # completion is decided by verified bytes alone
                self.book.kept(hello.session, ev.rid, trio.current_time())
            elif isinstance(ev, Error):
                log.warning("sender reported error %s: %s (rid %s)", ev.code, ev.message, ev.rid)
                if ev.rid is None:
                    return
            # Pong and anything else the state machine allowed: nothing to do

    def _on_begin(self, wire: WireConn, hello: Hello, begin: Begin) -> None:
        effects = self.book.begin(hello.session, begin, trio.current_time())
        req = self.book.get(begin.rid)
        if req is not None and req.session == hello.session:
            self.reply_to[begin.rid] = wire
        self._apply(effects, via=wire)

    def _on_cancel(self, session: str, ev: Cancel) -> None:
        """The sender gave a request up; for an RDMA request its CANCEL comes only after its
        WRITEs drained, so the buffer may be reused at once (the book decides)."""
        req = self.book.get(ev.rid)
        if req is not None and req.session != session:
            log.warning("CANCEL of %s from a session that does not own it: ignored", ev.rid)
        self._apply(self.book.cancel(session, ev.rid, ev.reason, trio.current_time()))

    async def _on_chunk(self, wire: WireConn, session: str, hdr: ChunkHeader) -> None:
        verdict, req = self.book.chunk_verdict(session, hdr.rid)
        if verdict is not ChunkVerdict.LAND or req is None:
            wire.skip_payload()
            if verdict is ChunkVerdict.ACK_DUPLICATE:
                await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
            elif verdict is ChunkVerdict.ENDED:
                fin = self.book.finished.get(hdr.rid)
                why = fin.why if fin is not None else (req.why if req is not None else "")
                why = f"request failed: {why}"
                await wire.send(Error(int(ErrorCode.CANCELLED), why, hdr.rid))
            elif verdict is ChunkVerdict.EARLY:
                self.metrics.protocol_errors.labels("out_of_order").inc()
                why = f"chunk of {hdr.rid} before its ACCEPT"
                await wire.send(Error(int(ErrorCode.OUT_OF_ORDER), why, hdr.rid))
            else:
                self.metrics.protocol_errors.labels("unknown_request").inc()
                await wire.send(
                    Error(int(ErrorCode.UNKNOWN_REQUEST), f"no transfer {hdr.rid!r} here", hdr.rid)
                )
            return
        tracker = req.tracker
        base = req.offset
        assert tracker is not None and base is not None
        # while runs are on, a copy (a resend) never lands in place directly: a run may be
        # writing the same cell unseen by the books (receive_runs)
        in_place = not (hdr.copy is True and self.rc.worker_runs and self.data_workers is not None)
        try:
            rel, disp = tracker.locate(hdr, in_place)
        except ProtocolError as e:
            wire.skip_payload()
            self.metrics.protocol_errors.labels(e.code.name.lower()).inc()
            await wire.send(Error(int(e.code), e.message, hdr.rid))
            return
        if disp is Disposition.IN_PLACE:
            start = base + rel
            await self._land_chunk(
                wire, req, hdr, rel, disp, self.pool.view[start : start + hdr.length]
            )
            if (
                hdr.copy is False
                and self.rc.worker_runs
                and wire.can_run
                and req.state is RxState.RECEIVING
            ):
                await self._run(wire, session, req)
            return
        if tracker.verified(hdr):
            # a copy of bytes already verified: nothing to receive or check, only to ack
            wire.skip_payload()
            self._count_duplicate(req)
            await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
            return
        buf = self.scratch.take()
        if buf is None:
            # racing copies on many connections at once: decline this one, the sender
            # resends it (by then the cell is verified, or a buffer is free)
            wire.skip_payload()
            self.metrics.rejected_chunks.labels("scratch_busy").inc()
            why = "receiver busy: no scratch buffer free"
            await wire.send(Nack(hdr.rid, hdr.layer, hdr.offset, why, SCRATCH_BUSY_RETRY_MS))
            return
        try:
            with memoryview(buf) as view:
                await self._land_chunk(wire, req, hdr, rel, disp, view[: hdr.length])
        finally:
            self.scratch.give(buf)

    async def _land_chunk(
        self,
        wire: WireConn,
        req: RxRequest,
        hdr: ChunkHeader,
        rel: int,
        disp: Disposition,
        dest: memoryview,
    ) -> None:
        """Receive a located chunk's payload into ``dest`` (its place in the pool, or a
        scratch buffer), verify it, and answer."""
        tracker = req.tracker
        base = req.offset
        assert tracker is not None and base is not None
        self._reads[base] += 1
        cell = (hdr.rid, hdr.layer, hdr.offset)
        guard: threading.Lock | None = None
        if disp is Disposition.IN_PLACE and wire.threaded:
            guard = self._landing[cell] = threading.Lock()
        # (under sealed records v2 an unsampled chunk was authenticated by its record's tag)
        checked = wire.checksummed(hdr.layer, hdr.offset)
        placed = None
        ended: trio.Event | None = None
        stop: StopFlag | None = None
        if disp is Disposition.IN_PLACE and wire.worker is not None:
            # a worker process is told by a stop flag, not asked under a lock, that a resend
            # landed first: a copy into place sets the flag and waits for ``ended``
            placed = (cell, hdr.checksum if checked else None)
            ended, stop = trio.Event(), wire.worker.workers.stop_flag()
            self._landing_w[cell] = (ended, stop)
        try:
            # An in-place receive stops writing the moment a resend of the same chunk has been
            # verified (via scratch) and copied into place, so late bytes of the slower copy
            # can never overwrite verified data. A receive in a data thread checks and reads
            # under its cell's guard, which the copy into place holds.
            still_wanted = (
                (lambda: not tracker.superseded(hdr)) if disp is Disposition.IN_PLACE else None
            )
            landed = await wire.read_payload_checked(
                dest,
                lambda d: chunk_checksum(d, *cell) == hdr.checksum if checked else True,
                still_wanted,
                guard,
                placed,
                stop,
            )
        except BaseException:
            tracker.abandon(hdr, disp)
            raise
        finally:
            if guard is not None and self._landing.get(cell) is guard:
                del self._landing[cell]
            if ended is not None:
                ended.set()
                entry = self._landing_w.get(cell)
                if entry is not None and entry[0] is ended:
                    del self._landing_w[cell]
                if stop is not None:
                    stop.release()  # the worker replied: it looks at the flag no more
            self._read_done(base)
        if landed is None:
            tracker.abandon(hdr, disp)
            self._count_duplicate(req)
            return
        ok = landed
        if disp is not Disposition.IN_PLACE and (worker_read := self._landing_w.get(cell)):
            # a verified resend is copied into place only after the slower in-place read of
            # the same cell by a data worker process has ended (its last write came before
            # its reply); told to stop, it ends within a read or sockio.THREAD_POLL_S
            worker_ended, worker_stop = worker_read
            if ok and worker_stop is not None:
                worker_stop.set()
            await worker_ended.wait()
        if disp is not Disposition.IN_PLACE and ok and base in self._runs:
            # nor of any run leasing the request: each is told to end, and has ended
            await self._runs_ended(base)
        if req.state is not RxState.RECEIVING:
            # Ended while this chunk was in flight: a duplicate of a complete request is
            # acked (the sender may have missed the first ack); a failed one stays failed.
            tracker.abandon(hdr, disp)
            if ok and req.state in (RxState.COMPLETE, RxState.CLAIMED, RxState.DONE):
                await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
            return
        # a data thread may still be landing this cell in place: the guard keeps it from
        # writing between the verdict and the copy of the verified bytes into place
        landing = self._landing.get(cell) if disp is not Disposition.IN_PLACE else None
        with landing if landing is not None else contextlib.nullcontext():
            out = tracker.finish(hdr, disp, ok)
            if ok and not out.live_corrupted and out.copy_from_scratch:
                start = base + rel
                self.pool.view[start : start + hdr.length] = dest
        frames: list[Event] = []
        notices: list[Event] = []
        self._answer_finished(wire, req, hdr, out, ok, frames, notices)
        # LAYER_DONE / COMPLETE right behind their ACK, on this wire, in the same write
        await wire.send_events(frames)
        for ev in notices:
            self._sent_notice(wire, ev)

    def _answer_finished(
        self,
        wire: WireConn,
        req: RxRequest,
        hdr: ChunkHeader,
        out: ChunkOutcome,
        ok: bool,
        frames: list[Event],
        notices: list[Event],
    ) -> None:
        """A chunk read to its end (here or by a worker's run) and finished in its tracker:
        counted, and its answer added to ``frames`` (a NACK, or its ACK with any LAYER_DONE /
        COMPLETE behind it; those notices also to ``notices``). Local effects happen now:
        the book already says COMPLETE, and an engine waiting for it must be woken even if
        the send fails (a sender that has read the COMPLETE may close the connection
        before the next frame goes out)."""
        if not ok or out.live_corrupted:
            req.chunks_rejected += 1
            self.counts["checksum_failures"] += 1
            self.metrics.checksum_failures.inc()
            log.warning(
                "checksum mismatch %s layer %d offset %d; asking for a resend",
                hdr.rid,
                hdr.layer,
                hdr.offset,
            )
            frames.append(Nack(hdr.rid, hdr.layer, hdr.offset, "checksum mismatch"))
            return
        fresh = out.newly_verified or out.copy_from_scratch
        if not fresh:
            self._count_duplicate(req)
        self.metrics.bytes_received.inc(hdr.length)
        self.reply_to[hdr.rid] = wire
        ack = AckEv(hdr.rid, hdr.layer, hdr.offset)
        if out.layer_done is None and not out.request_done:
            if fresh:
                self.book.progressed(req, trio.current_time())
            frames.append(ack)
            return
        # a chunk that ends a layer or the request: chunk_done counts its progress too
        if out.request_done and req.offset is not None:
            self._close_lease(req.offset)  # before any engine can be told
        effects = self.book.chunk_done(req, out, trio.current_time())
        self._apply([e for e in effects if not isinstance(e, Send)])
        self.waits.wake([hdr.rid])
        sent = [fx.event for fx in effects if isinstance(fx, Send)]
        frames += [ack, *sent]
        notices += sent

    def _count_duplicate(self, req: RxRequest) -> None:
        req.duplicates += 1
        self.counts["duplicates"] += 1
