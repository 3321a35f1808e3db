"""A receiver daemon's RDMA side of one sender session: answer the offer, grant slots, land.

The receive pool is registered (REMOTE_WRITE) for the session's queue pair, so a sender can
WRITE into it; what keeps that safe is bookkeeping, not trust:

- a request is writable only through its slot, granted at ACCEPT for exactly its buffer; a
  write naming another slot or chunk is refused by the LandingZone and never counted;
- a request that *fails* while its sender may still have WRITEs in flight is quarantined (the
  receive lifecycle's RDMA hold): its buffer is not reused until the sender says it stopped
  (CANCEL, sent after its writes drained), the session's queue pair is destroyed, or a
  timeout destroys it;
- every path out (link error, RDMA_CLOSE, the sender's connections gone, shutdown) destroys
  the QP and deregisters the pool before the buffers it covered are freed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.landing import LandingZone
from xdc.transport.rdma.qpinfo import QpInfoError, decode_qpinfo, encode_grant, encode_qpinfo
from xdc.transport.rdma.select import Backend, DeviceProbe, VerbsFactory, choose_backend
from xdc.transport.rdma.session import RdmaReceiver
from xdc.transport.rdma.verbs import RdmaLinkError, RdmaUnavailable, VerbsError

from xdc.config import RdmaConfig
from xdc.protocol import Begin, Event, ProtocolError, RdmaAnswer, RdmaOffer, ReceiveTracker

log = logging.getLogger("xdc.rdma")


@dataclass(eq=False)
class SessionRdma:
    session: str
    peer_id: str
    ep: RdmaEndpoint
    zone: LandingZone
    settings: RdmaConfig
    slots: dict[str, int] = field(default_factory=dict)  # rid -> granted slot
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    closed: bool = False
    chunks_landed: int = 0
    bytes_landed: int = 0
    remote_qp_num: int = 0  # the sender's QP we are connected to (what its RDMA_CLOSE names)

    @property
    def qp_num(self) -> int:
        """Our QP of the pair: what RDMA_CLOSE names, both ways."""
        return self.ep.qp.qp_num if self.ep.qp is not None else 0

    def sums_bytes(self, begin: Begin) -> int:
        """Pool bytes to allocate after a request for its sampled-checksum table."""
        return LandingZone.sums_bytes(begin, self.settings.verify_every)

    def grant(self, tracker: ReceiveTracker, offset: int) -> bytes | None:
        """A slot for an accepted request at ``offset`` (its checksum table right after it);
        None when the request cannot go by RDMA (it then simply arrives over TCP)."""
        if self.closed:
            return None
        begin = tracker.begin
        try:
            grant = self.zone.grant(
                tracker, offset, offset + begin.total_bytes, self.settings.verify_every
            )
        except (ProtocolError, ValueError) as exc:
            log.info("rdma: %s goes by tcp: %s", begin.rid, exc)
            return None
        self.slots[begin.rid] = grant.slot
        return encode_grant(grant)

    def release(self, rid: str) -> None:
        """The request needs no more writes (complete, or its sender confirmed it stopped)."""
        slot = self.slots.pop(rid, None)
        if slot is not None:
            self.zone.release(slot)

    async def run(self, on_event: Callable[[Event], Awaitable[None]]) -> str | None:
        """Land writes until cancelled (None) or the link fails (the reason)."""
        receiver = RdmaReceiver(self.ep, self.zone)
        try:
            await receiver.run(on_event)
        except (RdmaLinkError, VerbsError) as exc:
            return str(exc)
        return None

    def close(self) -> None:
        """Destroy the QP and deregister the pool; afterwards no write can land."""
        if self.closed:
            return
        self.closed = True
        self.scope.cancel()
        for slot in list(self.zone.slots):
            self.zone.release(slot)
        self.slots.clear()
        self.ep.close()

    def status(self) -> dict[str, object]:
        return {
            "peer": self.peer_id,
            "granted": len(self.slots),
            "stale_writes": self.zone.stale_writes,
            "landed_chunks": self.chunks_landed,
            "landed_bytes": self.bytes_landed,
        }


def answer_offer(
    settings: RdmaConfig,
    offer: RdmaOffer,
    session: str,
    peer_id: str,
    pool: memoryview,
    pool_name: str,
    verbs_factory: VerbsFactory,
    devices: DeviceProbe,
) -> tuple[SessionRdma | None, RdmaAnswer]:
    """Decide, set up and connect our side, or say why not. Logs the one selection line."""
    found, why = devices() if settings.enabled else ([], "")
    backend, reason = choose_backend(settings, peer_id, offer.domain, found)
    try:  # which offer this answers: the sender drops answers to offers it gave up on
        offer_qp = decode_qpinfo(offer.info).qp_num
    except QpInfoError:
        offer_qp = 0
    if backend is Backend.TCP:
        if why and not found and settings.enabled:
            reason = f"{reason}: {why}"
        return None, RdmaAnswer(settings.domain, b"", reason, offer_qp)
    device = settings.device or found[0]
    ep: RdmaEndpoint | None = None
    try:
        remote = decode_qpinfo(offer.info)
        ep = RdmaEndpoint(verbs_factory(), device, settings)
        pool_mr = ep.register("pool", pool)
        ep.connect(remote)
        zone = LandingZone(pool, pool_mr.addr)
        sess = SessionRdma(session, peer_id, ep, zone, settings, remote_qp_num=remote.qp_num)
        ep.fill_receives()
        info = encode_qpinfo(ep.local_info(pool_name, pool_mr))
    except (RdmaUnavailable, VerbsError, QpInfoError) as exc:
        if ep is not None:
            ep.close()
        reason = f"rdma setup on {device} failed: {exc}"
        log.warning("peer %s: using tcp (%s)", peer_id, reason)
        return None, RdmaAnswer(settings.domain, b"", reason, offer_qp)
    except BaseException:
        if ep is not None:
            ep.close()
        raise
    return sess, RdmaAnswer(settings.domain, info, "", offer_qp)
