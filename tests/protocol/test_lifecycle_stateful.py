"""Both request lifecycles at once under arbitrary interleavings (hypothesis stateful).

The sender's book and the receiver's book, with their real trackers and chunk grid, are
joined by a simulated network: connections carry frames in order and can die with frames in
flight; chunks can arrive corrupted, twice, or on two connections at once (one copy still
being written in place while the other is verified); engines begin, hand over in parts,
cancel, vanish, claim and release; the clock runs out deadlines; either daemon can restart.
The glue below does what the daemons do with each book's answers (nothing more).

Checked at every step and after the dust settles:
- a request an engine reads has exactly the bytes its sender handed over;
- no request is handed to engines twice for good (released twice); a shared read (a
  two-rank engine, "tp-0" and "tp-1", whose ranks hold the same bytes) is released once by
  each rank, and its buffer holds the request's bytes while any engine holds a claim on it;
- a request its sender reported delivered is delivered at the receiver (unless the receiver
  crashed, which loses its memory by definition);
- every request ends on both sides: delivered, or failed with a code; nothing is left
  arriving, and every receive buffer is given back (no leak, no double free).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from xdc.errors import ResultCode
from xdc.protocol import (
    Accept,
    Ack,
    Begin,
    Cancel,
    ChunkHeader,
    Complete,
    Disposition,
    Error,
    LayerDone,
    Nack,
)
from xdc.protocol.books.receive import (
    Allocate,
    ChunkVerdict,
    Delivered,
    Effect,
    Free,
    ReceiveBook,
    RxRequest,
    RxState,
    Send,
)
from xdc.protocol.books.send import Accepted, Failed, Give, SendBook, TxEffect, TxState

CHUNK = 8  # tiny cells: a few bytes make many chunks and many interleavings
DEADLINE = 30.0
RIDS = ["a", "b", "c"]
ENGINES = ["eng-0", "eng-1", "tp-0", "tp-1"]  # tp-*: the ranks of one shared-read engine
SHARED = ("tp-0", "tp-1")


@dataclass
class Conn:
    cid: int
    session: str  # the sender session it belongs to
    to_rx: deque[Any] = field(default_factory=deque)
    to_tx: deque[Any] = field(default_factory=deque)
    unacked: dict[tuple[str, int, int], tuple[str, int, int, int]] = field(default_factory=dict)
    pending_begins: set[str] = field(default_factory=set)
    alive: bool = True


@dataclass(eq=False)
class Landing:
    """A chunk read that has started (located) but not finished: bytes still coming."""

    conn: Conn
    req: RxRequest  # the request the read began for (its rid may be begun again meanwhile)
    base: int  # its buffer
    hdr: ChunkHeader
    disp: Disposition
    payload: bytes
    corrupt: bool
    rx_gen: int


class Lifecycles(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.cids = itertools.count()
        self.tx_gen = 0
        self.rx_gen = 0
        self.tx_session = "tx-0"
        self.rx_session = "rx-0"
        self.tx = self._new_sender()
        self.rx = self._new_receiver()
        self.conns: list[Conn] = []
        self.queue: deque[tuple[str, int, int, int]] = deque()  # (rid, layer, off, len)
        self.payloads: dict[tuple[str, str], list[bytes]] = {}  # (tx session, rid) -> layers
        self.outcomes: dict[tuple[str, str], ResultCode] = {}  # the sender engine's view
        self.rx_delivered: dict[tuple[str, str], int] = {}  # (session, rid) -> rx generation
        self.released: set[tuple[str, str, int]] = set()
        self.reads: set[tuple[str, str, int, str]] = set()  # ... and the reader ("" alone)
        self.buffers: dict[int, bytearray] = {}  # the receive pool: offset -> buffer
        self.reading: dict[int, int] = {}  # buffer -> reads landing in it (the daemon's count)
        self.free_after_read: set[int] = set()  # freed by the book while a read was landing
        self.offsets = itertools.count(1)
        self.landing: list[Landing] = []
        self.claims: dict[str, list[str]] = {e: [] for e in ENGINES}
        self.healing = False

    # --- the two daemons' glue ---------------------------------------------------------------

    def _new_sender(self) -> SendBook:
        return SendBook(
            max_layers=8,
            max_request_bytes=1 << 20,
            max_block_hashes=8,
            max_concurrent=8,
            fits=lambda n: True,
        )

    def _new_receiver(self) -> ReceiveBook:
        book = ReceiveBook(
            fits=lambda n: True,
            max_concurrent=8,
            orphan_grace_s=5.0,
            unclaimed_ttl_s=1e9,  # the engine may be slow: nothing expires while we check
        )
        for rank in SHARED:
            book.engine_readers_of(rank, len(SHARED))
        return book

    def _live(self, session: str | None = None) -> list[Conn]:
        return [c for c in self.conns if c.alive and (session is None or c.session == session)]

    def _rx_apply(self, effects: list[Effect], via: Conn | None = None) -> None:
        for e in effects:
            if isinstance(e, Send):
                ours = via if via is not None and via.alive and via.session == e.session else None
                target = ours or next(iter(self._live(e.session)), None)
                if target is not None:
                    target.to_tx.append((self.rx_gen, e.event))
            elif isinstance(e, Allocate):
                offset = next(self.offsets)
                req = self.rx.get(e.rid)
                assert req is not None
                self.buffers[offset] = bytearray(b"\xaa" * e.nbytes)  # garbage until written
                self._rx_apply(self.rx.allocated(e.rid, offset, req), via)
            elif isinstance(e, Free):
                assert e.offset in self.buffers and e.offset not in self.free_after_read, (
                    "double free"
                )
                if self.reading.get(e.offset):
                    self.free_after_read.add(e.offset)  # as the daemon does: after the read
                else:
                    del self.buffers[e.offset]
            elif isinstance(e, Delivered):
                req = self.rx.get(e.rid)
                assert req is not None and req.offset is not None
                key = (req.session, e.rid)
                assert self._bytes(req) == b"".join(self.payloads[key]), "delivered wrong bytes"
                self.rx_delivered[key] = self.rx_gen
                event("a request was delivered")

    def _read_ends(self, lnd: Landing) -> None:
        self.landing.remove(lnd)
        if lnd.rx_gen != self.rx_gen:
            return
        self.reading[lnd.base] -= 1
        if not self.reading[lnd.base]:
            del self.reading[lnd.base]
            if lnd.base in self.free_after_read:
                self.free_after_read.discard(lnd.base)
                del self.buffers[lnd.base]

    def _bytes(self, req: Any) -> bytes:
        return bytes(self.buffers[req.offset][: req.begin.total_bytes])

    def _tell_rx(self, event: Any) -> None:
        conn = next(iter(self._live(self.tx_session)), None)
        if conn is not None:
            conn.to_rx.append((self.tx_gen, event))

    def _tx_apply(self, effects: list[TxEffect]) -> None:
        """What the sender daemon does with the book's effects, as far as this model goes
        (buffers are the payloads; END is implied by every layer being handed over)."""
        for e in effects:
            if isinstance(e, (Give, Accepted)):
                self._give(e.req)
            elif isinstance(e, Failed) and e.notify:
                self._tell_rx(Cancel(e.req.rid, e.req.why))

    def _tx_fail(self, rid: str, code: ResultCode, why: str, tell: bool = True) -> None:
        self._tx_apply(self.tx.fail(rid, code, why, notify=tell))

    def _tx_finish_ended(self) -> None:
        for req in list(self.tx.requests.values()):
            if not req.live:
                self.outcomes[(self.tx_session, req.rid)] = req.code or ResultCode.OK
                event(f"sender outcome {req.code or 'OK'}")
                self.tx.finish(req)

    def _give(self, req: Any) -> None:
        for layer in range(len(req.handed)):
            start, upto = req.queued_upto[layer], req.ready_upto[layer]
            cells = req.tracker.grid.cells_within(layer, start, upto)
            if cells:
                req.queued_upto[layer] = cells[-1][0] + cells[-1][1]
                self.queue.extend((req.rid, layer, o, n) for o, n in cells)

    # --- prefill engine ----------------------------------------------------------------------

    @rule(
        rid=st.sampled_from(RIDS),
        sizes=st.lists(st.integers(0, 3 * CHUNK + 3), min_size=1, max_size=3),
        data=st.data(),
    )
    def begin(self, rid: str, sizes: list[int], data: st.DataObject) -> None:
        if sum(sizes) == 0 or rid in self.tx.requests:
            return
        key = (self.tx_session, rid)
        if key in self.payloads:  # one request per id per sender session, like engines do
            return
        begin = Begin(rid, tuple(sizes), CHUNK, (), 0, int(DEADLINE * 1000))
        req = self.tx.begin("engine", begin, "peer", self.now, DEADLINE)
        self.payloads[key] = [data.draw(st.binary(min_size=n, max_size=n)) for n in sizes]
        for layer in range(len(sizes)):
            req.layer_slot[layer] = layer  # buffers exist (the bytes live in self.payloads)

    @rule(data=st.data())
    def hand_over(self, data: st.DataObject) -> None:
        live = [r for r in self.tx.requests.values() if r.live and not r.all_handed]
        if not live:
            return
        req = data.draw(st.sampled_from(live))
        layer = data.draw(st.sampled_from([i for i, h in enumerate(req.handed) if not h]))
        size = req.begin.layer_sizes[layer]
        upto = data.draw(st.integers(req.ready_upto[layer], size))
        self._tx_apply(self.tx.hand_over("engine", req.rid, layer, upto, self.now))
        self._tx_finish_ended()

    @rule(data=st.data(), now=st.integers(0, 3))
    def engine_cancels(self, data: st.DataObject, now: int) -> None:
        live = [r.rid for r in self.tx.requests.values() if r.live]
        if live and now == 0:
            self._tx_fail(data.draw(st.sampled_from(live)), ResultCode.CANCELLED, "gave up")
            self._tx_finish_ended()

    @rule(now=st.integers(0, 3))
    def prefill_engine_vanishes(self, now: int) -> None:
        """Requests it handed over completely go on without it; the rest fail."""
        if now:
            return
        self._tx_apply(self.tx.engine_gone("engine"))
        self._tx_finish_ended()

    # --- the network -------------------------------------------------------------------------

    @rule()
    def connect(self) -> None:
        if len(self._live(self.tx_session)) < 3:
            conn = Conn(next(self.cids), self.tx_session)
            self.conns.append(conn)
            self.rx.connection_up(conn.session)

    @precondition(lambda self: not self.healing)
    @rule(data=st.data())
    def connection_dies(self, data: st.DataObject) -> None:
        live = self._live()
        if not live:
            return
        conn = data.draw(st.sampled_from(live))
        conn.alive = False
        conn.to_rx.clear()
        conn.to_tx.clear()
        self.rx.connection_down(conn.session, self.now)
        for lnd in [lnd for lnd in self.landing if lnd.conn is conn]:  # reads cut short
            self._read_ends(lnd)
            if lnd.req.tracker is not None and lnd.rx_gen == self.rx_gen:
                lnd.req.tracker.abandon(lnd.hdr, lnd.disp)
        if conn.session == self.tx_session:
            for work in conn.unacked.values():  # back to the front of the queue
                req = self.tx.requests.get(work[0])
                if req is not None and req.state is TxState.SENDING:
                    self.queue.appendleft(work)
        conn.unacked.clear()
        conn.pending_begins.clear()  # a BEGIN lost with it is sent again (send_begin)

    @rule(data=st.data())
    def send_begin(self, data: st.DataObject) -> None:
        live = self._live(self.tx_session)
        pending = [
            r
            for r in self.tx.requests.values()
            if r.state is TxState.PENDING and not any(r.rid in c.pending_begins for c in live)
        ]
        if not live or not pending:
            return
        req = data.draw(st.sampled_from(pending))
        conn = data.draw(st.sampled_from(live))
        conn.pending_begins.add(req.rid)
        conn.to_rx.append((self.tx_gen, req.begin))

    @rule(data=st.data(), corrupt=st.booleans())
    def send_chunk(self, data: st.DataObject, corrupt: bool) -> None:
        live = self._live(self.tx_session)
        if not live or not self.queue:
            return
        rid, layer, off, n = work = self.queue.popleft()
        req = self.tx.requests.get(rid)
        if req is None or req.state is not TxState.SENDING or req.tracker.is_acked(layer, off):
            return
        conn = data.draw(st.sampled_from(live))
        payload = self.payloads[(self.tx_session, rid)][layer][off : off + n]
        if corrupt and not self.healing and payload:
            payload = bytes([payload[0] ^ 0xFF]) + payload[1:]
        conn.unacked[(rid, layer, off)] = work
        conn.to_rx.append((self.tx_gen, ChunkHeader(rid, layer, off, n, 0), payload, corrupt))

    @rule(data=st.data())
    def send_again(self, data: st.DataObject) -> None:
        """A resend of something not yet acked, on another connection (as after a timeout)."""
        live = self._live(self.tx_session)
        pool = [w for c in live for w in c.unacked.values()]
        if pool:
            self.queue.append(data.draw(st.sampled_from(pool)))

    @rule(data=st.data())
    def receiver_reads(self, data: st.DataObject) -> None:
        live = [c for c in self._live() if c.to_rx]
        if not live:
            return
        self._receiver_reads(data.draw(st.sampled_from(live)))

    def _receiver_reads(self, conn: Conn) -> None:
        _gen, *frame = conn.to_rx.popleft()
        ev = frame[0]
        if isinstance(ev, Begin):
            self._rx_apply(self.rx.begin(conn.session, ev, self.now), via=conn)
        elif isinstance(ev, Cancel):
            self._rx_apply(self.rx.cancel(conn.session, ev.rid, ev.reason, self.now))
        elif isinstance(ev, ChunkHeader):
            self._rx_chunk(conn, ev, frame[1], frame[2])

    def _rx_chunk(self, conn: Conn, hdr: ChunkHeader, payload: bytes, corrupt: bool) -> None:
        verdict, req = self.rx.chunk_verdict(conn.session, hdr.rid)
        if verdict is ChunkVerdict.ACK_DUPLICATE:
            conn.to_tx.append((self.rx_gen, Ack(hdr.rid, hdr.layer, hdr.offset)))
            return
        if verdict is not ChunkVerdict.LAND or req is None or req.tracker is None:
            if verdict in (ChunkVerdict.ENDED, ChunkVerdict.UNKNOWN):
                code = 9 if verdict is ChunkVerdict.ENDED else 4
                conn.to_tx.append((self.rx_gen, Error(code, "no", hdr.rid)))
            return
        assert req.offset is not None
        _pos, disp = req.tracker.locate(hdr)
        self.landing.append(
            Landing(conn, req, req.offset, hdr, disp, payload, corrupt, self.rx_gen)
        )
        self.reading[req.offset] = self.reading.get(req.offset, 0) + 1

    @rule(data=st.data())
    def receive_finishes(self, data: st.DataObject) -> None:
        """One started read completes (reads of one cell on two connections interleave)."""
        if self.landing:
            self._finish_landing(data.draw(st.sampled_from(self.landing)))

    def _finish_landing(self, lnd: Landing) -> None:
        if lnd.rx_gen != self.rx_gen:  # that receiver is gone
            self.landing.remove(lnd)
            return
        corrupt, req = lnd.corrupt, lnd.req
        hdr, disp, tracker = lnd.hdr, lnd.disp, req.tracker
        assert tracker is not None
        start = req.begin.layer_offsets[hdr.layer] + hdr.offset
        if disp is Disposition.IN_PLACE:
            if tracker.superseded(hdr):  # the I/O layer stops writing: nothing lands
                tracker.abandon(hdr, disp)
                self._read_ends(lnd)
                return
            self.buffers[lnd.base][start : start + hdr.length] = lnd.payload
        self._read_ends(lnd)
        if req.state is not RxState.RECEIVING:
            tracker.abandon(hdr, disp)
            if not corrupt and req.state in (RxState.COMPLETE, RxState.CLAIMED, RxState.DONE):
                lnd.conn.to_tx.append((self.rx_gen, Ack(hdr.rid, hdr.layer, hdr.offset)))
            return
        out = tracker.finish(hdr, disp, not corrupt)
        if out.copy_from_scratch:
            event("a verified scratch copy overtook an in-place read")
            assert req.offset == lnd.base
        if corrupt or out.live_corrupted:
            event("a corrupted chunk was refused")
            lnd.conn.to_tx.append((self.rx_gen, Nack(hdr.rid, hdr.layer, hdr.offset, "bad")))
            return
        if out.copy_from_scratch:
            self.buffers[lnd.base][start : start + hdr.length] = lnd.payload
        lnd.conn.to_tx.append((self.rx_gen, Ack(hdr.rid, hdr.layer, hdr.offset)))
        if out.layer_done is not None or out.request_done:
            self._rx_apply(self.rx.chunk_done(req, out, self.now), via=lnd.conn)

    @rule(data=st.data())
    def sender_reads(self, data: st.DataObject) -> None:
        live = [c for c in self._live(self.tx_session) if c.to_tx]
        if not live:
            return
        self._sender_reads(data.draw(st.sampled_from(live)))

    def _sender_reads(self, conn: Conn) -> None:
        gen, ev = conn.to_tx.popleft()
        if gen != self.rx_gen:
            return  # from a receiver that has since restarted
        if isinstance(ev, Accept):
            conn.pending_begins.discard(ev.rid)
            self._tx_apply(self.tx.accepted(ev.rid))
        elif isinstance(ev, Ack):
            conn.unacked.pop((ev.rid, ev.layer, ev.offset), None)
            self._tx_apply(self.tx.acked(ev.rid, ev.layer, ev.offset, self.now))
        elif isinstance(ev, Nack):
            work = conn.unacked.pop((ev.rid, ev.layer, ev.offset), None)
            if work is not None:
                self.queue.appendleft(work)
        elif isinstance(ev, Error) and ev.rid is not None:
            self._tx_fail(ev.rid, ResultCode.FAILED, ev.message, tell=False)
        elif isinstance(ev, (Complete, LayerDone)):
            pass  # informational over TCP: ACKs decide
        self._tx_finish_ended()

    @rule(data=st.data(), steps=st.integers(1, 40))
    def pump(self, data: st.DataObject, steps: int) -> None:
        """Many network steps in an order hypothesis picks: frames read on any connection,
        reads finished in any order, chunks and BEGINs sent."""
        for _ in range(steps):
            actions = ["send_begin"]
            if any(c.to_rx for c in self._live()):
                actions.append("receiver_reads")
            if self.landing:
                actions.append("receive_finishes")
            if any(c.to_tx for c in self._live(self.tx_session)):
                actions.append("sender_reads")
            if self.queue:
                actions.append("send_chunk")
            if any(c.unacked for c in self._live(self.tx_session)):
                actions.append("send_again")
            if any(r.live and not r.all_handed for r in self.tx.requests.values()):
                actions.append("hand_over")
            if self.rx.ready:
                actions.append("claim")
            if any(self.claims.values()):
                actions += ["release", "engine_leaves"]
            action = data.draw(st.sampled_from(actions))
            if action == "send_chunk":
                self.send_chunk(data, data.draw(st.integers(0, 3)) == 0)  # 1 in 4 corrupted
            elif action == "claim":
                engine = data.draw(st.sampled_from(ENGINES))
                self.decode_engine_claims(engine, data.draw(st.none() | st.sampled_from(RIDS)))
            elif action == "release":
                engine = data.draw(st.sampled_from([e for e, c in self.claims.items() if c]))
                self.decode_engine_releases(engine, data)
            elif action == "engine_leaves":
                engine = data.draw(st.sampled_from([e for e, c in self.claims.items() if c]))
                self.decode_engine_vanishes(engine)
            else:
                getattr(self, action)(data)

    # --- decode engines ----------------------------------------------------------------------

    @rule(engine=st.sampled_from(ENGINES), rid=st.none() | st.sampled_from(RIDS))
    def decode_engine_claims(self, engine: str, rid: str | None) -> None:
        got, effects = self.rx.claim(engine, rid, self.now)
        self._rx_apply(effects)
        if isinstance(got, RxRequest):
            key = (got.session, got.rid)
            assert self._bytes(got) == b"".join(self.payloads[key]), "engine read wrong bytes"
            if got.rid not in self.claims[engine]:
                self.claims[engine].append(got.rid)

    @rule(engine=st.sampled_from(ENGINES), data=st.data())
    def decode_engine_releases(self, engine: str, data: st.DataObject) -> None:
        if not self.claims[engine]:
            return
        rid = data.draw(st.sampled_from(self.claims[engine]))
        req = self.rx.get(rid)
        refusal, effects = self.rx.release(engine, rid)
        self.claims[engine].remove(rid)
        if refusal is None and req is not None:
            reader = engine if engine in SHARED else ""
            key = (req.session, rid, self.rx_gen)
            assert (*key, reader) not in self.reads, f"{rid} released twice by {engine}"
            self.reads.add((*key, reader))
            readers = {r for s, i, g, r in self.reads if (s, i, g) == key}
            assert readers in ({""}, {"tp-0"}, {"tp-1"}, set(SHARED)), (rid, readers)
            self.released.add(key)
            event("an engine released a request")
            if reader:
                event("a rank released a shared read")
        self._rx_apply(effects)

    @rule(engine=st.sampled_from(ENGINES))
    def decode_engine_vanishes(self, engine: str) -> None:
        self._rx_apply(self.rx.engine_gone(engine))
        self.claims[engine].clear()
        if engine in SHARED:  # it connects again, and says so in its hello
            self.rx.engine_readers_of(engine, len(SHARED))

    # --- the clock and restarts --------------------------------------------------------------

    @rule(dt=st.floats(0.05, 6.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for req in list(self.tx.requests.values()):
            if req.live and self.now > req.deadline:
                self._tx_fail(req.rid, ResultCode.DEADLINE, "too slow")
            elif req.live and self._live(self.tx_session):
                self.rx.kept(self.tx_session, req.rid, self.now)  # its KEEP: still live here
        self._tx_finish_ended()
        self._rx_apply(self.rx.tick(self.now))

    @precondition(lambda self: not self.healing)
    @rule(now=st.integers(0, 3))
    def sender_restarts(self, now: int) -> None:
        if now:
            return
        for conn in self._live(self.tx_session):
            conn.alive = False
            self.rx.connection_down(conn.session, self.now)
        for req in list(self.tx.requests.values()):
            self.outcomes[(self.tx_session, req.rid)] = ResultCode.SHUTDOWN  # died with it
        self.tx_gen += 1
        self.tx_session = f"tx-{self.tx_gen}"
        self.tx = self._new_sender()
        self.queue.clear()

    @precondition(lambda self: not self.healing)
    @rule(now=st.integers(0, 3))
    def receiver_restarts(self, now: int) -> None:
        if now:
            return
        for conn in self._live():
            conn.alive = False
        self.rx_gen += 1
        self.rx_session = f"rx-{self.rx_gen}"
        self.rx = self._new_receiver()
        self.buffers.clear()
        self.free_after_read.clear()  # a restarted receiver has a new pool
        self.landing.clear()
        self.claims = {e: [] for e in ENGINES}
        self._tx_apply(self.tx.peer_restarted("peer"))
        self._tx_finish_ended()
        self.queue.clear()

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def delivered_means_delivered(self) -> None:
        for (session, rid), code in self.outcomes.items():
            if code is ResultCode.OK:
                assert (session, rid) in self.rx_delivered, f"{rid} reported delivered, never was"

    @invariant()
    def a_claimed_request_keeps_its_bytes(self) -> None:
        """No buffer is freed or reused under an engine that holds a claim on it."""
        for engine, rids in self.claims.items():
            for rid in rids:
                req = self.rx.get(rid)
                assert req is not None and req.state is RxState.CLAIMED, (engine, rid)
                assert req.offset in self.buffers, (engine, rid)
                key = (req.session, rid)
                assert self._bytes(req) == b"".join(self.payloads[key]), (engine, rid)

    @invariant()
    def buffers_belong_to_requests(self) -> None:
        held = {r.offset for r in self.rx.requests.values() if r.offset is not None}
        assert set(self.buffers) == held | self.free_after_read, (set(self.buffers), held)

    def teardown(self) -> None:
        """Heal the network and let everything run out: every request must end."""
        self.healing = True
        for req in list(self.tx.requests.values()):  # prefill finishes what it owns
            if req.live and req.owner == "engine":
                for layer, handed in enumerate(req.handed):
                    if not handed:
                        self._tx_apply(self.tx.hand_over("engine", req.rid, layer, None, self.now))
        self._tx_finish_ended()
        for _ in range(400):
            progressed = False
            if not self._live(self.tx_session):
                self.connect()
            for conn in self._live():
                while conn.to_rx:
                    self._receiver_reads(conn)
                    progressed = True
            while self.landing:
                self._finish_landing(self.landing[0])
                progressed = True
            for conn in self._live(self.tx_session):
                while conn.to_tx:
                    self._sender_reads(conn)
                    progressed = True
            live = self._live(self.tx_session)
            for req in list(self.tx.requests.values()):
                if (
                    req.state is TxState.PENDING
                    and live
                    and not any(req.rid in c.pending_begins for c in live)
                ):
                    live[0].pending_begins.add(req.rid)
                    live[0].to_rx.append((self.tx_gen, req.begin))
                    progressed = True
            while self.queue and live:
                rid, layer, off, n = work = self.queue.popleft()
                sending = self.tx.requests.get(rid)
                if sending is None or sending.state is not TxState.SENDING:
                    continue
                req = sending
                if req.tracker.is_acked(layer, off):
                    continue
                payload = self.payloads[(self.tx_session, rid)][layer][off : off + n]
                live[0].unacked[(rid, layer, off)] = work
                hdr = ChunkHeader(rid, layer, off, n, 0)
                live[0].to_rx.append((self.tx_gen, hdr, payload, False))
                progressed = True
            if not progressed:
                if not self.tx.requests and not self.rx.arriving():
                    break
                self.time_passes(DEADLINE)  # whatever cannot finish now, times out
        assert not self.tx.requests, {r: s.state for r, s in self.tx.requests.items()}
        assert not self.rx.arriving(), [r.rid for r in self.rx.arriving()]
        self.delivered_means_delivered()
        for engine in self.claims:  # engines release what they hold; buffers all come back
            for rid in list(self.claims[engine]):
                self.decode_engine_releases(engine, _Only(rid))
            self.decode_engine_vanishes(engine)
        for shared in list(self.rx.requests.values()):  # a shared read a rank did not finish
            if shared.state is RxState.CLAIMED:
                for rank in SHARED:
                    self.decode_engine_claims(rank, shared.rid)
                    if shared.rid in self.claims[rank]:
                        self.decode_engine_releases(rank, _Only(shared.rid))
        while self.rx.ready:  # a last engine takes whatever is still waiting: request "b"
            # the two-rank engine, one rank after the other, the rest a one-rank engine
            rid = self.rx.ready[0]
            for engine in SHARED if rid == "b" else ("eng-0",):
                self.decode_engine_claims(engine, rid)
                assert rid in self.claims[engine], f"{engine} could not read {rid}"
                self.decode_engine_releases(engine, _Only(rid))
        assert not self.rx.requests, {r: s.state for r, s in self.rx.requests.items()}
        assert not self.buffers, "receive buffers leaked"
        # nothing delivered by the live receiver was lost: an engine got each exactly once
        for (session, rid), gen in self.rx_delivered.items():
            if gen == self.rx_gen:
                assert (session, rid, gen) in self.released, f"{rid} delivered, then lost"


class _Only:
    """Draws the one value a helper needs when the teardown calls a rule directly."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object) -> object:
        return self.value


Lifecycles.TestCase.settings = settings(
    max_examples=1000,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_both_lifecycles_under_arbitrary_interleavings = Lifecycles.TestCase
