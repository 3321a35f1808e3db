"""Prefill-side daemon: takes layers from the prefill engine as they are computed and ships
them to the receiver, over N parallel TCP connections or, inside one datacenter, by RDMA.

What a request may do next (who owns it, what hand-over means, when it is accepted,
complete or failed, what a late call is told) is decided by ``xdc.protocol.books.send``;
how its bytes travel is its data path (``transport.data_path``: TCP chunks or RDMA WRITEs,
one interface); the connections themselves are ``transport.peer_link``. This module drives
the three: it serves the engines, runs one task per request (BEGIN until accepted, then wait
for the end), and turns the receiver's frames into lifecycle events.

A layer's buffer returns to the pool once the receiver holds the layer (or the request
ended) and nothing still reads it: that is what bounds sender memory and pushes back on the
engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import trio
from xdc.monitor.link_metrics import LinkMetrics
from xdc.transport.daemon import claim_socket_and_pool, link_description, pool_hello
from xdc.transport.daemon_metrics import SenderMetrics
from xdc.transport.data_path import DataPath, PeerPaths
from xdc.transport.data_workers import DataWorkers
from xdc.transport.engine_socket import (
    TrioChannel,
    accept_engines,
    engine_uids,
    serve_engine,
)
from xdc.transport.peer_link import ConnSlot, OpenChunk, PeerLink, PeerSettings, Work
from xdc.transport.pool import PoolTooSmall
from xdc.transport.rdma.select import RdmaDeps
from xdc.transport.tls import load_policy
from xdc.transport.wire import PeerClosed

from xdc.config import Config, ConfigError, data_threads_for, data_workers_for
from xdc.errors import ResultCode, TransferError
from xdc.protocol import Ack as AckEv
from xdc.protocol import (
    Begin,
    Complete,
    End,
    Event,
    Grant,
    Keep,
    LayerDone,
    Nack,
    ProtocolError,
)
from xdc.protocol.books.send import (
    Accepted,
    Completed,
    Failed,
    Give,
    LayerAcked,
    SendBook,
    TellEnd,
    TxEffect,
    TxRequest,
    TxState,
)
from xdc.protocol.engine_control import (
    SENDER_OPS,
    Admit,
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

log = logging.getLogger("xdc.sender")


# the longest between two KEEPs of a live request: a receiver whose own window is shorter
# than a third of the sender's still hears in time (its transfer_deadline_s says above 2 s)
KEEP_EVERY_S = 1.0
# how late a request's task may give up after the book's deadline passed (``_follow_deadline``)
DEADLINE_SLACK_S = 0.25


@dataclass
class _Waits:
    """The moments a request's task waits for."""

    accepted: trio.Event = field(default_factory=trio.Event)
    retry_begin: trio.Event = field(default_factory=trio.Event)  # its BEGIN's connection died
    done: trio.Event = field(default_factory=trio.Event)
    # the request's deadline, moved on by every hand-over that brings new bytes and by
    # every ACK (the book's clock; ``_follow_deadline``)
    deadline: trio.CancelScope | None = None


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
        if self.sc.chunk_bytes > cfg.limits.max_chunk_bytes:
            # (a sender's setting against a limit both daemons share: checked here, not when
            # any config is loaded, so a receiver may lower its limit below the default chunk)
            raise ConfigError(
                [
                    f"sender.chunk_bytes: {self.sc.chunk_bytes} > limits.max_chunk_bytes "
                    f"{cfg.limits.max_chunk_bytes}: every BEGIN would be refused (by this "
                    "sender, and by a receiver with the same limit); lower it, or raise "
                    "limits.max_chunk_bytes on both daemons"
                ]
            )
        # parsed once (validated with the config): the receivers a request may name
        self.allowed_peers = self.sc.allowed_peer_names()
        self.data_threads = data_threads_for(self.sc.data_threads)
        self.limits = cfg.limits.limits()
        # before any resource is taken: a mutual-TLS config without usable files is fatal
        self.tls = load_policy(cfg.tls, server=False)
        self.engine_uids = engine_uids(cfg.node.allowed_uids)
        self.engine_socket, self.pool = claim_socket_and_pool(
            self.sc.control_socket,
            group=bool(cfg.node.allowed_uids),
            pool_bytes=self.sc.pool_bytes,
            prefix="xdc-tx",
        )
        self.book = SendBook(
            max_layers=self.limits.max_layers,
            max_request_bytes=self.limits.max_request_bytes,
            max_block_hashes=self.limits.max_block_hashes,
            max_concurrent=self.limits.max_concurrent_transfers,
            fits=self.pool.allocator.fits_ever,
            max_transfer_s=self.sc.transfer_max_s,
        )
        self.peers: dict[tuple[str, int], PeerLink] = {}
        self.paths: dict[PeerLink, PeerPaths] = {}
        self.waits: dict[str, _Waits] = {}
        # (rid, layer) -> sendmsg calls reading that layer's buffer right now
        self.reading: Counter[tuple[str, int]] = Counter()
        self.metrics = SenderMetrics()
        self.link_metrics = LinkMetrics(self.metrics.registry)
        self.session = f"{os.getpid():x}-{secrets.token_hex(6)}"
        self.data_workers = (
            DataWorkers(workers, self.pool.segment, self.limits)
            if (workers := data_workers_for(self.sc.data_workers))
            else None
        )
        self.peer_settings = PeerSettings(
            cfg,
            self.session,
            self.limits,
            self.tls,
            self.data_threads,
            self.data_workers,
            self.pool.view,
            self.pool.name,
            self.rdma_deps,
            self.link_metrics,
        )
        self.completed = 0
        self.failed = 0
        self._nursery: trio.Nursery | None = None
        self._notifying = 0  # notices to the receiver still being sent
        self._outcomes_owed = 0  # requests out of the book whose engine is still being told

    @property
    def requests(self) -> dict[str, TxRequest]:
        return self.book.requests

    @property
    def draining(self) -> bool:
        return self.book.draining

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        engine_socket = self.engine_socket
        ctl = trio.socket.from_stdlib_socket(engine_socket.sock)
        log.info(
            "sender %s: peer %s:%d over %d connections (%s), control %s, pool %d MiB",
            self.cfg.node.id,
            self.sc.peer_host,
            self.sc.peer_port,
            self.sc.connections,
            link_description(
                bool(self.tls),
                self.data_threads,
                self.data_workers.count if self.data_workers else 0,
            ),
            self.sc.control_socket,
            self.sc.pool_bytes >> 20,
        )
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.data_workers is not None:
                    await nursery.start(self.data_workers.serve)
                self.peer(None)
                nursery.start_soon(
                    accept_engines, ctl, self.engine_uids, "prefill", self._serve_engine, nursery
                )
                engine_socket.listen()
                task_status.started()
                await trio.sleep_forever()
        finally:
            ctl.close()
            self.pool.close()
            engine_socket.close()

    async def shutdown(self) -> None:
        """SIGTERM: refuse new requests, give in-flight ones ``node.shutdown_drain_s`` to be
        delivered (their engines may still be handing over layers), then fail the rest so
        each engine gets an outcome and the receiver frees their buffers."""
        self.book.draining = True
        drain = self.cfg.node.shutdown_drain_s
        log.info("draining: %d requests in flight, up to %.1fs", len(self.requests), drain)
        with trio.move_on_after(drain):
            while self.requests:
                await trio.sleep(0.02)
        left = list(self.requests)
        for rid in left:
            why = f"sender shut down before the transfer finished (drain {drain:g}s)"
            self.fail(rid, ResultCode.SHUTDOWN, why)
        # outcomes reach the engines from each request's own task; CANCELs go to the peer
        with trio.move_on_after(2.0):
            while self.requests or self._notifying or self._outcomes_owed:
                await trio.sleep(0.01)
        log.info("drained: %d requests failed at the deadline", len(left))

    def peer(self, spec: str | None) -> PeerLink:
        """The link to the receiver a request names (``HOST:PORT``; None: the configured
        peer), opened on first use. Only the configured peer and ``sender.allowed_peers``
        may be named: anything else is a BAD_REQUEST, and nothing connects there."""
        default = (self.sc.peer_host, self.sc.peer_port)
        key = default
        tls_name: str | None = None
        if spec:
            host, _, port_s = spec.rpartition(":")
            key = (host or self.sc.peer_host, int(port_s))
        if key != default:
            allowed = self.allowed_peers
            if key not in allowed:
                raise TransferError(
                    ResultCode.BAD_REQUEST,
                    f"peer {key[0]}:{key[1]} is not this sender's receiver nor in "
                    "sender.allowed_peers",
                )
            tls_name = allowed[key] or key[0]
        link = self.peers.get(key)
        if link is None:
            assert self._nursery is not None
            extra = self.sc.extra_addresses() if key == default else ()
            # Each link is its own session to its receiver (the sender's own for the first):
            # a receiver takes a HELLO on (session, connection number) as that connection
            # opened again, so two links that reach one receiver under two names must not
            # share both, or each reconnect would close the other's connection.
            n = len(self.peers)
            link = PeerLink(
                self,
                self.peer_settings,
                *key,
                tls_name=tls_name,
                extra_addresses=extra,
                session=f"{self.session}.{n}" if n else self.session,
            )
            self.peers[key] = link
            self.paths[link] = PeerPaths(
                link, Work, lambda rid, layer: (rid, layer) in self.reading
            )
            self._nursery.start_soon(link.run)
        return link

    def admit(self, spec: str | None) -> dict[str, Any]:
        """Whether a request for receiver ``spec`` would be shipped now (``control.Admit``):
        not while draining, never to a peer the config does not allow, and not over a link
        with no connection for a while (the decode would only wait for bytes that can not
        come). Opens the link on first use, as a begin would."""
        if self.draining:
            return {"admitted": False, "reason": "draining", "why": "the sender is shutting down"}
        try:
            link = self.peer(spec)
        except TransferError as e:
            return {"admitted": False, "reason": "peer_refused", "why": e.message}
        why = link.unreachable(trio.current_time())
        if why is not None:
            return {"admitted": False, "reason": "peer_unreachable", "why": why}
        return {"admitted": True}

    # --- which path a request takes ----------------------------------------------------------

    def _paths(self, req: TxRequest) -> PeerPaths:
        peer = req.peer
        assert isinstance(peer, PeerLink)
        return self.paths[peer]

    def path(self, req: TxRequest) -> DataPath:
        return self._paths(req).of(req)

    # --- what the receiver says (from the peer links' readers) -------------------------------

    def on_accept(self, rid: str) -> None:
        self._apply(self.book.accepted(rid))

    def on_ack(self, ev: AckEv) -> None:
        self._apply(self.book.acked(ev.rid, ev.layer, ev.offset, trio.current_time()))
        self._follow_deadline(ev.rid)

    def on_nack(self, ev: Nack, work: Work | None) -> None:
        req = self.requests.get(ev.rid)
        if req is None or req.state is not TxState.SENDING:
            return
        wanted = work if work is not None and self.wants(work) else None
        if self.path(req).nacked(req, ev.layer, ev.offset, wanted, ev.retry_after_ms):
            self.count_resent(ev.rid)
            # a declined chunk (receiver busy) is routine under resend races: not a warning
            log.log(
                logging.DEBUG if ev.retry_after_ms else logging.WARNING,
                "%s layer %d offset %d NACKed (%s); resending%s",
                ev.rid,
                ev.layer,
                ev.offset,
                ev.reason,
                f" in {ev.retry_after_ms} ms or more" if ev.retry_after_ms else "",
            )

    def on_grant(self, ev: Grant) -> None:
        req = self.requests.get(ev.rid)
        if req is not None:
            self._paths(req).granted(req, ev.grant)

    def on_layer_done(self, ev: LayerDone) -> None:
        req = self.requests.get(ev.rid)
        if req is not None and self.path(req).confirmed(req, ev.layer):
            self.maybe_free_layer(req, ev.layer)

    def on_peer_complete(self, ev: Complete) -> None:
        req = self.requests.get(ev.rid)
        if req is not None and self.path(req).peer_complete(req):
            self._complete(req)

    async def rdma_fallback(
        self, rid: str, unconfirmed: list[tuple[int, int, int]], done: set[int]
    ) -> None:
        """The RDMA link failed: layers the receiver confirmed count as acked; the rest of
        what was handed over goes over TCP (duplicates of landed chunks are acked cheaply)."""
        req = self.requests.get(rid)
        if req is None or not self._paths(req).fall_back(req, done):
            return
        if req.state is not TxState.SENDING:
            return
        for layer in sorted(done):
            for off, _n in req.tracker.chunks(layer):
                req.tracker.ack(layer, off)
            self.maybe_free_layer(req, layer)
        req.resent += len(unconfirmed)
        self.metrics.resent_chunks.inc(len(unconfirmed))
        peer = req.peer
        assert isinstance(peer, PeerLink)
        # copies: RDMA may have written any of them already
        peer.enqueue([Work(rid, layer, off, n, copy=True) for layer, off, n in unconfirmed])
        tcp = self.path(req)
        for layer in range(len(req.handed)):  # parts handed over but never given to RDMA
            tcp.give(req, layer)
        if req.tracker.all_acked and req.all_handed:
            self._complete(req)

    def rdma_batch_done(self, peer: PeerLink) -> None:
        """Send completions arrived: layers waiting for the NIC to finish may be freed."""
        paths = self.paths.get(peer)
        if paths is None:
            return
        for rid, layer in paths.frees_due():
            req = self.requests.get(rid)
            if req is None:
                paths.forget(rid)
            else:
                self.maybe_free_layer(req, layer)

    def begin_lost(self, rid: str) -> None:
        """The connection that carried the request's BEGIN died before its ACCEPT."""
        waits = self.waits.get(rid)
        if waits is not None:
            waits.retry_begin.set()

    def count_resent(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            req.resent += 1
        self.metrics.resent_chunks.inc()

    # --- what a PeerLink asks of its owner (peer_link.PeerHost) --------------------------

    def _wanted(self, w: Work) -> TxRequest | None:
        """The request of a chunk still to be sent (sending, and the receiver lacks it)."""
        req = self.requests.get(w.rid)
        if (
            req is None
            or req.state is not TxState.SENDING
            or req.tracker.is_acked(w.layer, w.offset)
        ):
            return None
        return req

    def open_chunk(self, work: Work) -> OpenChunk | None:
        req = self._wanted(work)
        if req is None:
            return None
        base = req.layer_slot[work.layer]
        if base is None:
            return None
        key = (work.rid, work.layer)
        self.reading[key] += 1  # its buffer must not be reused under sendmsg
        return OpenChunk(self.pool.view[base + work.offset : base + work.offset + work.length], req)

    def close_chunk(self, work: Work, token: Any) -> None:
        key = (work.rid, work.layer)
        self.reading[key] -= 1
        if not self.reading[key]:
            del self.reading[key]
        self.maybe_free_layer(token, work.layer)  # the request, even if it ended meanwhile
        self.metrics.bytes_sent.inc(work.length)

    def count_send(self, chunks: int) -> None:
        self.metrics.chunks_per_send.observe(chunks)

    def on_refused(self, rid: str, code: ResultCode, why: str) -> None:
        self.fail(rid, code, why, notify=False)

    def connections_changed(self) -> None:
        self.metrics.connections.set(sum(len(p.live) for p in self.peers.values()))

    def connection_failed(self, label: str) -> None:
        self.metrics.connection_failures.labels(label).inc()

    def tell_peer(self, peer: PeerLink, ev: Event) -> None:
        self._tell_peer(peer, ev)

    def wants(self, w: Work) -> bool:
        return self._wanted(w) is not None

    def peer_restarted(self, peer: PeerLink, session: str) -> None:
        """A new receiver session means the old one's partial requests are gone: fail the
        accepted ones now instead of waiting for their deadline. Not-yet-accepted requests
        simply BEGIN again on the new session."""
        log.warning(
            "receiver %s restarted (session %s -> %s)", peer.name, peer.peer_session, session
        )
        if peer.rdma is not None:
            peer.rdma.close_on_peer("receiver restarted")
        self._apply(self.book.peer_restarted(peer))

    # --- engine side -------------------------------------------------------------------------

    def begin(self, msg: BeginRequest, owner: _PrefillEngine | None) -> TxRequest:
        deadline_s = msg.deadline_s or self.sc.transfer_deadline_s
        begin = Begin(
            msg.rid,
            msg.layer_sizes,
            self.sc.chunk_bytes,
            msg.block_hashes,
            msg.cached_blocks,
            max(1, int(deadline_s * 1000)),
            msg.layout,
        )
        peer = self.peer(msg.peer)
        req = self.book.begin(owner, begin, peer, trio.current_time(), deadline_s)
        self.waits[req.rid] = _Waits()
        assert self._nursery is not None
        self._nursery.start_soon(self._run_request, req)
        return req

    async def alloc_layer(self, owner: _PrefillEngine | None, rid: str, layer: int) -> int:
        req = self.book.may_allocate(owner, rid, layer)
        size = req.begin.layer_sizes[layer]
        while True:  # until the deadline, which ACKs freeing the pool meanwhile move on
            try:
                timeout = max(0.0, req.deadline - trio.current_time())
                off = await self.pool.alloc(max(1, size), timeout=timeout)
                break
            except PoolTooSmall as e:
                raise TransferError(ResultCode.NO_SPACE, str(e)) from None
            except trio.TooSlowError:
                if req.live and trio.current_time() < req.deadline:
                    continue
                why = "send pool stayed full until the deadline"
                raise TransferError(ResultCode.DEADLINE, why) from None
        if not req.live or req.layer_slot[layer] is not None:  # ended (or raced) meanwhile
            self.pool.free(off)
            raise TransferError(req.code or ResultCode.FAILED, req.why or "request ended")
        req.layer_slot[layer] = off
        self.metrics.pool_used.set(self.pool.allocator.used_bytes)
        return off

    def try_alloc_layer(self, owner: _PrefillEngine | None, rid: str, layer: int) -> int | None:
        """Allocate without waiting; None if the pool is short or the layer is not pending."""
        try:
            req = self.book.may_allocate(owner, rid, layer)
        except TransferError:
            return None
        off = self.pool.allocator.try_alloc(max(1, req.begin.layer_sizes[layer]))
        if off is not None:
            req.layer_slot[layer] = off
            self.metrics.pool_used.set(self.pool.allocator.used_bytes)
        return off

    def layer_ready(
        self, owner: _PrefillEngine | None, rid: str, layer: int, upto: int | None = None
    ) -> None:
        """Bytes [0, upto) of the layer are final (None: all of it, the hand-over is done)."""
        self._apply(self.book.hand_over(owner, rid, layer, upto, trio.current_time()))
        self._follow_deadline(rid)

    def _follow_deadline(self, rid: str) -> None:
        """The book moved the request's deadline on (it progressed): so does its task's, once
        the book's has passed it, and then ``DEADLINE_SLACK_S`` beyond. So the task never
        gives up before the book's deadline, at most that much after it, and its scope moves
        a few times a second instead of at every ACK (each move is a trip through trio's
        deadline heap: 6% of the sender loop's time at 512 MiB requests with workers)."""
        req, waits = self.book.requests.get(rid), self.waits.get(rid)
        if req is None or waits is None or waits.deadline is None:
            return
        scope, clock = waits.deadline, req.clock
        if scope.deadline < clock.at:
            scope.deadline = min(clock.at + min(DEADLINE_SLACK_S, clock.window_s / 20), clock.cap)

    # --- a request's life --------------------------------------------------------------------

    async def _run_request(self, req: TxRequest) -> None:
        waits = self.waits[req.rid]
        peer = req.peer
        assert isinstance(peer, PeerLink)
        paths = self.paths[peer]
        try:
            with trio.move_on_at(req.deadline) as waits.deadline:
                while req.state is TxState.PENDING:
                    slot = await peer.wait_live()
                    wire = slot.wire
                    if wire is None:
                        continue
                    waits.retry_begin = trio.Event()
                    paths.begin_sent(req.rid)
                    slot.pending_begins.add(req.rid)
                    try:
                        await wire.send(req.begin)
                    except ProtocolError as e:
                        # refused by this daemon's own limits before a byte went out (a header
                        # over limits.max_header_bytes: many prefix block hashes): the request
                        # fails, the daemon and its connection go on
                        slot.pending_begins.discard(req.rid)
                        self.fail(
                            req.rid, ResultCode.LIMIT, f"BEGIN not sent: {e.message}", notify=False
                        )
                        return
                    except (PeerClosed, trio.ClosedResourceError):
                        await trio.sleep(0)
                        continue
                    async with trio.open_nursery() as n:
                        n.start_soon(_wait_then_cancel, waits.accepted, n.cancel_scope)
                        n.start_soon(_wait_then_cancel, waits.retry_begin, n.cancel_scope)
                        n.start_soon(_wait_then_cancel, waits.done, n.cancel_scope)
                keep_every = min(req.clock.window_s / 3, KEEP_EVERY_S)
                while not waits.done.is_set():
                    with trio.move_on_after(keep_every):
                        await waits.done.wait()
                    if req.live:  # the receiver's window for it starts again (Keep says why)
                        self._tell_peer(req, Keep(req.rid))
            if req.live:
                self.fail(
                    req.rid,
                    ResultCode.DEADLINE,
                    f"{req.clock.why(req.created)}: {sum(req.ready_upto)} bytes handed over "
                    f"by the engine, {req.tracker.acked_bytes}/{req.begin.total_bytes} acked "
                    f"(peer {peer.name}: {len(peer.live)} live connections)",
                )
        finally:
            await self._finish(req)

    async def _finish(self, req: TxRequest) -> None:
        if req.live:  # cancelled from outside (shutdown): its task is the one ending
            self.book.fail(req.rid, ResultCode.SHUTDOWN, "sender shutting down")
        paths = self._paths(req)
        cancel = await paths.finished(req, self.cfg.rdma.stall_timeout_s)
        if cancel is not None:  # the receiver may reuse its buffer only now
            self._tell_peer(req, cancel)
        for layer in range(len(req.layer_slot)):
            self.maybe_free_layer(req, layer)
        # a shutdown waits for the outcome to reach its engine, not only for the request to
        # leave the book: CI saw a daemon say 'drained' and exit while the outcome of the
        # request it had just delivered was still being written, and the engine got a closed
        # socket instead
        self._outcomes_owed += 1
        try:
            self.book.finish(req)
            self.waits.pop(req.rid, None)
            paths.forget(req.rid)
            self.metrics.pool_used.set(self.pool.allocator.used_bytes)
            ok = req.state is TxState.COMPLETE
            self.metrics.requests.labels("complete" if ok else "failed").inc()
            if ok:
                self.completed += 1
                self.metrics.transfer_seconds.observe(req.t_done - req.created)
                if req.t_last_handed:
                    self.metrics.tail_seconds.observe(req.t_done - req.t_last_handed)
                log.info(
                    "request %s delivered: %d bytes in %.3fs, tail %.1f ms, %d resent",
                    req.rid,
                    req.begin.total_bytes,
                    req.t_done - req.created,
                    (req.t_done - req.t_last_handed) * 1e3,
                    req.resent,
                )
            else:
                self.failed += 1
                code = req.code or ResultCode.FAILED
                log.warning("request %s failed: %s: %s", req.rid, code.value, req.why)
            outcome = Outcome(
                rid=req.rid,
                ok=ok,
                code="" if ok else (req.code or ResultCode.FAILED).value,
                error=req.why,
                bytes=req.begin.total_bytes,
                elapsed_s=(req.t_done or trio.current_time()) - req.created,
                tail_s=(req.t_done - req.t_last_handed) if ok and req.t_last_handed else None,
                resent_chunks=req.resent,
            )
            owner = req.owner
            if isinstance(owner, _PrefillEngine):
                with trio.move_on_after(1.0) as scope:
                    scope.shield = True
                    await owner.push(outcome_event(outcome))
        finally:
            self._outcomes_owed -= 1

    def maybe_free_layer(self, req: TxRequest, layer: int) -> None:
        """Return a layer's buffer once no chunk of it can be needed again (the receiver holds
        the layer, or the request ended) and nothing still reads it."""
        base = req.layer_slot[layer]
        if base is None or (req.rid, layer) in self.reading:
            return
        path = self.path(req)
        if req.live and not path.layer_done(req, layer):
            return
        if path.busy(req, layer):
            return  # the path asks again when it stops reading (rdma_batch_done)
        req.layer_slot[layer] = None
        self.pool.free(base)
        self.metrics.pool_used.set(self.pool.allocator.used_bytes)

    def fail(self, rid: str, code: ResultCode, message: str, *, notify: bool = True) -> None:
        self._apply(self.book.fail(rid, code, message, notify=notify))

    def _complete(self, req: TxRequest) -> None:
        """Every layer handed over and every byte confirmed by the receiver."""
        self._apply(self.book.complete(req, trio.current_time()))

    def _apply(self, effects: list[TxEffect]) -> None:
        """Carry out what the book decided, in order."""
        for e in effects:
            req = e.req
            if isinstance(e, Give):
                self.path(req).give(req, e.layer)
            elif isinstance(e, TellEnd):
                self._tell_peer(req, End(req.rid))
            elif isinstance(e, LayerAcked):
                self.maybe_free_layer(req, e.layer)
            elif isinstance(e, Accepted):
                self.waits[req.rid].accepted.set()
                path = self._paths(req).accepted(req)
                for layer in range(len(req.handed)):
                    path.give(req, layer)
            elif isinstance(e, Completed):
                self.waits[req.rid].done.set()
            elif isinstance(e, Failed):
                self._failed(req, e.notify)

    def _failed(self, req: TxRequest, notify: bool) -> None:
        self.waits[req.rid].done.set()
        cancel = self._paths(req).failed(req, notify)
        if cancel is not None:
            self._tell_peer(req, cancel)

    def _tell_peer(self, req_or_peer: TxRequest | PeerLink, ev: Event) -> None:
        """Send a notice (CANCEL, END, RDMA_CLOSE) on any live connection, in the background;
        best effort, since the protocol never depends on it arriving."""
        peer = req_or_peer if isinstance(req_or_peer, PeerLink) else req_or_peer.peer
        assert isinstance(peer, PeerLink)
        slot = peer.live[0] if peer.live else None
        if slot is not None and slot.wire is not None and self._nursery is not None:
            self._notifying += 1  # counted from now: a shutdown waits for it to go out
            self._nursery.start_soon(self._notify, slot.wire, ev)

    async def _notify(self, wire: Any, ev: Event) -> None:
        try:
            await wire.send_quietly(ev, timeout=2.0)
        finally:
            self._notifying -= 1

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
                    "session": p.session,
                    "live_connections": len(p.live),
                    # what carries the live connections' frames: {"sealed/aegis-128l": 8}
                    "records": dict(Counter(s.wire.records for s in p.live if s.wire)),
                    "queued_chunks": len(p.queue),
                    "unacked_chunks": sum(len(s.unacked) for s in p.slots),
                    # declined by the receiver for now (busy), waiting to be resent
                    "deferred_chunks": p.deferred_chunks,
                    "connects": sum(s.connects for s in p.slots),
                    "pacing_bps": p.pacing_bps,
                    "link": p.monitor.status(),
                    "rdma": p.rdma.status()
                    if p.rdma is not None
                    else {"backend": "tcp", "reason": "rdma disabled in local config"},
                }
                for p in self.peers.values()
            },
            "requests": {rid: r.state.value for rid, r in self.requests.items()},
            # per request, the bytes the data path has been given: what an engine handed over
            # as final and whole chunks (a partly final chunk waits for the rest of its bytes)
            "queued_bytes": {rid: sum(r.queued_upto) for rid, r in self.requests.items()},
            # the default peer's link state, for `xdc monitor`
            "link": self.peer(None).monitor.status() if self._nursery is not None else {},
            "completed": self.completed,
            "failed": self.failed,
            # worker processes moving payloads (sender.data_workers), if any
            "data_workers": self.data_workers.status() if self.data_workers else None,
            "pool": {"capacity": a.capacity, "used": a.used_bytes, "allocations": a.allocations},
            "time": time.time(),
        }


