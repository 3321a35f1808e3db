"""Runs: a data worker process reads a connection's frames and lands chunks on its own.

Step 2 of docs/data_workers.md (``receiver.worker_runs``, with data workers; plain TCP or
sealed records, whose receiving direction is lent for the run: ``worker_run``). Before
it, every chunk cost the event loop a job to its worker, a reply, an ACK and the task switches
between them. After an in-place chunk that is a sender's first send of its cell
(``ChunkHeader.copy`` False), the connection's task lends the connection to its worker for a
*run*: the worker parses the frames itself, lands each first send of a *leased* request (the
session's requests receiving now) at its cell, hashes it and reports it in batches
(``Landed``); at the first frame that is anything else it hands the bytes back and the task
parses on. The daemon's books settle every report here, exactly as ``_land_chunk`` settles a
read, and the ACKs of a batch go out in one write. A request accepted while runs of its
session are under way is leased to them before its ACCEPT goes out (``_lease_to_runs``), so a
run does not end at its first chunk.

Why two writers never share a cell: a run lands only first sends, and a sender sends one
first send per cell. Its copies (resends) always go through the daemon, into scratch (while
runs are on, a copy never lands in place directly), and a verified copy is put in place only
after every run holding that request's lease has ended. A sender that sends two first sends of
one cell anyway is caught when the second is settled: its request fails, and no other
request's buffer is ever touched (a buffer is freed only after every run leasing it ended).
Once a request is complete its lease is closed (``FLAG_CLOSED``) before any engine is told,
so a run lands nothing more in a buffer an engine may be reading. What is left: a second
first send of one of its cells that a run had begun before the completion gives up within a
read (or ``sockio.THREAD_POLL_S``), and the bytes it wrote meanwhile are under the engine;
and a layer an engine pinned while the rest of its request is still coming is not closed
(one flag per lease). Only a sender that breaks the protocol has such a chunk; closing those
windows needs a per-cell claim the daemon and its workers share, see docs/data_workers.md.

A mixin of ``receiver.Receiver``, like ``receive_conns.DataConnections``, which calls it.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio
from xdc.transport.data_workers import StopFlag
from xdc.transport.wire import WireConn

from xdc.protocol import Ack as AckEv
from xdc.protocol import ChunkHeader, Event, Nack
from xdc.protocol.books.receive import (
    ChunkVerdict,
    Effect,
    ReceiveBook,
    RxRequest,
    RxState,
)
from xdc.protocol.books.tracker import ChunkOutcome, Disposition
from xdc.protocol.worker_jobs import MAX_LEASES, Landed, LandedCell, Lease

log = logging.getLogger("xdc.receiver")


@dataclass(eq=False)
class _Run:
    """One run under way: its connection, its RUN job, the leases it holds (more join as
    the session's requests are accepted), and an event set once it has ended (its worker
    writes into no leased buffer any more, and each of its reports was settled)."""

    wire: WireConn
    job: int
    leases: list[Lease]
    ended: trio.Event = field(default_factory=trio.Event)


class WorkerRuns:
    """Runs of a receiver's connections (a mixin of ``receiver.Receiver``)."""

    if TYPE_CHECKING:  # the daemon's, read here
        book: ReceiveBook
        counts: dict[str, int]
        _reads: Counter[int]

        def _apply(self, effects: Iterable[Effect], via: WireConn | None = None) -> None: ...
        def _read_done(self, base: int) -> None: ...
        def _sent_notice(self, wire: WireConn, ev: Event) -> None: ...
        def _count_duplicate(self, req: RxRequest) -> None: ...
        def _answer_finished(
            self,
            wire: WireConn,
            req: RxRequest,
            hdr: ChunkHeader,
            out: ChunkOutcome,
            ok: bool,
            frames: list[Event],
            notices: list[Event],
        ) -> None: ...

    def _init_runs(self) -> None:
        # buffer offset -> the runs holding a lease on it, and the lease's stop flag (one per
        # leased buffer, shared by its runs; released once none leases it)
        self._runs: dict[int, set[_Run]] = {}
        self._lease_stops: dict[int, StopFlag] = {}
        self._session_runs: dict[str, set[_Run]] = {}  # the runs under way, by session

    def _stop_runs_soon(self, base: int) -> list[_Run]:
        """Tell every run leasing the buffer at ``base`` to write no more into it and end
        (within a read, or ``sockio.THREAD_POLL_S``); the runs, to wait for."""
        flag = self._lease_stops.get(base)
        if flag is not None:
            flag.set()
        return list(self._runs.get(base, ()))

    def _close_lease(self, base: int) -> None:
        """The request in the buffer at ``base`` is complete: runs leasing it land nothing
        more in it (a chunk of it ends the run there and is read into scratch by the daemon)
        and go on with their other leases. Set before the engine is told, so a run cannot
        begin a chunk of it after (one begun before gives up within a read or
        ``sockio.THREAD_POLL_S``; only a sender that sends a cell's first send twice has one)."""
        flag = self._lease_stops.get(base)
        if flag is not None:
            flag.close()

    async def _runs_ended(self, base: int) -> None:
        """Until no run leases the buffer at ``base``: a verified copy of one of its cells
        may then be put in place (no run's write can follow it)."""
        for run in self._stop_runs_soon(base):
            await run.ended.wait()

    async def _run(self, wire: WireConn, session: str, first: RxRequest) -> None:
        """Lend ``wire``'s reading to its worker for a run leasing ``first`` and the
        session's other requests receiving now; back when the run ends."""
        assert wire.worker is not None
        leased = [first]
        for req in self.book.requests.values():
            if len(leased) >= MAX_LEASES:
                break
            if req is not first and req.session == session and req.state is RxState.RECEIVING:
                leased.append(req)
        run = _Run(wire, wire.worker.next_job(), [])
        for req in leased:
            self._lease(run, req)
        if not run.leases or run.leases[0].rid != first.rid:
            self._let_go(run)
            return
        runs = self._session_runs.setdefault(session, set())
        runs.add(run)
        self.counts["runs"] += 1
        try:
            await wire.run(
                tuple(run.leases),
                None,
                functools.partial(self._on_landed, wire, session),
                run.job,
            )
        finally:
            run.ended.set()
            runs.discard(run)
            if not runs and self._session_runs.get(session) is runs:
                del self._session_runs[session]
            self._let_go(run)

    def _lease(self, run: _Run, req: RxRequest) -> Lease | None:
        """``req`` leased to ``run`` (its buffer held until the run ends); None when it cannot
        be: no buffer yet, its lease being ended, the run holding ``MAX_LEASES`` already (its
        worker looks at each one's flag between chunks), or every stop flag held."""
        if req.tracker is None or req.offset is None or run.ended.is_set():
            return None
        if len(run.leases) >= MAX_LEASES:
            return None
        if any(held.base == req.offset for held in run.leases):
            return None
        flag = self._lease_stops.get(req.offset)
        if flag is None:
            assert run.wire.worker is not None
            flag = run.wire.worker.workers.stop_flag()
            if flag is None:
                return None
            self._lease_stops[req.offset] = flag
        elif flag.is_set():
            return None
        grid = req.tracker.grid
        lease = Lease(req.rid, req.offset, grid.layer_sizes, grid.chunk_bytes, flag.slot)
        run.leases.append(lease)
        self._reads[lease.base] += 1
        self._runs.setdefault(lease.base, set()).add(run)
        return lease

    def _let_go(self, run: _Run) -> None:
        """``run`` is over (or never started): its buffers and stop flags go back."""
        for lease in run.leases:
            runs = self._runs.get(lease.base)
            if runs is not None:
                runs.discard(run)
                if not runs:
                    del self._runs[lease.base]
                    flag = self._lease_stops.pop(lease.base, None)
                    if flag is not None:
                        flag.release()
            self._read_done(lease.base)
        run.leases = []

    async def _lease_to_runs(self, req: RxRequest) -> None:
        """``req`` was just accepted: the session's runs under way may land it too (told
        before its ACCEPT goes out, so before its first chunk can come; one that comes
        first anyway ends its run, as before)."""
        if req.state is not RxState.RECEIVING:
            return
        for run in list(self._session_runs.get(req.session, ())):
            lease = self._lease(run, req)
            if lease is not None:
                assert run.wire.worker is not None
                await run.wire.worker.add_lease(run.job, lease)

    async def _on_landed(self, wire: WireConn, session: str, batch: list[Landed]) -> None:
        """Settle a run's reports, then answer them all in one write."""
        frames: list[Event] = []
        notices: list[Event] = []
        for report in batch:
            self.counts["run_chunks"] += len(report.cells)
            for cell in report.cells:
                self._settle(wire, session, cell, frames, notices)
        if frames:
            await wire.send_events(frames)
            for ev in notices:
                self._sent_notice(wire, ev)

    def _settle(
        self,
        wire: WireConn,
        session: str,
        cell: LandedCell,
        frames: list[Event],
        notices: list[Event],
    ) -> None:
        """One chunk a run landed in place, settled as ``_land_chunk`` settles a read of its
        own (``_answer_finished``: counted, and its ACK or NACK added to ``frames``)."""
        rid, layer, offset, length, checksum, ok = cell
        hdr = ChunkHeader(rid, layer, offset, length, checksum, False)
        ack = AckEv(rid, layer, offset)
        verdict, req = self.book.chunk_verdict(session, rid)
        if ok is None:  # given up half read (its lease was stopped): resent, unless not needed
            tracker = req.tracker if req is not None else None
            if verdict is ChunkVerdict.LAND and tracker is not None and not tracker.verified(hdr):
                frames.append(Nack(rid, layer, offset, "receiver stopped reading it"))
            return
        if verdict is not ChunkVerdict.LAND or req is None or req.tracker is None:
            if ok and verdict is ChunkVerdict.ACK_DUPLICATE:
                # a first send that was under way when its request completed (a resend of it
                # verified first; the lease is closed since, so none begins after)
                frames.append(ack)
            elif not ok and verdict is ChunkVerdict.ACK_DUPLICATE:
                # the same, and corrupt: only a sender that breaks the protocol does this
                log.error(
                    "%s layer %d offset %d: a first send again after completion, and corrupt",
                    rid,
                    layer,
                    offset,
                )
            return
        tracker = req.tracker
        now = trio.current_time()
        _rel, disp = tracker.locate(hdr)
        if disp is not Disposition.IN_PLACE:
            # The cell held verified bytes and the run landed these over them. A first send
            # that arrives after a resend of it was verified (its connection was slow, or
            # closed with it still in the kernel's buffers) is the same bytes: harmless. What
            # vouches for them is their checksum, or under sealed records with sampled
            # checksums their records' tags (AEAD: the sender's own bytes, unaltered)
            if ok and tracker.verified(hdr):
                self._count_duplicate(req)
                frames.append(ack)
                return
            why = f"two first sends of layer {layer} offset {offset} (CHUNK copy false twice)"
            log.warning("%s: %s; the request fails", rid, why)
            self._apply(self.book.violated(req, why, now))
            return
        out = tracker.finish(hdr, disp, ok)
        self._answer_finished(wire, req, hdr, out, ok, frames, notices)
