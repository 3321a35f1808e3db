"""Decode-side daemon: accepts sender connections, lands chunks in shared memory, and hands
complete requests to the decode engine. This module is its lifecycle (start, drain, the
clock), the request book's effects and pool allocation; the sender connections are in
``receive_conns``, RDMA sessions in ``receive_rdma``, decode-engine connections in
``decode_engines``.

Every decision about a request (who owns it, when it is visible, who may read or release it,
when it ends and what its buffer may do then) is made by ``xdc.protocol.books.receive``;
this module is its I/O shell. It feeds the book what happened on sockets, engine calls and
the clock, and carries out the effects the book returns: frames to senders, pool
allocations and frees, wake-ups of waiting engines, logs and metrics. Chunks land with
``recv_into`` straight into the request's buffer (TCP) or by RDMA WRITE (a session's queue
pair); both drive the same per-request ReceiveTracker.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import trio
from xdc.transport.daemon import claim_socket_and_pool, link_description
from xdc.transport.daemon_metrics import ReceiverMetrics
from xdc.transport.data_workers import DataWorkers
from xdc.transport.decode_engines import DecodeEngine
from xdc.transport.engine_socket import (
    TrioChannel,
    accept_engines,
    engine_uids,
    serve_engine,
)
from xdc.transport.fd_budget import (
    data_connection_budget,
    open_descriptors,
    raise_nofile_limit,
)
from xdc.transport.pool import PoolTooSmall
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.receive_conns import DataConnections
from xdc.transport.receive_rdma import RdmaSessions
from xdc.transport.receive_runs import WorkerRuns
from xdc.transport.tls import (
    load_policy,
)
from xdc.transport.waits import WaitIndex
from xdc.transport.wire import WireConn

from xdc.config import Config, data_threads_for, data_workers_for
from xdc.errors import ErrorCode, StartupError
from xdc.protocol import (
    Accept,
    Event,
    Grant,
)
from xdc.protocol.books.receive import (
    ARRIVING,
    Allocate,
    Delivered,
    Effect,
    Failed,
    Free,
    ReceiveBook,
    Refused,
    ReleaseRdma,
    Requeued,
    RxRequest,
    RxState,
    Send,
)
from xdc.protocol.engine_control import (
    RECEIVER_OPS,
    RequestInfo,
    request_info_fields,
)

log = logging.getLogger("xdc.receiver")


class Receiver(DataConnections, WorkerRuns, RdmaSessions):
    """The decode-side daemon: its lifecycle and request book (this module), its sender
    connections (``receive_conns``), RDMA sessions (``receive_rdma``) and decode engines
    (``decode_engines``)."""

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
            max_transfer_s=self.rc.transfer_max_s,
        )
        self.waits = WaitIndex()  # engine calls waiting, by the request ids they name
        self.data_threads = data_threads_for(self.rc.data_threads)
        self.data_workers = (
            DataWorkers(workers, self.pool.segment, self.limits)
            if (workers := data_workers_for(self.rc.data_workers))
            else None
        )
        self.metrics = ReceiverMetrics()
        self.port: int = 0
        self.counts = {
            "complete": 0,
            "failed": 0,
            "checksum_failures": 0,
            "duplicates": 0,
            # connections closed because their sender opened them again (it gave them up)
            "superseded_connections": 0,
            "rdma_quarantined": 0,  # failed requests whose buffer waited for the sender
            "requeued": 0,  # claimed requests given back when their engine left
            "engine_looks": 0,  # times a waiting engine call asked the book again
            "runs": 0,  # runs of data workers started (receive_runs)
            "run_chunks": 0,  # chunks those runs reported landed (or given up half read)
        }
        self.session = f"rx-{time.time_ns():x}"
        self.draining = False
        self.engines = 0  # open decode-engine connections
        self.awaiting = 0  # engine calls waiting for a request or a layer
        self._sending = 0  # notices to senders still in flight
        self._init_connections(self.rc.max_connections, self.rc.scratch_buffers)
        self._init_runs()
        self._init_rdma(rdma)
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
            link_description(
                bool(self.tls),
                self.data_threads,
                self.data_workers.count if self.data_workers else 0,
            ),
            self.rc.control_socket,
            self.rc.pool_bytes >> 20,
            self.pool.name,
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.data_workers is not None:
                    await nursery.start(self.data_workers.serve)
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

    def _busy(self) -> int:
        """Requests a graceful shutdown waits for: still arriving from a sender that is
        still connected, complete and not yet taken by a connected decode engine (which
        may be about to read them), or taken and not yet released (a claim lasts only as
        long as its engine connection: the engine is reading it, and its RELEASE would
        otherwise meet a closed socket)."""
        return sum(
            1
            for r in self.book.requests.values()
            if (r.state in ARRIVING and r.session in self.session_wires)
            or (r.state is RxState.COMPLETE and self.engines > 0)
            or r.state is RxState.CLAIMED
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
        if accepted and self.rc.worker_runs:
            await self._lease_to_runs(req)
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

    # --- RDMA ---------------------------------------------------------------------------------

    # --- decode engine control ------------------------------------------------------------

    async def _serve_engine(self, stream: trio.SocketStream) -> None:
        await serve_engine(TrioChannel(stream), RECEIVER_OPS, DecodeEngine(self), "decode")

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
            # what carries them: {"sealed/aegis-128l": 8}, "plain", "tls" (TLS records)
            "records": dict(Counter(c.records for c in self.conns)),
            # worker processes moving payloads (receiver.data_workers), if any
            "data_workers": self.data_workers.status() if self.data_workers else None,
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
            # runs of data workers under way, and the buffers they lease (0 at rest)
            "runs_under_way": sum(len(runs) for runs in self._session_runs.values()),
            "leased_buffers": len(self._runs),
            **self.counts,
            "time": time.time(),
        }
