"""A sender daemon's RDMA link to one receiver: selection, QP exchange, the writer, fallback.

The peer's TCP connections stay up and carry everything but the bytes: the offer and answer
(QP info) go over an authenticated data connection, the receiver's GRANT for each request
arrives just before its ACCEPT, and NACK / LAYER_DONE / COMPLETE come back as on TCP. Only
the chunk payloads move by RDMA WRITE_WITH_IMM, straight from the sender's pool into the
receiver's. Anything that goes wrong (no pyverbs, no device, another domain, setup failure,
an error completion, a stall, the receiver closing its side) leaves the peer on TCP, with the
unconfirmed chunks of every request resent there; nothing fails because RDMA did.

One attempt per receiver session: after a failure the peer stays on TCP until the receiver
restarts, because a link that just failed is likely to fail again and TCP is correct.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.imm import ImmCodec, sum_slots
from xdc.transport.rdma.qpinfo import (
    QpInfo,
    QpInfoError,
    SlotGrant,
    decode_grant,
    decode_qpinfo,
    encode_qpinfo,
)
from xdc.transport.rdma.select import Backend, DeviceProbe, VerbsFactory, select_backend
from xdc.transport.rdma.session import RdmaSender
from xdc.transport.rdma.verbs import Access, Mr, RdmaLinkError, RdmaUnavailable, VerbsError
from xdc.transport.rdma.writer import RdmaWriter
from xdc.transport.wire import PeerClosed

from xdc.config import RdmaConfig
from xdc.protocol import Begin, Event, ProtocolError, RdmaAnswer, RdmaClose, RdmaOffer
from xdc.protocol.books.grid import ChunkGrid

log = logging.getLogger("xdc.rdma")

MAX_UNANSWERED = 3


class _ClosedEarly(Exception):
    """The receiver closed the queue pair of our offer before its answer reached us."""


# the data connection carrying the offer went away under it
LOST = (OSError, PeerClosed, ProtocolError, trio.ClosedResourceError, trio.BrokenResourceError)

# (rid, [(layer, offset, length)] not confirmed, layers the receiver reported done)
Fallback = Callable[[str, list[tuple[int, int, int]], set[int]], Awaitable[None]]


class ControlWire(Protocol):
    """The one thing this module needs of a data connection: send a frame on it."""

    async def send(self, event: Event) -> None: ...


class PeerRdma:
    """RDMA state of one sender -> receiver link; owned by the sender's PeerLink."""

    def __init__(
        self,
        peer_name: str,
        settings: RdmaConfig,
        pool: memoryview,
        pool_name: str,
        verbs_factory: VerbsFactory,
        devices: DeviceProbe,
        fallback: Fallback,
        on_batch: Callable[[], None],
    ) -> None:
        self.peer_name = peer_name
        self.settings = settings
        self.pool = pool
        self.pool_name = pool_name
        self._verbs_factory = verbs_factory
        self._devices = devices
        self._fallback = fallback
        self._on_batch = on_batch
        self.backend = Backend.TCP
        self.reason = "not negotiated yet"
        self.tried_session: str | None = None
        self.ep: RdmaEndpoint | None = None
        self.writer: RdmaWriter | None = None
        self.sender: RdmaSender | None = None
        self.remote: QpInfo | None = None
        self._pool_mr: Mr | None = None
        self._answers_tx, self._answers_rx = trio.open_memory_channel[RdmaAnswer](1)
        self._placed = trio.Event()  # set after every batch of send completions
        self.fallbacks = 0
        self.bytes_written = 0
        self.unanswered = 0  # offers that got no answer (a lost connection, a slow peer)
        # RDMA_CLOSEs that came while an offer was out: one may overtake its own answer
        self._early_closes: deque[int] = deque(maxlen=16)
        self._offered_to: str | None = None

    @property
    def active(self) -> bool:
        return self.backend is Backend.RDMA and self.writer is not None

    def status(self) -> dict[str, object]:
        return {
            "backend": self.backend.value,
            "reason": self.reason,
            "inflight_writes": self.writer.inflight if self.writer else 0,
            "bytes_written": self.bytes_written + (self.writer.bytes_placed if self.writer else 0),
            "fallbacks": self.fallbacks,
        }

    # --- negotiation ------------------------------------------------------------------------

    def local_choice(self) -> tuple[Backend, str, str]:
        """(backend, reason, device) from our side alone: we cannot know the peer's domain
        before it answers, so an offer is made whenever *we* could use RDMA."""
        devices, why = self._devices() if self.settings.enabled else ([], "")
        backend, reason = select_backend(self.settings, self.settings.domain or None, devices)
        if backend is Backend.TCP:
            return backend, f"{reason}: {why}" if why and not devices else reason, ""
        return backend, reason, self.settings.device or devices[0]

    def on_answer(self, answer: RdmaAnswer) -> None:
        """From the peer's reader task; an unsolicited answer is dropped."""
        try:
            self._answers_tx.send_nowait(answer)
        except trio.WouldBlock:
            log.warning("peer %s: unexpected RDMA_ANSWER ignored", self.peer_name)

    async def negotiate(self, wire: ControlWire, session: str, timeout: float) -> bool:
        """Offer RDMA to the receiver session ``session``; True when the QPs are connected.
        After a refusal or failure ``tried_session`` stays set (no new offer to it); after an
        offer that went unanswered it is cleared, so the caller may offer again."""
        if session != self._offered_to:
            self._offered_to, self.unanswered = session, 0
        self.tried_session = session
        backend, reason, device = self.local_choice()
        if backend is Backend.TCP:
            self._stay_tcp(reason)
            return False
        try:
            verbs = self._verbs_factory()
            ep = RdmaEndpoint(verbs, device, self.settings)
        except (RdmaUnavailable, VerbsError) as exc:
            self._stay_tcp(f"rdma setup on {device} failed: {exc}")
            return False
        try:
            pool_mr = ep.register("pool", self.pool, Access.LOCAL_WRITE)
            staging = memoryview(bytearray(8 * self.settings.max_inflight))
            staging_mr = ep.register("staging", staging, Access.LOCAL_WRITE)
            local = ep.local_info(self.pool_name)
            offer = RdmaOffer(self.settings.domain, encode_qpinfo(local))
            while True:  # drop a stale answer to an earlier, timed-out offer
                try:
                    self._answers_rx.receive_nowait()
                except trio.WouldBlock:
                    break
            self._early_closes.clear()  # closes of older pairs say nothing about this one
            with trio.fail_after(timeout):
                await wire.send(offer)
                while True:
                    answer = await self._answers_rx.receive()
                    if answer.offer_qp in (0, local.qp_num):  # 0: a peer that does not say
                        break
                    log.info(
                        "peer %s: late RDMA_ANSWER to offer %#x ignored (this offer is %#x)",
                        self.peer_name,
                        answer.offer_qp,
                        local.qp_num,
                    )
            if not answer.info:
                raise RdmaUnavailable(f"receiver: {answer.reason}")
            remote = decode_qpinfo(answer.info)
            if remote.rkey == 0 or remote.length == 0:
                raise QpInfoError("receiver answered without a registered pool")
            if remote.qp_num in self._early_closes:
                # its RDMA_CLOSE overtook its answer: the pair is gone already
                raise _ClosedEarly(f"the receiver closed queue pair {remote.qp_num:#x} first")
            ep.connect(remote)
        except (
            RdmaUnavailable,
            VerbsError,
            QpInfoError,
            trio.TooSlowError,
            _ClosedEarly,
            *LOST,
        ) as exc:
            ep.close()
            if isinstance(exc, (trio.TooSlowError, _ClosedEarly, *LOST)):
                # the connection carrying the offer may have died: offer again, a few times
                self.unanswered += 1
                if self.unanswered < MAX_UNANSWERED:
                    self.tried_session = None
                why = f"no answer to the rdma offer ({self.unanswered} tries): {exc or 'timeout'}"
            else:
                why = str(exc)
            self._stay_tcp(why)
            return False
        except BaseException:
            ep.close()
            raise
        self.ep, self.remote, self._pool_mr = ep, remote, pool_mr
        self.writer = RdmaWriter(
            pool_mr, staging, staging_mr, remote.rkey, self.settings.max_inflight
        )
        self.sender = RdmaSender(ep, self.writer, self._batch_done)
        self.unanswered = 0
        self.backend = Backend.RDMA
        self.reason = f"same domain {self.settings.domain!r}, device {device}"
        log.info("peer %s: using rdma (%s)", self.peer_name, self.reason)
        return True

    def _stay_tcp(self, reason: str) -> None:
        self.backend, self.reason = Backend.TCP, reason
        log.info("peer %s: using tcp (%s)", self.peer_name, reason)

    # --- data path ----------------------------------------------------------------------------

    def accept_grant(self, begin: Begin, data: bytes) -> SlotGrant | None:
        """Decode the receiver's grant for a request; None (-> TCP) if it does not fit."""
        remote = self.remote
        if not self.active or remote is None:
            return None
        try:
            grant = decode_grant(data)
        except QpInfoError as exc:
            log.warning(
                "peer %s: bad grant for %s (%s); sending it by tcp", self.peer_name, begin.rid, exc
            )
            return None
        lo, hi = remote.addr, remote.addr + remote.length
        chunks = ChunkGrid.of(begin).count
        sums = 8 * sum_slots(chunks, grant.verify_every)
        codec = ImmCodec()
        if (
            grant.slot >= codec.max_slots
            or chunks > codec.max_chunks
            or grant.rid != begin.rid
            or grant.length != begin.total_bytes
            or not lo <= grant.addr <= grant.addr + grant.length <= hi
            or (sums and not lo <= grant.sums_addr <= grant.sums_addr + sums <= hi)
        ):
            log.warning(
                "peer %s: grant %s does not fit the receiver's pool or our immediates; using tcp",
                self.peer_name,
                grant,
            )
            return None
        return grant

    def add(self, begin: Begin, grant: SlotGrant) -> None:
        assert self.writer is not None
        self.writer.add(begin, grant)

    def layer_ready(self, rid: str, layer: int, pool_offset: int | None, size: int) -> None:
        """Hand a layer that sits at ``pool_offset`` in the send pool to the writer."""
        assert self.writer is not None and self._pool_mr is not None and self.sender is not None
        if pool_offset is None:  # an empty layer has no buffer
            src, addr = self.pool[0:0], self._pool_mr.addr
        else:
            src = self.pool[pool_offset : pool_offset + size]
            addr = self._pool_mr.addr + pool_offset
        self.writer.layer_ready(rid, layer, src, addr)
        self.sender.wake()

    def on_nack(self, rid: str, layer: int, offset: int) -> bool:
        """True when the chunk will be written again."""
        if self.writer is None or self.sender is None:
            return False
        try:
            if not self.writer.on_nack(rid, layer, offset):
                log.warning(
                    "peer %s: NACK of %s layer %d offset %d names no chunk to rewrite; ignored",
                    self.peer_name,
                    rid,
                    layer,
                    offset,
                )
                return False
        except RdmaLinkError as exc:
            self.sender.abort(str(exc))
            return False
        self.sender.wake()
        return True

    def on_layer_done(self, rid: str, layer: int) -> None:
        if self.writer is not None:
            self.writer.on_layer_done(rid, layer)

    def stop(self, rid: str) -> None:
        """The request ended (complete or failed): post nothing more for it."""
        if self.writer is not None:
            self.writer.on_complete(rid)

    def layer_written(self, rid: str, layer: int) -> bool:
        """Every chunk of the layer was placed by a completed WRITE (a LAYER_DONE before
        that is a lie or a bug, and must not free a buffer still to be read)."""
        req = self.writer.requests.get(rid) if self.writer is not None else None
        if req is None:
            return True  # not ours (any more): the caller's other checks decide
        return all(i in req.placed for i in req.chunks.layer_indices(layer))

    def layer_busy(self, rid: str, layer: int) -> bool:
        return self.writer is not None and self.writer.layer_busy(rid, layer)

    async def drained(self, rid: str) -> None:
        """Until no WRITE of ``rid`` is in flight (after a teardown there are none)."""
        while self.writer is not None and self.writer.busy(rid):
            await self._placed.wait()

    def _batch_done(self) -> None:
        self._placed.set()
        self._placed = trio.Event()
        self._on_batch()

    def close_on_peer(self, reason: str, qp_num: int | None = None) -> None:
        """Fail the link so requests move to TCP: the receiver's RDMA_CLOSE of the QP we are
        connected to (one naming another QP is late, from a pair already gone: ignored), or
        our own decision (``qp_num`` None)."""
        if self.sender is None or self.remote is None:
            if qp_num is not None:  # negotiating: the answer it goes with may still come
                self._early_closes.append(qp_num)
            return
        if qp_num is not None and qp_num != self.remote.qp_num:
            log.info(
                "peer %s: RDMA_CLOSE for queue pair %#x ignored (ours is %#x)",
                self.peer_name,
                qp_num,
                self.remote.qp_num,
            )
            return
        self.sender.abort(f"receiver closed rdma: {reason}" if qp_num else reason)

    async def run(self, tell_peer: Callable[[Event], None]) -> None:
        """Drive the writer until the link fails; then fall back and tell the receiver."""
        sender, ep, writer = self.sender, self.ep, self.writer
        assert sender is not None and writer is not None and ep is not None and ep.qp is not None
        own_qpn = ep.qp.qp_num
        try:
            await sender.run(forever=True)
            return  # only on cancellation of the whole daemon
        except (RdmaLinkError, VerbsError) as exc:
            why = str(exc)
        log.warning("peer %s: rdma link failed (%s); continuing on tcp", self.peer_name, why)
        self.fallbacks += 1
        # the QP is destroyed before TCP fills the same cells, so no late WRITE lands after
        self.backend, self.reason = Backend.TCP, f"rdma link failed: {why}"
        self.bytes_written += writer.bytes_placed
        try:
            ep.close()
        except Exception as exc:
            log.warning("peer %s: rdma teardown: %s", self.peer_name, exc)
        try:
            for rid in writer.abandon():
                req = writer.requests[rid]
                await self._fallback(rid, writer.unconfirmed(rid), set(req.layers_done))
        finally:
            writer.clear()
            self.writer = self.sender = None
            self.ep = self.remote = self._pool_mr = None
            self._batch_done()  # wake drain waiters: nothing is in flight any more
        tell_peer(RdmaClose(own_qpn, why))

    def close(self) -> None:
        """Daemon shutdown: destroy the QP and deregister everything."""
        writer, ep = self.writer, self.ep
        self.writer = self.sender = None
        self.ep = self.remote = self._pool_mr = None
        self.backend, self.reason = Backend.TCP, "closed"
        try:
            if ep is not None:
                ep.close()
        finally:
            if writer is not None:
                writer.clear()
            self._placed.set()  # drain waiters: nothing can be in flight any more
