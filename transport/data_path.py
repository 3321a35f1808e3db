"""How an accepted request's bytes reach the receiver: one interface, two paths.

The request lifecycle (``xdc.protocol.books.send``) is the same whichever way the bytes
go; what differs is only what handing a layer to the path means, when a layer's buffer may be
reused, and what stopping means. The sender asks its request's path and never branches on it.

- :class:`TcpPath`: chunk-grid cells go into the peer's striping queue as soon as they lie
  wholly in a layer's final part; the receiver ACKs each verified cell; a layer's buffer is
  reusable once every cell of it is acked (or the request ended) and no ``sendmsg`` still
  reads it.
- :class:`RdmaPath`: a whole layer, once handed over, goes to the peer's RDMA writer
  (WRITE_WITH_IMM straight into the receiver's pool, under the receiver's GRANT); the
  receiver confirms layers (LAYER_DONE) and the request (COMPLETE); a buffer is reusable once
  its layer is confirmed and no WRITE still reads it. A request that fails is CANCELled only
  after its WRITEs drained, so the receiver may reuse its buffer at once.

All per-request RDMA bookkeeping (grants, confirmed layers, frees waiting for completions)
lives in the RdmaPath, not on the request.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from xdc.protocol import Begin, Cancel
from xdc.protocol.books.send import TxRequest, TxState

if TYPE_CHECKING:
    from xdc.transport.peer_link import PeerLink, Work
    from xdc.transport.rdma.peer_sender import PeerRdma
    from xdc.transport.rdma.qpinfo import SlotGrant

log = logging.getLogger("xdc.sender")


class DataPath(Protocol):
    """What the sender does with an accepted request's bytes and with what the receiver says
    about them. Every method is the path's own business: the sender calls the request's path
    and never asks which one it is."""

    name: str

    def give(self, req: TxRequest, layer: int) -> None:
        """The layer has new final bytes (``req.ready_upto``); send what may go."""

    def layer_done(self, req: TxRequest, layer: int) -> bool:
        """Whether the receiver holds the whole layer (its buffer is not needed for it)."""

    def busy(self, req: TxRequest, layer: int) -> bool:
        """Whether the path is still reading the layer's buffer (the path remembers to say
        so again when it stops: ``PeerPaths.frees_due``)."""

    def nacked(
        self, req: TxRequest, layer: int, offset: int, work: Work | None, retry_after_ms: int
    ) -> bool:
        """The receiver rejected a chunk (``work``: the one sent, if still wanted; a
        ``retry_after_ms`` > 0: not now, later): whether the path sends it again (a resend to
        count)."""

    def confirmed(self, req: TxRequest, layer: int) -> bool:
        """LAYER_DONE arrived: whether it now counts as the layer being held."""

    def peer_complete(self, req: TxRequest) -> bool:
        """COMPLETE arrived: whether that ends the request as delivered."""

    def stop(self, req: TxRequest) -> None:
        """The request ended: send nothing more of it."""

    async def drained(self, req: TxRequest, stall_s: float) -> None:
        """Until nothing of the request is in flight on this path."""


MAX_BUSY_RESEND_DELAY_S = 1.0


def busy_resend_delay_s(retry_after_ms: int, declined: int) -> float:
    """How long to hold a chunk the receiver declined as busy, ``declined`` times before:
    its own hint, doubled for each earlier decline, at most ``MAX_BUSY_RESEND_DELAY_S``.
    While every scratch buffer is held by a slow read, an immediate resend only crosses the
    link again to be declined again (2,872 resends in 30 s in one such run)."""
    return min(MAX_BUSY_RESEND_DELAY_S, retry_after_ms / 1e3 * 2.0 ** min(declined, 16))


class TcpPath:
    name = "tcp"

    def __init__(self, peer: PeerLink, work: type[Work], reading: Callable[[str, int], bool]):
        self.peer = peer
        self._work = work
        self._reading = reading  # (rid, layer) still inside a sendmsg

    def give(self, req: TxRequest, layer: int) -> None:
        start, upto = req.queued_upto[layer], req.ready_upto[layer]
        if start >= upto:
            return
        cells = req.tracker.grid.cells_within(layer, start, upto)
        if cells:
            off, n = cells[-1]
            req.queued_upto[layer] = off + n
            self.peer.enqueue([self._work(req.rid, layer, o, ln) for o, ln in cells])

    def layer_done(self, req: TxRequest, layer: int) -> bool:
        return req.tracker.layer_acked(layer)

    def busy(self, req: TxRequest, layer: int) -> bool:
        return self._reading(req.rid, layer)

    def nacked(
        self, req: TxRequest, layer: int, offset: int, work: Work | None, retry_after_ms: int
    ) -> bool:
        if work is None:
            return False
        if retry_after_ms > 0:
            delay = busy_resend_delay_s(retry_after_ms, work.busy_nacks)
            again = dataclasses.replace(work, busy_nacks=work.busy_nacks + 1, copy=True)
            self.peer.defer(again, delay)
        else:
            self.peer.enqueue([dataclasses.replace(work, copy=True)], front=True)
        return True

    def confirmed(self, req: TxRequest, layer: int) -> bool:
        return False  # informational: the ACKs of verified chunks decide

    def peer_complete(self, req: TxRequest) -> bool:
        return False  # informational: the ACKs decide

    def stop(self, req: TxRequest) -> None:
        pass  # queued chunks of an ended request are skipped by the writers

    async def drained(self, req: TxRequest, stall_s: float) -> None:
        pass  # a buffer under sendmsg is freed by the writer when the send returns


@dataclass
class _RdmaRequest:
    grant: SlotGrant | None = None  # usable grant of the current BEGIN
    qpn: int = 0  # the receiver QP the grant was made under (only good there)
    done: set[int] = field(default_factory=set)  # layers the receiver confirmed
    writing: bool = False  # the writer has it (its path is RDMA)


class RdmaPath:
    """The RDMA side of one peer: which requests were granted, which go by RDMA, and what
    the receiver confirmed. A granted request that goes by TCP still needs a CANCEL when it
    fails: the receiver holds its buffer for RDMA safety until told no WRITE is coming."""

    name = "rdma"

    def __init__(self, peer: PeerLink, rdma: PeerRdma, tcp: TcpPath) -> None:
        self.peer = peer
        self.rdma = rdma
        self.tcp = tcp
        self.reqs: dict[str, _RdmaRequest] = {}
        # layers whose buffer may go once the NIC has finished reading it (after completions)
        self.free_wait: set[tuple[str, int]] = set()

    # --- the grant, before ACCEPT ------------------------------------------------------------

    def begin_sent(self, rid: str) -> None:
        """A (re-)sent BEGIN: a grant is only good with the ACCEPT of its own session."""
        self.reqs.pop(rid, None)

    def granted(self, begin: Begin, data: bytes) -> None:
        st = self.reqs.setdefault(begin.rid, _RdmaRequest())
        st.grant = self.rdma.accept_grant(begin, data)
        st.qpn = self.rdma.remote.qp_num if self.rdma.remote is not None else 0

    def was_granted(self, rid: str) -> bool:
        return rid in self.reqs

    def take(self, req: TxRequest) -> bool:
        """At ACCEPT: whether the request goes by RDMA (a usable grant of the live pair)."""
        st = self.reqs.get(req.rid)
        remote = self.rdma.remote
        if (
            st is None
            or st.grant is None
            or not self.rdma.active
            or remote is None
            or remote.qp_num != st.qpn  # a grant of a pair since replaced
        ):
            return False
        st.writing = True
        self.rdma.add(req.begin, st.grant)
        return True

    def writing(self, rid: str) -> bool:
        st = self.reqs.get(rid)
        return st is not None and st.writing

    # --- DataPath ----------------------------------------------------------------------------

    def give(self, req: TxRequest, layer: int) -> None:
        size = req.begin.layer_sizes[layer]
        if req.handed[layer] and req.queued_upto[layer] < size:
            req.queued_upto[layer] = size
            self.rdma.layer_ready(req.rid, layer, req.layer_slot[layer], size)

    def layer_done(self, req: TxRequest, layer: int) -> bool:
        st = self.reqs.get(req.rid)
        return st is not None and layer in st.done

    def busy(self, req: TxRequest, layer: int) -> bool:
        key = (req.rid, layer)
        if self.rdma.layer_busy(req.rid, layer):
            self.free_wait.add(key)  # the NIC still reads it: ask again after completions
            return True
        self.free_wait.discard(key)
        return False

    def nacked(
        self, req: TxRequest, layer: int, offset: int, work: Work | None, retry_after_ms: int
    ) -> bool:
        return self.rdma.on_nack(req.rid, layer, offset)  # the bytes the NIC wrote were wrong

    def confirmed(self, req: TxRequest, layer: int) -> bool:
        return self.confirm_layer(req, layer)

    def peer_complete(self, req: TxRequest) -> bool:
        if req.state is not TxState.SENDING or not req.all_handed:
            return False
        self.stop(req)
        return True

    def stop(self, req: TxRequest) -> None:
        self.rdma.stop(req.rid)

    async def drained(self, req: TxRequest, stall_s: float) -> None:
        """A buffer must not be freed under a WRITE: wait (shielded) for the request's
        WRITEs; a stall ends the link, which also ends every WRITE."""
        with trio.move_on_after(stall_s) as scope:
            scope.shield = True
            await self.rdma.drained(req.rid)
        if scope.cancelled_caught:
            self.rdma.close_on_peer(f"writes of {req.rid} did not complete")
            with trio.move_on_after(2.0) as scope2:
                scope2.shield = True
                await self.rdma.drained(req.rid)

    # --- what the receiver says --------------------------------------------------------------

    def confirm_layer(self, req: TxRequest, layer: int) -> bool:
        """LAYER_DONE for an RDMA request: True if the layer now counts as confirmed. One
        before our WRITEs of the layer completed is a lie or a bug, and one before the
        engine handed the layer over would free the engine's own buffer: both ignored."""
        st = self.reqs.get(req.rid)
        if st is None or not st.writing or not 0 <= layer < len(req.handed):
            return False
        if not self.rdma.layer_written(req.rid, layer):
            log.warning("LAYER_DONE for %s layer %d before it was written; ignored", req.rid, layer)
            return False
        if not req.handed[layer]:
            log.warning("LAYER_DONE for %s layer %d before its hand-over; ignored", req.rid, layer)
            return False
        st.done.add(layer)
        self.rdma.on_layer_done(req.rid, layer)
        return True

    def fallback(self, req: TxRequest, done: set[int]) -> None:
        """The link failed under the request: it continues over TCP."""
        st = self.reqs.get(req.rid)
        if st is not None:
            st.writing = False
            st.done |= done

    def cancel_after(self, req: TxRequest) -> Cancel | None:
        """The CANCEL a failed request owes the receiver once nothing of it is in flight."""
        if req.state is TxState.FAILED:
            return Cancel(req.rid, req.why[:200] or "failed")
        return None

    def forget(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self.free_wait = {k for k in self.free_wait if k[0] != rid}


class PeerPaths:
    """The data paths of one peer and which one each of its requests takes: TCP always, RDMA
    when the link has it and the receiver granted the request a slot of the live pair. What
    happens before ACCEPT (grants) and after the end (draining, the CANCEL owed) is decided
    here, so the sender never names a path."""

    def __init__(self, peer: PeerLink, work: type[Work], reading: Callable[[str, int], bool]):
        self.peer = peer
        self.tcp = TcpPath(peer, work, reading)
        self.rdma = RdmaPath(peer, peer.rdma, self.tcp) if peer.rdma is not None else None

    def of(self, req: TxRequest) -> DataPath:
        if self.rdma is not None and self.rdma.writing(req.rid):
            return self.rdma
        return self.tcp

    # --- before ACCEPT -----------------------------------------------------------------------

    def begin_sent(self, rid: str) -> None:
        if self.rdma is not None:
            self.rdma.begin_sent(rid)

    def granted(self, req: TxRequest, grant: bytes) -> None:
        """The receiver offered a slot for RDMA WRITEs (ignored where RDMA is off)."""
        if self.rdma is not None and req.state is TxState.PENDING:
            self.rdma.granted(req.begin, grant)

    def accepted(self, req: TxRequest) -> DataPath:
        """ACCEPT: the request's path is chosen now, once."""
        if self.rdma is not None:
            self.rdma.take(req)
        return self.of(req)

    # --- the end -----------------------------------------------------------------------------

    def failed(self, req: TxRequest, notify: bool) -> Cancel | None:
        """The request failed: the CANCEL to send now, if any. An RDMA request's CANCEL waits
        for its WRITEs (``finished``); one granted but sent by TCP owes a CANCEL even when
        the receiver failed it, since the receiver holds its buffer for RDMA safety until
        told no WRITE is coming."""
        path = self.of(req)
        if path is not self.tcp:
            path.stop(req)
            return None
        if notify or (self.rdma is not None and self.rdma.was_granted(req.rid)):
            return Cancel(req.rid, req.why[:200])
        return None

    async def finished(self, req: TxRequest, stall_s: float) -> Cancel | None:
        """The request ended: wait until nothing of it is in flight; the CANCEL then owed
        (after which the receiver may reuse its buffer)."""
        if self.rdma is None or not self.rdma.writing(req.rid):
            return None
        self.rdma.stop(req)
        await self.rdma.drained(req, stall_s)
        return self.rdma.cancel_after(req)

    def forget(self, rid: str) -> None:
        if self.rdma is not None:
            self.rdma.forget(rid)

    # --- the RDMA link failing or progressing ------------------------------------------------

    def fall_back(self, req: TxRequest, done: set[int]) -> bool:
        """The RDMA link failed under the request: whether it was going by RDMA (and now
        continues over TCP, with the layers the receiver confirmed counting as held)."""
        if self.rdma is None or not self.rdma.writing(req.rid):
            return False
        self.rdma.fallback(req, done)
        return True

    def frees_due(self) -> list[tuple[str, int]]:
        """Layers that waited for the NIC to finish reading them: ask again (completions
        arrived)."""
        return sorted(self.rdma.free_wait) if self.rdma is not None else []

    def state(self, rid: str) -> Any:
        """A request's RDMA bookkeeping (grant, confirmed layers), for status and tests."""
        return self.rdma.reqs.get(rid) if self.rdma is not None else None
