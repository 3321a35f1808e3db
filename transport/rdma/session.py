"""The trio shell around the RDMA cores: completion waiting, the send and receive loops, and
fallback to TCP.

Completions are awaited on the CQ's completion-channel fd with ``trio.lowlevel.wait_readable``
(arm, re-poll to close the race, then sleep on the fd), so the trio loop never blocks and no
thread is needed; where pyverbs does not expose that fd (rdma-core < 59), the CQ is polled
with a backoff instead. Control traffic (NACK, LAYER_DONE, COMPLETE) travels on the existing
TCP connection; this module takes it as a channel of protocol events and an async send
callback, so the daemons can wire whichever connection they authenticated.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from xdc.transport.rdma.endpoint import RdmaEndpoint
from xdc.transport.rdma.landing import LandingZone
from xdc.transport.rdma.qpinfo import MAX_MESSAGE_BYTES as MAX_QPINFO_MESSAGE
from xdc.transport.rdma.qpinfo import QpInfo, QpInfoError, decode_qpinfo, encode_qpinfo
from xdc.transport.rdma.verbs import Completion, Handle, RdmaLinkError, Verbs, VerbsError
from xdc.transport.rdma.writer import RdmaWriter

from xdc.protocol import Complete, Error, Event, LayerDone, Nack, ProtocolError

log = logging.getLogger("xdc.rdma")

POLL_BATCH = 64

# (rid, [(layer, offset, length)]) -> sends those chunks over TCP
TcpResend = Callable[[str, list[tuple[int, int, int]]], Awaitable[None]]


async def next_completions(verbs: Verbs, cq: Handle, timeout: float) -> list[Completion]:
    """The next batch of completions, or [] after ``timeout`` seconds without one."""
    fd = verbs.completion_fd(cq)
    with trio.move_on_after(timeout):
        if fd is None:
            return await _poll_without_channel(verbs, cq)
        while True:
            got = verbs.poll(cq, POLL_BATCH)
            if got:
                await trio.lowlevel.checkpoint()
                return got
            verbs.arm(cq)
            got = verbs.poll(cq, POLL_BATCH)  # one may have landed before the arm
            if got:
                await trio.lowlevel.checkpoint()
                return got
            await trio.lowlevel.wait_readable(fd)
            verbs.consume_event(cq)
    return []


SPIN_POLLS = 64  # yields before backing off to 1 ms sleeps when there is no channel fd


async def _poll_without_channel(verbs: Verbs, cq: Handle) -> list[Completion]:
    """Old pyverbs: no fd to sleep on. Poll, yielding to the other tasks, and back off to
    1 ms sleeps when idle: at most ~1 ms of added latency, no thread, no busy core."""
    spins = 0
    while True:
        got = verbs.poll(cq, POLL_BATCH)
        if got:
            await trio.lowlevel.checkpoint()
            return got
        spins += 1
        if spins < SPIN_POLLS:
            await trio.lowlevel.checkpoint()
        else:
            await trio.sleep(0.001)


MAX_QPINFO_FRAME = 4096


async def exchange_qpinfo(stream: trio.abc.Stream, local: QpInfo) -> QpInfo:
    """Swap QP info over an (already authenticated) stream: 2-byte length + message each way.

    Both sides send first, so the exchange cannot deadlock and costs one round trip.
    """
    data = encode_qpinfo(local)
    await stream.send_all(len(data).to_bytes(2, "big") + data)
    buf = bytearray()
    need = 2
    while len(buf) < need:
        more = await stream.receive_some(MAX_QPINFO_FRAME)
        if not more:
            raise QpInfoError("peer closed the connection during the QP info exchange")
        buf += more
        if need == 2 and len(buf) >= 2:
            need = 2 + int.from_bytes(buf[:2], "big")
            if need - 2 > MAX_QPINFO_MESSAGE:
                raise QpInfoError(f"QP info of {need - 2} bytes is over the limit")
    if len(buf) != need:
        raise QpInfoError("unexpected bytes after the QP info message")
    return decode_qpinfo(bytes(buf[2:]))


class RdmaSender:
    """Drives one connected endpoint's writer: until its requests are complete, or (daemon
    mode, ``forever``) until the link fails or the caller cancels."""

    def __init__(
        self,
        ep: RdmaEndpoint,
        writer: RdmaWriter,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        self.ep = ep
        self.writer = writer
        # called after each batch of send completions (source bytes may be free to reuse)
        self.on_batch = on_batch
        self._wake = trio.Event()
        self._failure: BaseException | None = None
        self._abort: str | None = None
        self._waiting: trio.CancelScope | None = None

    def wake(self) -> None:
        """New work (a layer handed over, a NACK): post more."""
        self._wake.set()

    def abort(self, reason: str) -> None:
        """The peer closed its side (or the daemon gives up): fail ``run`` with RdmaLinkError."""
        self._abort = self._abort or reason
        self._wake.set()
        if self._waiting is not None:
            self._waiting.cancel()

    def layer_ready(self, rid: str, layer: int) -> None:
        self.writer.layer_ready(rid, layer)
        self.wake()

    async def run(
        self, control: trio.abc.ReceiveChannel[Event] | None = None, *, forever: bool = False
    ) -> None:
        """Raises RdmaLinkError/VerbsError if the RC connection fails or stalls for
        ``stall_timeout_s`` with work in flight; the caller falls back to TCP."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._guard, lambda: self._drive(forever), nursery.cancel_scope)
            if control is not None:
                nursery.start_soon(
                    self._guard, lambda: self._control(control), nursery.cancel_scope
                )
        failure, self._failure = self._failure, None  # no traceback kept alive on self
        if failure is not None:
            raise failure

    async def _guard(self, fn: Callable[[], Awaitable[None]], scope: trio.CancelScope) -> None:
        # A failure in either task ends both and surfaces as itself, not an ExceptionGroup.
        try:
            await fn()
        except (RdmaLinkError, VerbsError, ProtocolError) as exc:
            self._failure = self._failure or exc
        scope.cancel()

    def _all_complete(self) -> bool:
        return all(r.complete for r in self.writer.requests.values())

    async def _drive(self, forever: bool) -> None:
        verbs, cq, qp = self.ep.verbs, self.ep.cq, self.ep.qp
        assert cq is not None and qp is not None
        stall = self.ep.settings.stall_timeout_s
        while forever or not self._all_complete():
            if self._abort is not None:
                raise RdmaLinkError(self._abort)
            for wr in self.writer.next_writes():
                verbs.post_write(qp, wr)
            if self.writer.inflight == 0:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            with trio.CancelScope() as self._waiting:
                batch = await next_completions(verbs, cq, stall)
            self._waiting = None
            if self._abort is not None:
                raise RdmaLinkError(self._abort)
            if not batch:
                raise RdmaLinkError(f"no RDMA completion for {stall}s")
            try:
                for c in batch:
                    self.writer.on_completion(c)
            finally:
                if self.on_batch is not None:
                    self.on_batch()

    async def _control(self, control: trio.abc.ReceiveChannel[Event]) -> None:
        async for ev in control:
            if isinstance(ev, Nack):
                self.writer.on_nack(ev.rid, ev.layer, ev.offset)
            elif isinstance(ev, LayerDone):
                self.writer.on_layer_done(ev.rid, ev.layer)
            elif isinstance(ev, Complete):
                self.writer.on_complete(ev.rid)
            elif isinstance(ev, Error):
                raise RdmaLinkError(f"receiver reported error {ev.code}: {ev.message}")
            self.wake()
            if self._all_complete():
                return

    async def run_with_fallback(
        self, control: trio.abc.ReceiveChannel[Event], tcp_resend: TcpResend
    ) -> str:
        """Finish over RDMA, or tear the connection down and resend what is unconfirmed over
        TCP. Returns the backend that finished the job."""
        try:
            await self.run(control)
            return "rdma"
        except (RdmaLinkError, VerbsError, ProtocolError) as exc:
            # str(exc): a log record holding the exception would keep its frames, and through
            # them views of the pool, alive in any handler that stores records
            log.warning("rdma transfer failed (%s); falling back to tcp", str(exc))
        # Destroy the QP first so no late WRITE can land while TCP fills the same cells.
        try:
            self.ep.close()
        except Exception as exc:
            log.warning("rdma teardown after failure: %s", str(exc))
        try:
            for rid in self.writer.abandon():
                await tcp_resend(rid, self.writer.unconfirmed(rid))
        finally:
            self.writer.clear()
        return "tcp"


class RdmaReceiver:
    """Keeps receives posted and turns landed chunks into control events."""

    def __init__(self, ep: RdmaEndpoint, zone: LandingZone) -> None:
        self.ep = ep
        self.zone = zone

    async def run(self, send: Callable[[Event], Awaitable[None]]) -> None:
        """Until cancelled; raises RdmaLinkError when the connection fails (then close the
        endpoint and let the requests finish over TCP: their trackers are unchanged)."""
        verbs, cq = self.ep.verbs, self.ep.cq
        assert cq is not None
        self.ep.fill_receives()
        while True:
            batch = await next_completions(verbs, cq, self.ep.settings.stall_timeout_s)
            for c in batch:
                self.ep.receive_consumed()
                try:
                    events = self.zone.on_completion(c)
                except ProtocolError as exc:
                    log.warning("rdma: %s", str(exc))
                    events = [Error(int(exc.code), exc.message, exc.rid)]
                for ev in events:
                    await send(ev)
            if batch:
                self.ep.fill_receives()
