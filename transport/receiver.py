"""Decode-side daemon: accepts sender connections, lands chunks in shared memory, and hands
complete requests to the decode engine.

Visibility is two-phase (Mooncake Store's PutStart/PutEnd): a request's buffer is allocated at
BEGIN, but the decode engine is told about it only when every chunk has arrived *and* its
checksum matched; single layers become readable the same way. A request that cannot finish
before its deadline is freed and reported, never exposed half-written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import trio
from xdc.transport.control import (
    TrioChannel,
    accept_engines,
    bind_unix_listener,
    engine_uids,
    serve_engine,
)
from xdc.transport.metrics import ReceiverMetrics
from xdc.transport.pool import BufferPool, PoolTooSmall
from xdc.transport.rdma.peer_receiver import SessionRdma, answer_offer
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.shm import sweep_stale_segments
from xdc.transport.tls import RefusalLog, TlsRefused, load_policy, server_handshake
from xdc.transport.wire import PeerClosed, WireConn, tune_socket

from xdc.config import Config
from xdc.protocol import (
    Accept,
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    Disposition,
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
    RdmaClose,
    RdmaOffer,
    ReceiveTracker,
    chunk_checksum,
)
from xdc.protocol import Ack as AckEv
from xdc.protocol.control import (
    RECEIVER_OPS,
    Await,
    AwaitLayer,
    EngineHello,
    Release,
    Request,
    Status,
)
from xdc.protocol.errors import ErrorCode, ResultCode, TransferError
from xdc.protocol.events import PROTOCOL_VERSION

log = logging.getLogger("xdc.receiver")


@dataclass(eq=False)
class InRequest:
    begin: Begin
    session: str
    peer_id: str
    created: float
    deadline: float
    state: str = "allocating"  # allocating | receiving | complete | failed
    tracker: ReceiveTracker | None = None
    offset: int | None = None
    reply_to: WireConn | None = None
    claimed_by: object | None = None
    layer_events: list[trio.Event] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)
    failure: str = ""
    failure_code: ErrorCode = ErrorCode.DEADLINE
    completed_at: float = 0.0
    chunks_rejected: int = 0
    duplicates: int = 0
    inflight: int = 0
    free_pending: bool = False
    rdma: SessionRdma | None = None  # granted a slot on this session's queue pair
    rdma_stopped: bool = False  # the sender said no WRITE of it is in flight any more


class Receiver:
    def __init__(
        self,
        cfg: Config,
        *,
        rdma: RdmaDeps | None = None,
    ) -> None:
        self.cfg = cfg
        self.rc = cfg.receiver
        self.limits = Limits(**dataclasses.asdict(cfg.limits))
        # before any resource is taken: a mutual-TLS config without usable files is fatal
        self.tls = load_policy(cfg.tls, server=True)
        self.refusals = RefusalLog()
        self.engine_uids = engine_uids(cfg.node.allowed_uids)
        for name in sweep_stale_segments():
            log.warning("removed shared memory %s left by a dead xdc process", name)
        self.pool = BufferPool(self.rc.pool_bytes, prefix="xdc-rx")
        self.requests: dict[str, InRequest] = {}
        # Finished rids remembered so that late duplicates are acked (complete) or refused
        # (failed) instead of being mistaken for new requests; bounded.
        # rid -> (state, why, code name)
        self.finished: OrderedDict[str, tuple[str, str, str]] = OrderedDict()
        # (session, rid) cancelled before its BEGIN arrived (another connection overtook it)
        self.early_cancels: OrderedDict[tuple[str, str], str] = OrderedDict()
        # layouts the connected decode engines accept (none registered: any is accepted)
        self.layouts: Counter[str] = Counter()
        self.ready: deque[str] = deque()
        self._ready_changed = trio.Event()
        self._new_request = trio.Event()
        self.conns: set[WireConn] = set()
        # sender session -> its open data connections (a drain waits only for live senders)
        self.live_sessions: Counter[str] = Counter()
        self.metrics = ReceiverMetrics()
        self.port: int = 0
        self.counts = {
            "complete": 0,
            "failed": 0,
            "checksum_failures": 0,
            "duplicates": 0,
            "rdma_quarantined": 0,  # failed requests whose buffer waited for the sender
        }
        self.session = f"rx-{time.time_ns():x}"
        self._started = trio.Event()
        self.draining = False
        self.engines = 0  # open decode-engine connections
        self._sending = 0  # peer notifications still in flight
        self._accepting = trio.CancelScope()
        self._accept_stopped = trio.Event()  # the listener is closed: connects are refused
        # RDMA (same-domain peers only): verbs and device probe are injectable for tests
        self.rdma: dict[str, SessionRdma] = {}  # sender session -> its queue pair
        self.rdma_deps = rdma or RdmaDeps()
        self.session_wires: dict[str, set[WireConn]] = {}
        self._quarantined: dict[str, InRequest] = {}  # failed, buffer held for RDMA safety

    # --- lifecycle ------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket()
        listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        await listener.bind((self.rc.listen_host, self.rc.listen_port))
        listener.listen(256)
        self.port = listener.getsockname()[1]
        ctl = trio.socket.from_stdlib_socket(
            bind_unix_listener(
                self.rc.control_socket, group=bool(self.cfg.node.allowed_uids.strip())
            )
        )
        log.info(
            "receiver %s listening on %s:%d (%s), control %s, pool %d MiB (%s)",
            self.cfg.node.id,
            self.rc.listen_host,
            self.port,
            "mutual TLS 1.3" if self.tls else "plain TCP: tls.mode = off",
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
            with contextlib.suppress(OSError):
                os.unlink(self.rc.control_socket)

    async def _accept_loop(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        with self._accepting:
            while True:
                sock, addr = await listener.accept()
                tune_socket(sock, rcvbuf=self.rc.rcvbuf_bytes)
                nursery.start_soon(self._serve_conn, sock, addr)
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
            for r in self.requests.values()
            if (r.state in ("allocating", "receiving") and self.live_sessions[r.session] > 0)
            or (r.state == "complete" and self.engines > 0)
        )

    async def shutdown(self) -> None:
        """SIGTERM: stop accepting data connections and new requests, give in-flight
        transfers ``node.shutdown_drain_s`` to finish, then fail the rest so every sender
        (and through it every prefill engine) gets a definite outcome."""
        self.draining = True
        self._accepting.cancel()
        with trio.move_on_after(1.0):
            await self._accept_stopped.wait()
        drain = self.cfg.node.shutdown_drain_s
        log.info("draining: %d transfers in flight, up to %.1fs", self._busy(), drain)
        with trio.move_on_after(drain):
            while self._busy():
                await trio.sleep(0.02)
        left = [r for r in self.requests.values() if r.state in ("allocating", "receiving")]
        for req in left:
            self._fail(
                req.begin.rid,
                f"receiver shut down before the transfer finished (drain {drain:g}s)",
                code=ErrorCode.CANCELLED,
            )
        with trio.move_on_after(1.0):
            while self._sending:
                await trio.sleep(0.01)
        log.info(
            "drained: %d transfers failed at the deadline, %d complete but unclaimed",
            len(left),
            sum(1 for r in self.requests.values() if r.state == "complete"),
        )

    # --- data connections -----------------------------------------------------------------

    async def _serve_conn(self, sock: trio.socket.SocketType, addr: Any) -> None:
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        if self.tls is not None:
            try:
                with trio.fail_after(self.rc.handshake_timeout_s):
                    stream = await server_handshake(sock, self.tls)
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
            wire = WireConn(sock, "receiver", self.limits, tls=stream)
        else:
            wire = WireConn(sock, "receiver", self.limits)
        self.conns.add(wire)
        self.metrics.connections.inc()
        session = ""
        try:
            with trio.fail_after(self.rc.handshake_timeout_s):
                hello = await wire.next_event()
            if not isinstance(hello, Hello):  # the state machine already enforces this
                raise ProtocolError(ErrorCode.OUT_OF_ORDER, "expected HELLO")
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
            session = hello.session
            self.live_sessions[session] += 1
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
            self.metrics.connections.dec()
            if session:
                self.live_sessions[session] -= 1
                self.session_wires.get(session, set()).discard(wire)
                if self.live_sessions[session] <= 0:
                    del self.live_sessions[session]
                    self.session_wires.pop(session, None)
                    if session in self.rdma:
                        self._close_rdma(session, "sender's connections are gone", tell=False)

    async def _conn_loop(self, wire: WireConn, hello: Hello) -> None:
        scratch = bytearray(self.limits.max_chunk_bytes)
        scratch_view = memoryview(scratch)
        while True:
            ev = await wire.next_event()
            if isinstance(ev, ChunkHeader):
                await self._on_chunk(wire, ev, scratch_view)
            elif isinstance(ev, Begin):
                self._on_begin(wire, hello, ev)
            elif isinstance(ev, Ping):
                await wire.send(Pong(ev.nonce))
            elif isinstance(ev, Cancel):
                self._on_cancel(hello.session, ev)
            elif isinstance(ev, RdmaOffer):
                await self._on_rdma_offer(wire, hello, ev)
            elif isinstance(ev, RdmaClose):
                sess = self.rdma.get(hello.session)
                if sess is not None and sess.remote_qp_num == ev.qp_num:
                    log.warning("sender %s closed rdma: %s; on tcp", hello.peer_id, ev.reason)
                    self._close_rdma(hello.session, f"sender closed it: {ev.reason}", tell=False)
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
        rid = begin.rid
        existing = self.requests.get(rid)
        if existing is not None:
            if existing.session == hello.session and existing.begin == begin:
                # The sender re-sent BEGIN after losing the connection that carried it. It
                # never saw our ACCEPT, so it wrote nothing by RDMA: give the slot back (the
                # request goes by TCP, and a failure of it needs no release from the sender).
                if existing.rdma is not None:
                    existing.rdma.release(rid)
                    existing.rdma = None
                existing.reply_to = wire
                if existing.state == "receiving":
                    self._send_soon(wire, Accept(rid))
                return
            self._send_soon(
                wire, Error(int(ErrorCode.DUPLICATE_REQUEST), f"request {rid} already exists", rid)
            )
            return
        early = self.early_cancels.pop((hello.session, rid), None)
        if early is not None:
            self._send_soon(
                wire, Error(int(ErrorCode.CANCELLED), f"request {rid} was cancelled: {early}", rid)
            )
            return
        if rid in self.finished:
            state, why, _code = self.finished[rid]
            if state == "complete":
                # all of it already arrived and was acked; accept so the sender learns it
                self._send_soon(wire, Accept(rid))
            else:
                self._send_soon(
                    wire, Error(int(ErrorCode.CANCELLED), f"request {rid} failed: {why}", rid)
                )
            return
        if self.draining:
            self._send_soon(wire, Error(int(ErrorCode.TOO_BUSY), "receiver is shutting down", rid))
            return
        if self.layouts and begin.layout not in self.layouts:
            why = (
                f"request layout {begin.layout or '(none)'!r} is not what the decode engine "
                f"expects: {' | '.join(repr(x) for x in sorted(self.layouts))}"
            )
            log.warning("refusing %s: %s", rid, why)
            self.metrics.requests.labels("refused").inc()
            self._remember(rid, "failed", why, ErrorCode.LAYOUT_MISMATCH)
            self._send_soon(wire, Error(int(ErrorCode.LAYOUT_MISMATCH), why, rid))
            return
        if len(self.requests) >= self.limits.max_concurrent_transfers:
            self._send_soon(
                wire, Error(int(ErrorCode.TOO_BUSY), "too many concurrent transfers", rid)
            )
            return
        now = trio.current_time()
        deadline_s = min(begin.deadline_ms / 1000.0, self.rc.transfer_deadline_s)
        req = InRequest(
            begin=begin,
            session=hello.session,
            peer_id=hello.peer_id,
            created=now,
            deadline=now + deadline_s,
            reply_to=wire,
            layer_events=[trio.Event() for _ in begin.layer_sizes],
        )
        if not self.pool.allocator.fits_ever(begin.total_bytes):
            why = (
                f"request needs {begin.total_bytes} bytes but the receive pool is "
                f"{self.pool.allocator.capacity} bytes"
            )
            log.warning("refusing %s: %s", rid, why)
            self.metrics.requests.labels("refused").inc()
            self._send_soon(wire, Error(int(ErrorCode.NO_SPACE), why, rid))
            return
        self.requests[rid] = req
        self._new_request.set()
        self._new_request = trio.Event()
        self._nursery.start_soon(self._allocate, req)

    async def _allocate(self, req: InRequest) -> None:
        """Wait for pool room (backpressure on the sender), then ACCEPT."""
        sess = self.rdma.get(req.session)
        extra = sess.sums_bytes(req.begin) if sess is not None else 0
        if not self.pool.allocator.fits_ever(req.begin.total_bytes + extra):
            sess, extra = None, 0  # fits only without its checksum table: it goes by TCP
        try:
            timeout = max(0.0, req.deadline - trio.current_time())
            req.offset = await self.pool.alloc(req.begin.total_bytes + extra, timeout=timeout)
        except trio.TooSlowError:
            self._fail(req.begin.rid, "no room in the receive pool before the deadline")
            return
        except PoolTooSmall as e:
            self._fail(req.begin.rid, str(e), code=ErrorCode.NO_SPACE)
            return
        if req.state != "allocating":  # cancelled while waiting
            self.pool.free(req.offset)
            req.offset = None
            return
        req.tracker = ReceiveTracker(req.begin)
        req.state = "receiving"
        log.debug("accepted %s: %d bytes at %d", req.begin.rid, req.begin.total_bytes, req.offset)
        grant = None
        if sess is not None and sess is self.rdma.get(req.session):  # still the same QP
            grant = sess.grant(req.tracker, req.offset)
            if grant is not None:
                req.rdma = sess
        if req.tracker.complete:  # zero-byte request
            self._complete(req)
        if req.reply_to is not None:
            if grant is not None:  # before ACCEPT on the same connection: the sender needs it
                await self._send_quiet(req.reply_to, Grant(req.begin.rid, grant))
            await self._send_quiet(req.reply_to, Accept(req.begin.rid))

    async def _on_chunk(self, wire: WireConn, hdr: ChunkHeader, scratch: memoryview) -> None:
        req = self.requests.get(hdr.rid)
        if req is None or req.state == "allocating":
            wire.skip_payload()
            fin = self.finished.get(hdr.rid)
            if fin is not None and fin[0] == "complete":
                await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
            elif fin is not None:
                await wire.send(
                    Error(int(ErrorCode.CANCELLED), f"request failed: {fin[1]}", hdr.rid)
                )
            else:
                self.metrics.protocol_errors.labels("unknown_request").inc()
                await wire.send(
                    Error(int(ErrorCode.UNKNOWN_REQUEST), f"no transfer {hdr.rid!r} here", hdr.rid)
                )
            return
        tracker = req.tracker
        assert tracker is not None and req.offset is not None
        try:
            rel, disp = tracker.locate(hdr)
        except ProtocolError as e:
            wire.skip_payload()
            self.metrics.protocol_errors.labels(e.code.name.lower()).inc()
            await wire.send(Error(int(e.code), e.message, hdr.rid))
            return
        if disp is Disposition.IN_PLACE:
            start = req.offset + rel
            dest = self.pool.view[start : start + hdr.length]
        else:
            dest = scratch[: hdr.length]
        req.inflight += 1
        try:
            # An in-place receive stops writing the moment a resend of the same chunk has been
            # verified (via scratch) and copied into place, so late bytes of the slower copy
            # can never overwrite verified data.
            still_wanted = (
                (lambda: not tracker.superseded(hdr)) if disp is Disposition.IN_PLACE else None
            )
            whole = await wire.read_payload(dest, still_wanted)
        except BaseException:
            tracker.abandon(hdr, disp)
            raise
        finally:
            req.inflight -= 1
            if req.free_pending and req.inflight == 0:
                self._free_buffer(req)
        if not whole:
            tracker.abandon(hdr, disp)
            req.duplicates += 1
            self.counts["duplicates"] += 1
            return
        ok = chunk_checksum(dest, hdr.rid, hdr.layer, hdr.offset) == hdr.checksum
        if req.state != "receiving":
            # Finished while this chunk was in flight: a duplicate of a complete request is
            # acked (the sender may have missed the first ack); a failed one stays failed.
            tracker.abandon(hdr, disp)
            if req.state == "complete" and ok:
                await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
            return
        out = tracker.finish(hdr, disp, ok)
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
        if out.copy_from_scratch:
            start = req.offset + rel
            self.pool.view[start : start + hdr.length] = dest
        if not out.newly_verified and not out.copy_from_scratch:
            req.duplicates += 1
            self.counts["duplicates"] += 1
        self.metrics.bytes_received.inc(hdr.length)
        req.reply_to = wire
        await wire.send(AckEv(hdr.rid, hdr.layer, hdr.offset))
        if out.layer_done is not None:
            req.layer_events[out.layer_done].set()
            await wire.send(LayerDone(hdr.rid, out.layer_done))
        if out.request_done:
            self._complete(req)
            await wire.send(Complete(hdr.rid, tracker.total_bytes))

    def _complete(self, req: InRequest) -> None:
        if req.rdma is not None:  # every chunk landed: the sender writes no more to it
            req.rdma.release(req.begin.rid)
            req.rdma = None
        req.state = "complete"
        req.completed_at = trio.current_time()
        for e in req.layer_events:
            e.set()
        req.done.set()
        self.ready.append(req.begin.rid)
        self._wake_ready()
        self.metrics.requests.labels("complete").inc()
        self.counts["complete"] += 1
        self.metrics.transfer_seconds.observe(req.completed_at - req.created)
        log.info(
            "request %s complete: %d bytes in %.3fs (%d rejected chunks, %d duplicates)",
            req.begin.rid,
            req.begin.total_bytes,
            req.completed_at - req.created,
            req.chunks_rejected,
            req.duplicates,
        )

    def _wake_ready(self) -> None:
        self._ready_changed.set()
        self._ready_changed = trio.Event()

    def _fail(
        self,
        rid: str,
        why: str,
        *,
        notify_peer: bool = True,
        code: ErrorCode = ErrorCode.DEADLINE,
    ) -> None:
        req = self.requests.get(rid)
        if req is None or req.state in ("failed", "complete"):
            return
        req.state = "failed"
        req.failure = why
        req.failure_code = code
        log.warning("request %s failed: %s", rid, why)
        self.metrics.requests.labels("failed").inc()
        self.counts["failed"] += 1
        if notify_peer:
            wire = self._reply_wire(req)
            if wire is not None:
                self._send_soon(wire, Error(int(code), why, rid))
        req.done.set()
        for e in req.layer_events:
            e.set()
        self._release(req, "failed", why)

    def _remember(self, rid: str, state: str, why: str, code: ErrorCode | None) -> None:
        """A finished request's outcome, so late frames and late engine calls get it."""
        self.finished[rid] = (state, why, code.name if code is not None else "")
        while len(self.finished) > self.rc.completed_memory:
            self.finished.popitem(last=False)

    def _release(self, req: InRequest, state: str, why: str = "") -> None:
        rid = req.begin.rid
        sess = req.rdma
        if sess is not None and not sess.closed and not req.rdma_stopped:
            # RDMA WRITEs may still be on their way into this buffer: keep it until the
            # sender confirms it stopped (CANCEL), or the queue pair is destroyed
            sess.quarantine[rid] = trio.current_time()
            self._quarantined[rid] = req
            self.counts["rdma_quarantined"] += 1
        else:
            self._let_go(req)
        self.requests.pop(rid, None)
        self._remember(rid, state, why, req.failure_code if state == "failed" else None)
        with contextlib.suppress(ValueError):
            self.ready.remove(rid)

    # --- RDMA ---------------------------------------------------------------------------------

    def _on_cancel(self, session: str, ev: Cancel) -> None:
        """The sender gave a request up. For an RDMA request its CANCEL comes only after its
        WRITEs drained, so the buffer may be reused at once (also if already quarantined)."""
        req = self.requests.get(ev.rid)
        if req is not None and req.session != session:
            log.warning("CANCEL of %s from a session that does not own it: ignored", ev.rid)
            return
        if req is None and ev.rid not in self.finished:
            # its BEGIN may still be on its way on another connection: refuse it when it comes
            self.early_cancels[(session, ev.rid)] = ev.reason
            while len(self.early_cancels) > self.rc.completed_memory:
                self.early_cancels.popitem(last=False)
        if req is not None:
            req.rdma_stopped = True
        self._fail(ev.rid, f"cancelled by sender: {ev.reason}", notify_peer=False)
        held = self._quarantined.get(ev.rid)
        if held is not None and held.session == session:
            self._let_go(held)

    def _let_go(self, req: InRequest) -> None:
        """Give back a finished request's RDMA slot (if any) and its buffer; also ends its
        quarantine. A connection still reading a chunk into the buffer frees it when that
        read ends, so the region is never handed to another request while bytes land."""
        self._quarantined.pop(req.begin.rid, None)
        if req.rdma is not None:
            req.rdma.release(req.begin.rid)
            req.rdma = None
        if req.inflight:
            req.free_pending = True
        else:
            self._free_buffer(req)

    def _session_wire(self, session: str) -> WireConn | None:
        """Any open data connection of a sender session."""
        return next((w for w in self.session_wires.get(session, ()) if not w.closed), None)

    def _reply_wire(self, req: InRequest) -> WireConn | None:
        """Where to tell the sender about a request: the connection it last used, or another
        of its session's when that one died."""
        wire = req.reply_to
        return wire if wire is not None and not wire.closed else self._session_wire(req.session)

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
        """What a landed WRITE means, as the TCP path would have decided it (same tracker)."""
        req = self.requests.get(ev.rid) if ev.rid is not None else None
        if req is None or req.rdma is not sess or req.state != "receiving":
            if isinstance(ev, Error):
                log.warning("rdma from %s: %s", sess.peer_id, ev.message)
            return  # a write for a request that ended (quarantined): nothing to report
        wire = self._reply_wire(req)
        if isinstance(ev, LayerDone):
            size = req.begin.layer_sizes[ev.layer]
            sess.bytes_landed += size
            sess.chunks_landed += (
                len(req.tracker.grid.layer_indices(ev.layer)) if req.tracker else 0
            )
            self.metrics.bytes_received.inc(size)
            req.layer_events[ev.layer].set()
        elif isinstance(ev, Complete):
            self._complete(req)
        elif isinstance(ev, Nack):
            req.chunks_rejected += 1
            self.counts["checksum_failures"] += 1
            self.metrics.checksum_failures.inc()
            log.warning(
                "rdma: %s layer %d offset %d failed its sample check", ev.rid, ev.layer, ev.offset
            )
        if wire is not None:
            await self._send_quiet(wire, ev)

    def _close_rdma(self, session: str, reason: str, *, tell: bool) -> None:
        """Destroy the session's queue pair (no write can land after this), then free what
        was held for it. Requests in flight continue over TCP: their trackers are unchanged."""
        sess = self.rdma.pop(session, None)
        if sess is None:
            return
        log.info("rdma session of %s closed: %s", sess.peer_id, reason)
        try:
            sess.close()
        except Exception as exc:
            log.warning("rdma teardown: %s", exc)
        for req in list(self._quarantined.values()):
            if req.rdma is sess:
                self._let_go(req)
        for req in self.requests.values():
            if req.rdma is sess:
                req.rdma = None
        if tell and sess.qp_num:
            wire = self._session_wire(session)
            if wire is not None:
                self._send_soon(wire, RdmaClose(sess.qp_num, reason[:1000]))

    def _free_buffer(self, req: InRequest) -> None:
        req.free_pending = False
        if req.offset is not None:
            self.pool.free(req.offset)
            req.offset = None

    def _send_soon(self, wire: WireConn, ev: Any) -> None:
        self._sending += 1  # counted from now: a shutdown waits for it to go out
        self._nursery.start_soon(self._send_counted, wire, ev)

    async def _send_counted(self, wire: WireConn, ev: Any) -> None:
        try:
            await self._send_quiet(wire, ev)
        finally:
            self._sending -= 1

    async def _send_quiet(self, wire: WireConn, ev: Any) -> None:
        await wire.send_quietly(ev, timeout=self.rc.idle_timeout_s)

    async def _reaper(self) -> None:
        """Fail requests past their deadline (e.g. the sender died) and free their memory."""
        while True:
            await trio.sleep(0.1)
            now = trio.current_time()
            limit = 2 * self.cfg.rdma.stall_timeout_s + self.rc.idle_timeout_s
            for req in list(self._quarantined.values()):
                sess = req.rdma
                if sess is not None and now - sess.quarantine.get(req.begin.rid, now) > limit:
                    self._close_rdma(
                        sess.session, f"no release of {req.begin.rid} within {limit:g}s", tell=True
                    )
            for req in list(self.requests.values()):
                if req.state in ("allocating", "receiving") and now > req.deadline:
                    got = req.tracker.verified_bytes if req.tracker else 0
                    self._fail(
                        req.begin.rid,
                        f"deadline passed with {got}/{req.begin.total_bytes} bytes received",
                    )

    # --- decode engine control ------------------------------------------------------------

    async def _serve_engine(self, stream: trio.SocketStream) -> None:
        await serve_engine(TrioChannel(stream), RECEIVER_OPS, _DecodeEngine(self), "decode")

    def _take_ready(self, rid: str | None, owner: _DecodeEngine) -> InRequest | None:
        for r in self.ready:
            if rid is None or r == rid:
                req = self.requests[r]
                if req.claimed_by is None:
                    req.claimed_by = owner
                    self.ready.remove(r)
                    return req
        return None

    def _describe(self, req: InRequest) -> dict[str, Any]:
        b = req.begin
        return {
            "rid": b.rid,
            "offset": req.offset,
            "layer_sizes": list(b.layer_sizes),
            "layer_offsets": list(b.layer_offsets),
            "block_hashes": list(b.block_hashes),
            "cached_blocks": b.cached_blocks,
            "layout": b.layout,
            "complete": req.state == "complete",
            "transfer_s": (req.completed_at - req.created) if req.completed_at else None,
        }

    def status(self) -> dict[str, Any]:
        a = self.pool.allocator
        return {
            "node": self.cfg.node.id,
            "port": self.port,
            "tls": "mutual" if self.tls else "off",
            "connections": len(self.conns),
            "requests": {rid: r.state for rid, r in self.requests.items()},
            # verified bytes of each request still arriving, of its total
            "progress": {
                rid: [r.tracker.verified_bytes if r.tracker else 0, r.begin.total_bytes]
                for rid, r in self.requests.items()
            },
            "ready": list(self.ready),
            "pool": {"capacity": a.capacity, "used": a.used_bytes, "allocations": a.allocations},
            "rdma": {session: sess.status() for session, sess in self.rdma.items()},
            "quarantined": len(self._quarantined),
            **self.counts,
            "time": time.time(),
        }


