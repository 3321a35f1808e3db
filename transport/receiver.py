"""Decode-side daemon: accepts sender connections, lands chunks in shared memory, and hands
complete requests to the decode engine.

Every decision about a request (who owns it, when it is visible, who may read or release it,
when it ends and what its buffer may do then) is made by ``xdc.protocol.books.receive``;
this module is its I/O shell. It feeds the book what happened on sockets, engine calls and
the clock, and carries out the effects the book returns: frames to senders, pool
allocations and frees, wake-ups of waiting engines, logs and metrics. Chunks land with
``recv_into`` straight into the request's buffer (TCP) or by RDMA WRITE (a session's queue
pair); both drive the same per-request ReceiveTracker.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

import trio
from xdc.transport.daemon import claim_socket_and_pool, link_description, pool_hello
from xdc.transport.daemon_metrics import ReceiverMetrics
from xdc.transport.engine_socket import (
    TrioChannel,
    accept_engines,
    engine_uids,
    serve_engine,
)
from xdc.transport.fd_budget import (
    ACCEPT_EXHAUSTED,
    data_connection_budget,
    open_descriptors,
    raise_nofile_limit,
)
from xdc.transport.pool import PoolTooSmall
from xdc.transport.rdma.peer_receiver import SessionRdma, answer_offer
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.scratch import ScratchPool
from xdc.transport.tls import (
    RefusalLog,
    TlsRefused,
    load_policy,
    server_handshake_identified,
)
from xdc.transport.waits import WaitIndex
from xdc.transport.wire import PeerClosed, WireConn, tune_socket

from xdc.config import Config, data_threads_on
from xdc.errors import ErrorCode, ResultCode, StartupError, TransferError
from xdc.protocol import (
    Accept,
    Begin,
    Cancel,
    ChunkHeader,
    ChunkOutcome,
    Complete,
    Disposition,
    End,
    Error,
    Event,
    Grant,
    Hello,
    LayerDone,
    Nack,
    Ping,
    Pong,
    ProtocolError,
    RdmaClose,
    RdmaOffer,
    chunk_checksum,
)
from xdc.protocol import Ack as AckEv
from xdc.protocol.books.receive import (
    ARRIVING,
    WAIT,
    Allocate,
    ChunkVerdict,
    Delivered,
    Effect,
    Failed,
    Free,
    ReceiveBook,
    Refusal,
    Refused,
    ReleaseRdma,
    Requeued,
    RxRequest,
    RxState,
    Send,
)
from xdc.protocol.engine_control import (
    RECEIVER_OPS,
    Await,
    AwaitLayer,
    Discard,
    EngineHello,
    Release,
    Request,
    RequestInfo,
    Status,
    request_info_fields,
)
from xdc.protocol.wire.events import PROTOCOL_VERSION

log = logging.getLogger("xdc.receiver")


class Receiver:
    def __init__(
        self,
        cfg: Config,
        *,
        rdma: RdmaDeps | None = None,
    ) -> None:
        self.cfg = cfg
        self.rc = cfg.receiver
        self.limits = cfg.limits.limits()
        # before any resource is taken: a mutual-TLS config without usable files is fatal
        self.tls = load_policy(cfg.tls, server=True)
        self.refusals = RefusalLog()
        self.engine_uids = engine_uids(cfg.node.allowed_uids)
        self.engine_socket, self.pool = claim_socket_and_pool(
            self.rc.control_socket,
            group=bool(cfg.node.allowed_uids),
            pool_bytes=self.rc.pool_bytes,
            prefix="xdc-rx",
        )
        self.book = ReceiveBook(
            fits=self.pool.allocator.fits_ever,
            max_concurrent=self.limits.max_concurrent_transfers,
            memory=self.rc.completed_memory,
            orphan_grace_s=self.rc.orphan_grace_s,
            unclaimed_ttl_s=self.rc.unclaimed_ttl_s,
            max_deadline_s=self.rc.transfer_deadline_s,
        )
        self.waits = WaitIndex()  # engine calls waiting, by the request ids they name
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
        self.data_threads = data_threads_on(self.rc.data_threads)
        self._free_after_read: set[int] = set()
        self.scratch = ScratchPool(self.limits.max_chunk_bytes, self.rc.scratch_buffers)
        self.metrics = ReceiverMetrics()
        self.port: int = 0
        self.counts = {
            "complete": 0,
            "failed": 0,
            "checksum_failures": 0,
            "duplicates": 0,
            "rdma_quarantined": 0,  # failed requests whose buffer waited for the sender
            "requeued": 0,  # claimed requests given back when their engine left
            "engine_looks": 0,  # times a waiting engine call asked the book again
        }
        self.session = f"rx-{time.time_ns():x}"
        self.draining = False
        self.engines = 0  # open decode-engine connections
        self.awaiting = 0  # engine calls waiting for a request or a layer
        self._sending = 0  # notices to senders still in flight
        self._accepting = trio.CancelScope()
        self._accept_stopped = trio.Event()  # the listener is closed: connects are refused
        self._accept_errors = 0
        # data sockets held from accept() to close (TLS handshakes included), and how many
        # the descriptor limit allows while leaving room for engines (set in serve())
        self.data_sockets = 0
        self.max_data_sockets = self.rc.max_connections
        # RDMA (same-domain peers only): verbs and device probe are injectable for tests
        self.rdma: dict[str, SessionRdma] = {}  # sender session -> its queue pair
        self.rdma_deps = rdma or RdmaDeps()
        self._nursery: trio.Nursery

    @property
    def requests(self) -> dict[str, RxRequest]:
        return self.book.requests

    # --- lifecycle ------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket()
        listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        try:
            await listener.bind((self.rc.listen_host, self.rc.listen_port))
        except OSError as e:
            listener.close()
            self.engine_socket.close()
            self.pool.close()
            where = f"{self.rc.listen_host}:{self.rc.listen_port}"
            raise StartupError(f"cannot listen on {where}: {e.strerror or e}") from None
        listener.listen(256)
        self.port = listener.getsockname()[1]
        soft = raise_nofile_limit()
        self.max_data_sockets = data_connection_budget(
            self.rc.max_connections, soft, open_descriptors()
        )
        if self.max_data_sockets < self.rc.max_connections:
            log.warning(
                "descriptor limit %d: at most %d data connections (receiver.max_connections "
                "is %d); the rest of the limit is kept for engines",
                soft,
                self.max_data_sockets,
                self.rc.max_connections,
            )
        engine_socket = self.engine_socket
        ctl = trio.socket.from_stdlib_socket(engine_socket.sock)
        log.info(
            "receiver %s listening on %s:%d (%s), control %s, pool %d MiB (%s)",
            self.cfg.node.id,
            self.rc.listen_host,
            self.port,
            link_description(bool(self.tls), self.data_threads),
            self.rc.control_socket,
            self.rc.pool_bytes >> 20,
            self.pool.name,
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._accept_loop, listener, nursery)
                nursery.start_soon(
                    accept_engines, ctl, self.engine_uids, "decode", self._serve_engine, nursery
                )
                nursery.start_soon(self._reaper)
                engine_socket.listen()
                task_status.started(self.port)
                await trio.sleep_forever()
        finally:
            listener.close()
            ctl.close()
            for c in list(self.conns):
                c.close()
            for session in list(self.rdma):
                self._close_rdma(session, "receiver stopping", tell=False)
            self.pool.close()
            engine_socket.close()

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

    def _busy(self) -> int:
        """Requests a graceful shutdown waits for: still arriving from a sender that is
        still connected, or complete and not yet taken by a connected decode engine (which
        may be about to read them)."""
        return sum(
            1
            for r in self.book.requests.values()
            if (r.state in ARRIVING and r.session in self.session_wires)
            or (r.state is RxState.COMPLETE and self.engines > 0)
        )

    async def shutdown(self) -> None:
        """SIGTERM: stop accepting data connections and new requests, give in-flight
        transfers ``node.shutdown_drain_s`` to finish, then fail the rest so every sender
        (and through it every prefill engine) gets a definite outcome."""
        self.draining = self.book.draining = True
        self._accepting.cancel()
        with trio.move_on_after(1.0):
            await self._accept_stopped.wait()
        drain = self.cfg.node.shutdown_drain_s
        log.info("draining: %d transfers in flight, up to %.1fs", self._busy(), drain)
        with trio.move_on_after(drain):
            while self._busy():
                await trio.sleep(0.02)
        left = len(self.book.arriving())
        self._apply(
            self.book.fail_arriving(
                ErrorCode.CANCELLED,
                f"receiver shut down before the transfer finished (drain {drain:g}s)",
                trio.current_time(),
            )
        )
        with trio.move_on_after(1.0):
            while self._sending:
                await trio.sleep(0.01)
        log.info(
            "drained: %d transfers failed at the deadline, %d complete but unclaimed",
            left,
            sum(1 for r in self.book.requests.values() if r.state is RxState.COMPLETE),
        )

    # --- effects ----------------------------------------------------------------------------

    def _apply(self, effects: Iterable[Effect], via: WireConn | None = None) -> None:
        """Carry out what the book decided. Frames go out in the background, in order, on
        the request's connection (``via`` when given), else any of its session's."""
        frames: list[tuple[WireConn, Event]] = []
        wake: list[str] = []  # requests whose waiting engine calls should look again
        for e in effects:
            if isinstance(e, Send):
                rid = getattr(e.event, "rid", None)
                ours = via is not None and self.wire_session.get(via) == e.session
                wire = via if ours and via is not None and not via.closed else None
                wire = wire or self._reply_wire(e.session, rid)
                if wire is not None:
                    frames.append((wire, e.event))
            elif isinstance(e, Allocate):
                self._nursery.start_soon(self._allocate, e.rid, e.nbytes)
            elif isinstance(e, Free):
                self.reply_to.pop(e.rid, None)
                self._free(e.offset)
                wake.append(e.rid)
            elif isinstance(e, Delivered):
                self._delivered(e.rid)
                wake.append(e.rid)
            elif isinstance(e, Failed):
                self.reply_to.pop(e.rid, None)
                log.warning("request %s failed: %s: %s", e.rid, e.code.name, e.why)
                self.metrics.requests.labels("failed").inc()
                self.counts["failed"] += 1
                req = self.book.get(e.rid)
                if req is not None and req.rdma_hold:
                    self.counts["rdma_quarantined"] += 1
                wake.append(e.rid)
            elif isinstance(e, Refused):
                log.warning("refusing %s: %s: %s", e.rid, e.code.name, e.why)
                self.metrics.requests.labels("refused").inc()
                wake.append(e.rid)
            elif isinstance(e, Requeued):
                log.info("request %s back in the ready queue: its engine left", e.rid)
                self.counts["requeued"] += 1
                wake.append(e.rid)
            elif isinstance(e, ReleaseRdma):
                self._release_rdma_slot(e.rid)
        if frames:
            self._send_soon(frames)
        if wake:
            self.waits.wake(wake)

    def _free(self, offset: int) -> None:
        """Give a buffer back, once no chunk read is still landing in it."""
        if self._reads[offset]:
            self._free_after_read.add(offset)
        else:
            self.pool.free(offset)

    def _delivered(self, rid: str) -> None:
        req = self.book.get(rid)
        self.metrics.requests.labels("complete").inc()
        self.counts["complete"] += 1
        if req is None:
            return
        self.metrics.transfer_seconds.observe(req.completed_at - req.created)
        log.info(
            "request %s complete: %d bytes in %.3fs (%d rejected chunks, %d duplicates)",
            rid,
            req.begin.total_bytes,
            req.completed_at - req.created,
            req.chunks_rejected,
            req.duplicates,
        )

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

    async def _reaper(self) -> None:
        """The clock: deadlines, orphaned sessions, unclaimed requests, RDMA quarantines."""
        limit = 2 * self.cfg.rdma.stall_timeout_s + self.rc.idle_timeout_s
        while True:
            await trio.sleep(0.1)
            now = trio.current_time()
            self._apply(self.book.tick(now))
            for req in self.book.holding():
                sess = self.rdma.get(req.session)
                if req.rdma_hold and sess is not None and now - req.failed_at > limit:
                    self._close_rdma(
                        req.session, f"no release of {req.rid} within {limit:g}s", tell=True
                    )

    # --- data connections -----------------------------------------------------------------

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
            wire = WireConn(sock, "receiver", self.limits, tls=stream, threaded=self.data_threads)
        else:
            wire = WireConn(sock, "receiver", self.limits, threaded=self.data_threads)
            identity = f"address {addr[0]}" if isinstance(addr, tuple) else f"address {where}"
        self.conns.add(wire)
        self.metrics.connections.inc()
        session = ""
        try:
            with trio.fail_after(self.rc.handshake_timeout_s):
                hello = await wire.next_event()
            if not isinstance(hello, Hello):  # the state machine already enforces this
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "expected HELLO")
            taken = self.book.connection_up(hello.session, identity)
            if taken:
                raise ProtocolError(ErrorCode.SESSION_OWNER, taken)
            session = hello.session  # counted up: the finally below counts it down
            await wire.send(Hello(PROTOCOL_VERSION, self.cfg.node.id, "receiver", self.session, 0))
            log.info(
                "data connection %s from %s (peer %s session %s)",
                hello.conn_index,
                where,
                hello.peer_id,
                hello.session,
            )
            # from here on a sender that falls silent (it PINGs when idle) is dropped
            wire.idle_timeout = self.rc.idle_timeout_s
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
            elif isinstance(ev, End):
                pass  # informational: completion is decided by verified bytes alone
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

    async def _allocate(self, rid: str, nbytes: int) -> None:
        """Wait for pool room (backpressure on the sender), then ACCEPT (GRANT first when
        the session's queue pair can carry it)."""
        req = self.book.get(rid)
        if req is None:
            return
        sess = self.rdma.get(req.session)
        extra = sess.sums_bytes(req.begin) if sess is not None else 0
        if not self.pool.allocator.fits_ever(nbytes + extra):
            sess, extra = None, 0  # fits only without its checksum table: it goes by TCP
        try:
            timeout = max(0.0, req.deadline - trio.current_time())
            offset = await self.pool.alloc(nbytes + extra, timeout=timeout)
        except trio.TooSlowError:
            why = "no room in the receive pool before the deadline"
            self._apply(self.book.alloc_failed(rid, ErrorCode.DEADLINE, why, trio.current_time()))
            return
        except PoolTooSmall as e:
            now = trio.current_time()
            self._apply(self.book.alloc_failed(rid, ErrorCode.NO_SPACE, str(e), now))
            return
        effects = self.book.allocated(rid, offset, req)
        accepted = any(isinstance(e, Send) and isinstance(e.event, Accept) for e in effects)
        grant = None
        still_same_pair = sess is not None and sess is self.rdma.get(req.session)
        if accepted and still_same_pair and req.state is RxState.RECEIVING and req.tracker:
            assert sess is not None
            grant = sess.grant(req.tracker, offset)
            if grant is not None:
                self.book.hold_for_rdma(rid)
        log.debug("accepted %s: %d bytes at %d", rid, nbytes, offset)
        wire = self._reply_wire(req.session, rid)
        if grant is not None and wire is not None:
            # before ACCEPT on the same connection: the sender needs it
            await self._send_quiet(wire, Grant(rid, grant))
        if wire is not None:
            for fx in effects:
                if isinstance(fx, Send) and isinstance(fx.event, Accept):
                    await self._send_quiet(wire, fx.event)
        self._apply(
            [e for e in effects if not (isinstance(e, Send) and isinstance(e.event, Accept))]
        )

    async def _on_chunk(self, wire: WireConn, session: str, hdr: ChunkHeader) -> None:
        verdict, req = self.book.chunk_verdict(session, hdr.rid)
        if verdict is not ChunkVerdict.LAND or req is None:
            wire.skip_payload()
            if verdict is ChunkVerdict.ACK_DUPLICATE:
                await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
            elif verdict is ChunkVerdict.ENDED:
                fin = self.book.finished.get(hdr.rid)
                why = fin.why if fin is not None else (req.why if req is not None else "")
                why = f"request failed: {why}"[:1000]
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
        try:
            rel, disp = tracker.locate(hdr)
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
            await wire.send(Nack(hdr.rid, hdr.layer, hdr.offset, why))
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
            )
        except BaseException:
            tracker.abandon(hdr, disp)
            raise
        finally:
            if guard is not None and self._landing.get(cell) is guard:
                del self._landing[cell]
            self._reads[base] -= 1
            if not self._reads[base]:
                del self._reads[base]
                if base in self._free_after_read:
                    self._free_after_read.discard(base)
                    self.pool.free(base)
        if landed is None:
            tracker.abandon(hdr, disp)
            self._count_duplicate(req)
            return
        ok = landed
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
            await wire.send(Nack(hdr.rid, hdr.layer, hdr.offset, "checksum mismatch"))
            return
        if not out.newly_verified and not out.copy_from_scratch:
            self._count_duplicate(req)
        self.metrics.bytes_received.inc(hdr.length)
        self.reply_to[hdr.rid] = wire
        ack = AckEv(hdr.rid, hdr.layer, hdr.offset)
        if out.layer_done is None and not out.request_done:
            await wire.send(ack)
            return
        effects = self.book.chunk_done(req, out, trio.current_time())
        # Local effects first: the book already says COMPLETE, and an engine waiting for it
        # must be woken even if the send below fails (a sender that has read the COMPLETE may
        # close this connection before the next frame goes out).
        self._apply([e for e in effects if not isinstance(e, Send)])
        self.waits.wake([hdr.rid])
        # LAYER_DONE / COMPLETE right behind their ACK, on this wire, in the same write
        notices = [fx.event for fx in effects if isinstance(fx, Send)]
        await wire.send_events([ack, *notices])
        for ev in notices:
            self._sent_notice(wire, ev)

    def _count_duplicate(self, req: RxRequest) -> None:
        req.duplicates += 1
        self.counts["duplicates"] += 1

    # --- RDMA ---------------------------------------------------------------------------------

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
                self._send_soon([(wire, RdmaClose(sess.qp_num, reason[:1000]))])

    # --- decode engine control ------------------------------------------------------------

    async def _serve_engine(self, stream: trio.SocketStream) -> None:
        await serve_engine(TrioChannel(stream), RECEIVER_OPS, _DecodeEngine(self), "decode")

    def describe(self, req: RxRequest) -> dict[str, Any]:
        b = req.begin
        assert req.offset is not None
        info = RequestInfo(
            rid=b.rid,
            offset=req.offset,
            layer_sizes=b.layer_sizes,
            layer_offsets=b.layer_offsets,
            block_hashes=b.block_hashes,
            cached_blocks=b.cached_blocks,
            layout=b.layout,
            complete=req.state in (RxState.COMPLETE, RxState.CLAIMED),
            transfer_s=(req.completed_at - req.created) if req.completed_at else None,
        )
        return request_info_fields(info)

    def status(self) -> dict[str, Any]:
        a = self.pool.allocator
        held = self.book.holding()
        return {
            "node": self.cfg.node.id,
            "port": self.port,
            "tls": "mutual" if self.tls else "off",
            "connections": len(self.conns),
            "engines": self.engines,
            "awaiting": self.awaiting,
            "requests": {rid: r.state.value for rid, r in self.book.requests.items()},
            # verified bytes of each request still arriving, of its total
            "progress": {
                rid: [r.tracker.verified_bytes if r.tracker else 0, r.begin.total_bytes]
                for rid, r in self.book.requests.items()
            },
            "ready": list(self.book.ready),
            "pool": {"capacity": a.capacity, "used": a.used_bytes, "allocations": a.allocations},
            "rdma": {
                session: {
                    **sess.status(),
                    "quarantined": sum(1 for r in held if r.rdma_hold and r.session == session),
                }
                for session, sess in self.rdma.items()
            },
            "quarantined": sum(1 for r in held if r.rdma_hold),
            "held": len(held),
            **self.counts,
            "time": time.time(),
        }