class _PrefillEngine:
    """One prefill engine's connection: the requests it began are its own (another
    connection can neither fill nor cancel them), and fail if it vanishes before handing all
    their layers over (it never could any more)."""

    def __init__(self, sender: Sender, chan: TrioChannel) -> None:
        self.sender = sender
        self.chan = chan

    async def push(self, frame: bytes) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self.chan.send(frame)

    async def handle(self, request: Request) -> dict[str, Any]:
        sender = self.sender
        if isinstance(request, EngineHello):
            return pool_hello(sender.pool, request.pool_fd, chunk_bytes=sender.sc.chunk_bytes)
        if isinstance(request, Admit):
            return sender.admit(request.peer)
        if isinstance(request, BeginRequest):
            return {"rid": sender.begin(request, self).rid}
        if isinstance(request, Alloc):
            # the first layer is waited for (backpressure); the rest, a look-ahead that
            # saves the engine round trips, are taken only if they fit right now
            first, *ahead = request.layers
            offsets = {first: await sender.alloc_layer(self, request.rid, first)}
            for extra in ahead:
                off = sender.try_alloc_layer(self, request.rid, extra)
                if off is None:
                    break
                offsets[extra] = off
            return {"offset": offsets[first], "offsets": list(offsets.items())}
        if isinstance(request, Ready):
            sender.layer_ready(self, request.rid, request.layer, request.upto)
            return {}
        if isinstance(request, CancelRequest):
            req = sender.requests.get(request.rid)
            if req is not None and req.owner is not self:
                raise TransferError(ResultCode.NOT_OWNER, f"request {request.rid} is another's")
            # cancelling what already ended (or never was) is not an error: it is over
            sender.fail(request.rid, ResultCode.CANCELLED, request.reason or "cancelled")
            return {}
        if isinstance(request, Status):
            return sender.status()
        raise TransferError(ResultCode.BAD_OP, f"{type(request).__name__} is not served here")

    def closed(self) -> None:
        # an engine that vanished can never hand over its missing layers
        self.sender._apply(self.sender.book.engine_gone(self))


async def _wait_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


RequestFailed = TransferError  # what the sender raises for an engine to see

__all__ = ["ConnSlot", "PeerLink", "RequestFailed", "Sender", "Work"]