class _DecodeEngine:
    """One decode engine's connection: the KV layout it accepts and what it claimed."""

    def __init__(self, rx: Receiver) -> None:
        self.rx = rx
        self.layout: str | None = None
        rx.engines += 1

    async def handle(self, request: Request) -> dict[str, Any]:
        rx = self.rx
        if isinstance(request, EngineHello):
            if request.layout is not None:
                self._forget_layout()
                self.layout = request.layout
                rx.layouts[request.layout] += 1
            return {"shm": rx.pool.name, "size": rx.pool.segment.size}
        if isinstance(request, Await):
            return await self._await(request)
        if isinstance(request, AwaitLayer):
            return await self._await_layer(request)
        if isinstance(request, Release):
            req = rx.requests.get(request.rid)
            if req is None or req.state != "complete":
                raise TransferError(
                    ResultCode.UNKNOWN_REQUEST, f"no complete request {request.rid!r} here"
                )
            if req.claimed_by is not self:
                raise TransferError(
                    ResultCode.NOT_OWNER, f"{request.rid} was not handed to this connection"
                )
            rx._release(req, "complete")
            return {}
        if isinstance(request, Status):
            return rx.status()
        raise TransferError(ResultCode.BAD_OP, f"{type(request).__name__} is not served here")

    async def _await(self, request: Await) -> dict[str, Any]:
        rx, rid, timeout = self.rx, request.rid, request.timeout_s
        with trio.move_on_after(timeout):
            while True:
                req = rx._take_ready(rid, self)
                if req is not None:
                    if self.layout is not None and req.begin.layout != self.layout:
                        why = (
                            f"request layout {req.begin.layout or '(none)'!r} is not this "
                            f"engine's {self.layout!r}"
                        )
                        log.warning("request %s refused at hand-out: %s", req.begin.rid, why)
                        req.failure_code = ErrorCode.LAYOUT_MISMATCH
                        rx._release(req, "failed", why)
                        raise TransferError(ResultCode.LAYOUT_MISMATCH, why)
                    return rx._describe(req)
                fin = rx.finished.get(rid) if rid is not None else None
                if fin is not None and fin[0] == "failed":
                    raise TransferError(fin[2] or ResultCode.FAILED, fin[1])
                if timeout == 0:
                    break
                await rx._ready_changed.wait()
        raise TransferError(ResultCode.TIMEOUT, f"nothing complete within {timeout}s")

    async def _await_layer(self, request: AwaitLayer) -> dict[str, Any]:
        rx, rid, layer = self.rx, request.rid, request.layer
        with trio.move_on_after(request.timeout_s):
            while rid not in rx.requests:
                if rid in rx.finished:
                    _state, why, code = rx.finished[rid]
                    raise TransferError(code or ResultCode.FAILED, why)
                await rx._new_request.wait()
            req = rx.requests[rid]
            if not 0 <= layer < len(req.layer_events):
                raise TransferError(ResultCode.BAD_REQUEST, f"{rid} has no layer {layer}")
            await req.layer_events[layer].wait()
            if req.state == "failed" or req.offset is None:
                raise TransferError(req.failure_code.name, req.failure)
            return rx._describe(req)
        raise TransferError(ResultCode.TIMEOUT, f"layer not ready within {request.timeout_s}s")

    def _forget_layout(self) -> None:
        if self.layout is not None:
            self.rx.layouts[self.layout] -= 1
            self.rx.layouts += Counter()  # drop zero counts

    def closed(self) -> None:
        rx = self.rx
        rx.engines -= 1
        self._forget_layout()
        # Requests handed to this connection but never released go back to the ready queue
        # (the engine may never have seen the reply): releasing them here would lose a
        # request the sender was told is delivered.
        for req in list(rx.requests.values()):
            if req.claimed_by is self and req.state == "complete":
                req.claimed_by = None
                rx.ready.appendleft(req.begin.rid)
                log.info("request %s back in the ready queue: its engine left", req.begin.rid)
        rx._wake_ready()