class _DecodeEngine:
    """One decode engine's connection: it claims requests, pins layers and releases them;
    the book decides, and gives back what it held when the connection goes."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        rx.engines += 1

    async def handle(self, request: Request) -> dict[str, Any]:
        rx = self.rx
        if isinstance(request, EngineHello):
            if request.layout is not None:
                rx.book.engine_layout(self, request.layout)
            return pool_hello(rx.pool, request.pool_fd)
        if isinstance(request, Await):
            if request.rids:
                return await self._wait(
                    lambda: self._claim_any(request.rids), request.timeout_s, request.rids
                )
            return await self._wait(
                lambda: self._claim(request.rid),
                request.timeout_s,
                None if request.rid is None else (request.rid,),
                named=request.rid,
            )
        if isinstance(request, AwaitLayer):
            return await self._wait(
                lambda: rx.book.pin_layer(self, request.rid, request.layer),
                request.timeout_s,
                (request.rid,),
            )
        if isinstance(request, Release):
            refusal, effects = rx.book.release(self, request.rid)
            rx._apply(effects)
            if refusal is not None:
                raise TransferError(refusal.code, refusal.why)
            return {}
        if isinstance(request, Discard):
            refusal, effects = rx.book.discard(
                self, request.rid, "its decode engine gave it up", trio.current_time()
            )
            rx._apply(effects)
            if refusal is not None:
                raise TransferError(refusal.code, refusal.why, request.rid)
            return {}
        if isinstance(request, Status):
            return rx.status()
        raise TransferError(ResultCode.BAD_OP, f"{type(request).__name__} is not served here")

    def _claim_any(self, rids: tuple[str, ...]) -> RxRequest | Refusal | Any:
        answer, effects = self.rx.book.claim_any(self, rids, trio.current_time())
        self.rx._apply(effects)
        return answer

    def _claim(self, rid: str | None) -> RxRequest | Refusal | Any:
        answer, effects = self.rx.book.claim(self, rid, trio.current_time())
        self.rx._apply(effects)
        return answer

    async def _wait(
        self,
        ask: Any,
        timeout: float,
        rids: tuple[str, ...] | None,
        named: str | None = None,
    ) -> dict[str, Any]:
        """Ask the book until it answers, or the caller's time is up (0: ask once), looking
        again only when one of ``rids`` changed (None: any request). A named request the
        receiver never heard of is UNKNOWN_REQUEST, not TIMEOUT."""
        self.rx.awaiting += 1
        try:
            with trio.move_on_after(timeout), self.rx.waits.watching(rids) as waiter:
                while True:
                    changed = waiter.renew()
                    self.rx.counts["engine_looks"] += 1
                    answer = ask()
                    if isinstance(answer, Refusal):
                        raise TransferError(answer.code, answer.why, answer.rid)
                    if answer is not WAIT:
                        return self.rx.describe(answer)
                    if timeout == 0:
                        break
                    await changed.wait()
        finally:
            self.rx.awaiting -= 1
        if named is not None and not self.rx.book.known(named):
            why = f"no request {named!r} has begun here (within {timeout:g}s)"
            raise TransferError(ResultCode.UNKNOWN_REQUEST, why, named)
        raise TransferError(ResultCode.TIMEOUT, f"not ready within {timeout:g}s")

    def closed(self) -> None:
        rx = self.rx
        rx.engines -= 1
        rx._apply(rx.book.engine_gone(self))
