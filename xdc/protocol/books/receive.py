"""What a request may do next at the receiver, decided in one pure place.

The receiver daemon only drives this book: it feeds it what happened (a BEGIN from a sender
session, pool room found, a chunk verified, a CANCEL, a connection lost, an engine's call,
the clock) and carries out the effects it returns (send a frame to a session, allocate or
free a buffer, wake waiting engines). Nothing here does I/O, so every rule below is tested
byte by byte without a socket (tests/protocol/test_receive_lifecycle.py and the stateful property
test).

The rules:

- **Ownership.** A request belongs to the sender session that BEGAN it. Chunks, CANCELs and
  re-BEGINs from any other session never touch it; another session's chunk for it is
  answered UNKNOWN_REQUEST as if it did not exist.
- **Two-phase visibility.** An engine sees a request only when every byte is verified
  (COMPLETE); single layers only when that layer is.
- **Claims are leases.** A complete request handed to an engine connection is CLAIMED by it
  until that connection releases it. If the connection goes away first (the engine crashed,
  or gave up on a call whose reply it never read), the request goes back to the ready queue:
  the sender was told it was delivered, so it must not be dropped. Only the claimer may
  release it.
- **Shared reads.** An engine whose every tensor-parallel rank holds the same bytes (MLA's
  latent KV is whole at each rank) says so at HELLO (``readers``: its number of ranks, one
  connection each): one transfer then serves all its ranks. The first claim makes the
  request CLAIMED for that many readers; each of that engine's connections may claim it
  once, and it is DONE when every reader released it. A reader whose connection went away
  leaves its place open; a request read by some but not all of its readers is freed
  ``unclaimed_ttl_s`` after it completed, once no claim is open.
- **Pins.** An engine reading single layers of a request still arriving holds a pin; a pinned
  request that fails keeps its buffer until every pin is released, so no view an engine holds
  ever changes under it to another request's bytes.
- **Finished memory.** How each recent request ended (and for which session) is remembered,
  bounded, so a late chunk is acked or refused correctly and a late engine call gets the real
  reason.
- **Repeated BEGIN.** The same session re-sending the same BEGIN (it lost the connection that
  carried our ACCEPT) gets the ACCEPT again. A session that lost all its connections is gone
  after ``orphan_grace_s``: its partial requests fail then, and at once when a new session
  BEGINs the same rid (a restarted sender retrying).
- **Cancel.** A CANCEL may overtake its BEGIN on another connection: it is remembered, and
  the late BEGIN is refused.
- **Deadlines.** A request fails when its window (the sender's, at most ours) passes with no
  chunk of it verified and no KEEP or END from its session, and ``max_transfer_s`` after
  BEGIN however it progresses (deadline.py says why); a complete request nobody claims
  within ``unclaimed_ttl_s`` is freed (its pool space would otherwise be lost).
- **RDMA holds.** While the sender may still WRITE into a request's buffer, the buffer is not
  freed even if the request fails (quarantine); the hold ends when the sender says it
  stopped, the request completes, or the session's queue pair is destroyed.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Final, TypeAlias

from xdc.errors import ErrorCode
from xdc.protocol.books.deadline import Deadline
from xdc.protocol.books.tracker import ChunkOutcome, ReceiveTracker
from xdc.protocol.wire.events import Accept, Begin, Complete, Error, LayerDone

Conn: TypeAlias = Hashable  # an engine connection, as the daemon names it


class RxState(enum.StrEnum):
    ALLOCATING = "allocating"  # BEGIN accepted, waiting for room in the pool
    RECEIVING = "receiving"  # buffer found, ACCEPT sent, chunks landing
    COMPLETE = "complete"  # every byte verified; in the ready queue
    CLAIMED = "claimed"  # handed to engine connections (its readers) until they release it
    # the two ends; the request stays in the book only while its buffer is pinned or held
    DONE = "done"  # delivered and released
    FAILED = "failed"  # ended undelivered


ARRIVING: Final = (RxState.ALLOCATING, RxState.RECEIVING)
ENDED: Final = (RxState.DONE, RxState.FAILED)


@dataclass(eq=False)
class RxRequest:
    begin: Begin
    session: str
    created: float
    clock: Deadline
    state: RxState = RxState.ALLOCATING
    offset: int | None = None  # the buffer, once allocated
    tracker: ReceiveTracker | None = None
    claims: set[Conn] = field(default_factory=set)  # the connections reading it now
    readers: int = 1  # how many engine connections read it (shared reads: one per rank)
    read_by: set[Conn] = field(default_factory=set)  # the connections that released it
    pins: set[Conn] = field(default_factory=set)
    rdma_hold: bool = False  # RDMA WRITEs may still land in the buffer
    completed_at: float = 0.0
    failed_at: float = 0.0
    code: ErrorCode | None = None
    why: str = ""
    chunks_rejected: int = 0
    duplicates: int = 0

    @property
    def rid(self) -> str:
        return self.begin.rid

    @property
    def deadline(self) -> float:
        return self.clock.at


@dataclass(frozen=True, slots=True)
class Finished:
    delivered: bool
    session: str
    code: ErrorCode | None
    why: str


# --- effects the daemon carries out ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``event`` to the sender session (the request's own connection if it is alive)."""

    session: str
    event: Accept | Error | LayerDone | Complete


@dataclass(frozen=True, slots=True)
class Allocate:
    """Find ``nbytes`` of pool room, then call ``allocated`` (or ``alloc_failed``)."""

    rid: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class Free:
    """Give this buffer back to the pool (after any read still landing in it)."""

    rid: str
    offset: int


@dataclass(frozen=True, slots=True)
class Delivered:
    rid: str


@dataclass(frozen=True, slots=True)
class Failed:
    rid: str
    code: ErrorCode
    why: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A BEGIN that was never accepted (logged and counted, nothing held)."""

    rid: str
    code: ErrorCode
    why: str


@dataclass(frozen=True, slots=True)
class Requeued:
    """A claimed request went back to the ready queue (its engine connection left)."""

    rid: str


@dataclass(frozen=True, slots=True)
class ReleaseRdma:
    """The sender will not WRITE this request any more: give its RDMA slot back."""

    rid: str


Effect: TypeAlias = Send | Allocate | Free | Delivered | Failed | Refused | Requeued | ReleaseRdma


# --- answers to engine calls -----------------------------------------------------------------


class Wait(enum.Enum):
    """Not yet: wait for the book to change (a Delivered, Failed or Requeued), then ask again."""

    WAIT = "wait"


WAIT: Final = Wait.WAIT


@dataclass(frozen=True, slots=True)
class Refusal:
    code: str  # a ResultCode name
    why: str
    rid: str | None = None  # which request (a claim over several names it)


# --- chunk admission (hot path: no allocation for the common case) ---------------------------


class ChunkVerdict(enum.Enum):
    LAND = "land"  # receive it into the request (the tracker places it)
    ACK_DUPLICATE = "ack"  # already delivered to its session: drop the bytes, ACK
    UNKNOWN = "unknown"  # no such request of this session: drop, ERROR(UNKNOWN_REQUEST)
    ENDED = "ended"  # it failed: drop, ERROR(CANCELLED)
    EARLY = "early"  # before its ACCEPT: the sender broke the protocol; drop, ERROR


class ReceiveBook:
    def __init__(
        self,
        *,
        fits: Callable[[int], bool],
        max_concurrent: int,
        memory: int = 4096,
        orphan_grace_s: float = 10.0,
        unclaimed_ttl_s: float = 300.0,
        max_deadline_s: float = 86400.0,
        max_transfer_s: float = 86400.0,
    ) -> None:
        self.fits = fits  # whether a buffer this big could ever fit the pool
        self.max_concurrent = max_concurrent
        self.memory = memory
        self.orphan_grace_s = orphan_grace_s
        self.unclaimed_ttl_s = unclaimed_ttl_s
        self.max_deadline_s = max_deadline_s  # the longest window a sender may ask for
        self.max_transfer_s = max_transfer_s  # the cap on a request however it progresses
        self.requests: dict[str, RxRequest] = {}
        self.finished: OrderedDict[str, Finished] = OrderedDict()
        self.ready: deque[str] = deque()  # complete, unclaimed, oldest first
        self.early_cancels: OrderedDict[tuple[str, str], str] = OrderedDict()
        # rids a decode engine gave up on before they began: refused when they come
        self.early_discards: OrderedDict[str, str] = OrderedDict()
        self.layouts: Counter[str] = Counter()  # what the connected decode engines accept
        self.engine_layouts: dict[Conn, str] = {}
        self.engine_readers: dict[Conn, int] = {}  # shared reads: readers of each request
        self.connections: Counter[str] = Counter()  # session -> open data connections
        self.gone_since: dict[str, float] = {}  # sessions with none, since when
        self.owners: dict[str, str] = {}  # session -> the identity it was bound to
        self.held: Counter[str] = Counter()  # session -> its entries in ``requests``
        self.draining = False

    # --- queries -----------------------------------------------------------------------------

    def get(self, rid: str) -> RxRequest | None:
        return self.requests.get(rid)

    def arriving(self) -> list[RxRequest]:
        return [r for r in self.requests.values() if r.state in ARRIVING]

    def holding(self) -> list[RxRequest]:
        """Ended requests whose buffer is still held (by pins or RDMA)."""
        return [r for r in self.requests.values() if r.state in ENDED]

    # --- sender side -------------------------------------------------------------------------

    def begin(self, session: str, begin: Begin, now: float) -> list[Effect]:
        rid = begin.rid
        early = self.early_cancels.pop((session, rid), None)
        if early is not None:
            return self._refuse(session, rid, ErrorCode.CANCELLED, f"cancelled: {early}")
        if rid not in self.requests and rid in self.early_discards:
            why = f"the decode engine gave up on it before it began: {self.early_discards[rid]}"
            return self._refuse(session, rid, ErrorCode.CANCELLED, why)
        req = self.requests.get(rid)
        if req is not None:
            if req.session == session:
                if req.begin != begin:
                    return self._refuse(
                        session,
                        rid,
                        ErrorCode.DUPLICATE_REQUEST,
                        f"request {rid} exists with other contents",
                    )
                # the same BEGIN again: it lost the connection that carried our ACCEPT, so
                # it wrote nothing by RDMA under that accept either
                if req.state is RxState.ALLOCATING:
                    return []
                if req.state is RxState.FAILED:
                    return [Send(session, Error(int(req.code or 0), req.why, rid))]
                if req.state is RxState.DONE:
                    return [Send(session, Accept(rid))]
                out: list[Effect] = [Send(session, Accept(rid))]
                if req.rdma_hold and req.state is RxState.RECEIVING:
                    req.rdma_hold = False
                    out.insert(0, ReleaseRdma(rid))
                return out
            if req.state in ARRIVING and req.session in self.gone_since:
                # a sender that lost every connection retries from a new session: the old
                # partial copy can never finish
                out = self._fail(
                    req, ErrorCode.PEER_GONE, f"superseded by a retry from session {session}", now
                )
                return out + self.begin(session, begin, now)
            return self._refuse(
                session,
                rid,
                ErrorCode.DUPLICATE_REQUEST,
                f"request {rid} belongs to another sender session",
            )
        fin = self.finished.get(rid)
        if fin is not None:
            if fin.delivered:
                if fin.session == session:
                    return [Send(session, Accept(rid))]  # its chunks are acked as duplicates
                return self._refuse(
                    session,
                    rid,
                    ErrorCode.DUPLICATE_REQUEST,
                    f"request {rid} was already delivered; a new request needs a new id",
                )
            if fin.session == session:
                return [
                    Send(
                        session, Error(int(fin.code or 0), f"request {rid} failed: {fin.why}", rid)
                    )
                ]
            # another session retrying a failed request: a new attempt
        if self.draining:
            return self._refuse(session, rid, ErrorCode.TOO_BUSY, "receiver is shutting down")
        held = self.held[session]
        share = self.session_share(session)
        if held >= share:
            why = (
                f"this sender session holds {held} transfer slots, its share of "
                f"{self.max_concurrent} with {self._sessions(session)} session(s) active"
            )
            return self._refuse(session, rid, ErrorCode.TOO_BUSY, why)
        preempted: list[Effect] = []
        if len(self.requests) >= self.max_concurrent:
            preempted = self._preempt_for(session, share, now)
            if not preempted:
                why = "too many concurrent transfers"
                return self._refuse(session, rid, ErrorCode.TOO_BUSY, why)
        if not self.fits(begin.total_bytes):
            return self._refuse(
                session,
                rid,
                ErrorCode.NO_SPACE,
                f"request needs {begin.total_bytes} bytes, more than the whole receive pool",
            )
        if self.layouts and begin.layout not in self.layouts:
            why = (
                f"request layout {begin.layout or '(none)'!r} is not what the decode engine "
                f"expects: {' | '.join(repr(x) for x in sorted(self.layouts))}"
            )
            self._remember(rid, Finished(False, session, ErrorCode.LAYOUT_MISMATCH, why))
            return self._refuse(session, rid, ErrorCode.LAYOUT_MISMATCH, why)
        window = min(begin.deadline_ms / 1000.0, self.max_deadline_s)
        clock = Deadline.start(now, window, self.max_transfer_s)
        self.requests[rid] = RxRequest(begin, session, now, clock)
        self.held[session] += 1
        return [*preempted, Allocate(rid, begin.total_bytes)]

    def _sessions(self, asking: str) -> int:
        """Sessions with a claim on slots: connected now, or holding requests (a session that
        hung up keeps its requests for the orphan grace), and the one asking."""
        return len({asking, *self.connections, *self.held})

    def session_share(self, asking: str) -> int:
        """Transfer slots one sender session may hold: an equal share among the active
        sessions, and never more than three quarters of all, so a session that came alone
        cannot keep a newcomer out for a whole deadline (one peer's 256 BEGINs made every
        other sender's TOO_BUSY, again and again)."""
        n = self._sessions(asking)
        cap = self.max_concurrent - self.max_concurrent // 4
        return max(1, min(cap, self.max_concurrent // n))

    def _preempt_for(self, session: str, share: int, now: float) -> list[Effect]:
        """The table is full and ``session`` is under its share: fail the newest request of
        the session most over its share that has not received a byte yet (its sender is told
        TOO_BUSY and may retry), so shares taken when fewer sessions were active give way.
        Nothing when no session is over its share or none of its requests is untouched."""
        over = [(n, k) for k, n in self.held.items() if k != session and n > share]
        if not over:
            return []
        _, hog = max(over)
        untouched = [
            r
            for r in self.requests.values()
            if r.session == hog
            and r.state in ARRIVING
            and not r.rdma_hold
            and (r.tracker is None or r.tracker.verified_bytes == 0)
        ]
        if not untouched:
            return []
        victim = max(reversed(untouched), key=lambda r: r.created)  # newest; last on ties
        why = (
            f"preempted: session {hog} holds {self.held[hog]} of {self.max_concurrent} "
            f"transfer slots, more than its share of {share}; another session needed one"
        )
        return self._fail(victim, ErrorCode.TOO_BUSY, why, now)

    def allocated(self, rid: str, offset: int, req: RxRequest | None = None) -> list[Effect]:
        """Pool room found at ``offset`` for ``req`` (the request the allocation was started
        for: the rid may have ended and been begun again meanwhile); ACCEPT, unless it ended
        while waiting."""
        current = self.requests.get(rid)
        if current is None or (req is not None and current is not req):
            return [Free(rid, offset)]
        req = current
        if req.state is not RxState.ALLOCATING:
            return [Free(rid, offset)]
        req.offset = offset
        req.tracker = ReceiveTracker(req.begin)
        req.state = RxState.RECEIVING
        out: list[Effect] = []
        if req.tracker.complete:  # nothing to receive (a request of empty layers)
            out += self._complete(req, req.created)
        return [Send(req.session, Accept(rid)), *out]

    def alloc_failed(self, rid: str, code: ErrorCode, why: str, now: float) -> list[Effect]:
        req = self.requests.get(rid)
        if req is None or req.state is not RxState.ALLOCATING:
            return []
        return self._fail(req, code, why, now)

    def chunk_verdict(self, session: str, rid: str) -> tuple[ChunkVerdict, RxRequest | None]:
        """What to do with a CHUNK (or an RDMA write) of ``rid`` from ``session``."""
        req = self.requests.get(rid)
        if req is not None and req.session == session:
            state = req.state
            if state is RxState.RECEIVING:
                return ChunkVerdict.LAND, req
            if state is RxState.COMPLETE or state is RxState.CLAIMED or state is RxState.DONE:
                return ChunkVerdict.ACK_DUPLICATE, req
            if state is RxState.ALLOCATING:
                return ChunkVerdict.EARLY, req
            return ChunkVerdict.ENDED, req
        if req is None:
            fin = self.finished.get(rid)
            if fin is not None and fin.session == session:
                return (ChunkVerdict.ACK_DUPLICATE if fin.delivered else ChunkVerdict.ENDED), None
        return ChunkVerdict.UNKNOWN, None

    def kept(self, session: str, rid: str, now: float) -> None:
        """KEEP or END from ``rid``'s sender session: it still holds the request live (its
        engine may be computing, and no chunk goes out until one is whole), so its window
        starts again. Any other session's word, or one for an ended request, is nothing."""
        req = self.requests.get(rid)
        if req is not None and req.session == session and req.state in ARRIVING:
            req.clock.progress(now)

    def progressed(self, req: RxRequest, now: float) -> None:
        """New bytes of ``req`` were verified: its window starts again."""
        if req.state is RxState.RECEIVING:
            req.clock.progress(now)

    def chunk_done(self, req: RxRequest, out: ChunkOutcome, now: float) -> list[Effect]:
        """A chunk of ``req`` was verified (or, ``live_corrupted``, bytes once counted were
        found bad). The caller already ACKed or NACKed the chunk itself."""
        if req.state is not RxState.RECEIVING:
            return []
        effects: list[Effect] = []
        if out.live_corrupted:
            return effects
        if out.newly_verified or out.copy_from_scratch:  # RDMA reports whole layers here
            req.clock.progress(now)
        if out.layer_done is not None:
            effects.append(Send(req.session, LayerDone(req.rid, out.layer_done)))
        if out.request_done:
            effects += self._complete(req, now)
        return effects

    def violated(self, req: RxRequest, why: str, now: float) -> list[Effect]:
        """``req``'s sender broke the protocol in a way only its own request pays for (two
        first sends of one chunk): it fails, and its sender is told why."""
        return self._fail(req, ErrorCode.OUT_OF_ORDER, why, now)

    def cancel(self, session: str, rid: str, reason: str, now: float) -> list[Effect]:
        """The sender gave the request up. Its CANCEL comes after its RDMA writes drained,
        so an RDMA hold ends with it."""
        req = self.requests.get(rid)
        if req is None:
            if rid not in self.finished:
                # its BEGIN may still be on its way on another connection
                self.early_cancels[(session, rid)] = reason
                while len(self.early_cancels) > self.memory:
                    self.early_cancels.popitem(last=False)
            return []
        if req.session != session:
            return []  # not the owner's: ignored
        out: list[Effect] = []
        if req.rdma_hold:
            req.rdma_hold = False
            out.append(ReleaseRdma(rid))
        if req.state in ARRIVING:
            why = f"cancelled by sender: {reason}"
            out += self._fail(req, ErrorCode.CANCELLED, why, now, tell=False)
        else:
            out += self._maybe_let_go(req)
        return out

    def connection_up(self, session: str, identity: str = "") -> str:
        """A data connection says HELLO for ``session``; ``identity`` is who it proved to be
        (its TLS certificate's names, else its address). The first connection binds the
        session to that identity for as long as the book remembers the session; a
        connection of anyone else that presents the same session id is refused (the reason
        is returned, "" = admitted): a session id seen in a log is no key to its requests."""
        owner = self.owners.setdefault(session, identity)
        if owner != identity:
            return (
                f"session {session} belongs to another peer ({owner}); this connection is "
                f"{identity}"
            )
        self.connections[session] += 1
        self.gone_since.pop(session, None)
        return ""

    def connection_down(self, session: str, now: float) -> None:
        self.connections[session] -= 1
        if self.connections[session] <= 0:
            del self.connections[session]
            self.gone_since[session] = now

    # --- RDMA holds ---------------------------------------------------------------------------

    def hold_for_rdma(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            req.rdma_hold = True

    def rdma_gone(self, rids: Iterable[str]) -> list[Effect]:
        """The queue pair these requests were granted on is destroyed: nothing can land any
        more, so held buffers may go."""
        out: list[Effect] = []
        for rid in rids:
            req = self.requests.get(rid)
            if req is not None and req.rdma_hold:
                req.rdma_hold = False
                out += self._maybe_let_go(req)
        return out

    # --- engine side -------------------------------------------------------------------------

    def engine_layout(self, conn: Conn, layout: str) -> None:
        self._forget_layout(conn)
        self.engine_layouts[conn] = layout
        self.layouts[layout] += 1

    def engine_readers_of(self, conn: Conn, readers: int) -> None:
        """``conn`` is one of ``readers`` connections of an engine that all read each of its
        requests (one per tensor-parallel rank holding the same bytes)."""
        if readers > 1:
            self.engine_readers[conn] = readers
        else:
            self.engine_readers.pop(conn, None)

    def claim(
        self, conn: Conn, rid: str | None, now: float
    ) -> tuple[RxRequest | Wait | Refusal, list[Effect]]:
        """Hand a complete request (the oldest, or ``rid``) to ``conn``."""
        layout = self.engine_layouts.get(conn)
        effects: list[Effect] = []
        if rid is None:
            for r in list(self.ready):
                ready = self.requests[r]
                if layout is not None and ready.begin.layout != layout:
                    effects += self._mismatch(ready, layout, now)
                    continue
                return self._take(ready, conn), effects
            return WAIT, effects
        req = self.requests.get(rid)
        if req is None:
            fin = self.finished.get(rid)
            if fin is None:
                return WAIT, effects  # it may not have begun yet
            if fin.delivered:
                return Refusal("RELEASED", f"{rid} was delivered and released already"), effects
            return Refusal((fin.code or ErrorCode.CANCELLED).name, fin.why), effects
        if req.state is RxState.COMPLETE:
            if layout is not None and req.begin.layout != layout:
                effects += self._mismatch(req, layout, now)
                return Refusal("LAYOUT_MISMATCH", req.why), effects
            return self._take(req, conn), effects
        if req.state is RxState.CLAIMED:
            if conn in req.claims:
                return req, effects
            if self._may_share(req, conn):
                req.claims.add(conn)
                return req, effects
            return Refusal("NOT_OWNER", f"{rid} was handed to another engine connection"), effects
        if req.state is RxState.DONE:
            return Refusal("RELEASED", f"{rid} was delivered and released already"), effects
        if req.state is RxState.FAILED:
            return Refusal((req.code or ErrorCode.CANCELLED).name, req.why), effects
        return WAIT, effects

    def claim_any(
        self, conn: Conn, rids: tuple[str, ...], now: float
    ) -> tuple[RxRequest | Wait | Refusal, list[Effect]]:
        """The first of ``rids`` that is complete (oldest first), or the first that failed
        (named in the refusal, so the engine learns which), or WAIT."""
        wanted = set(rids)
        effects: list[Effect] = []
        for r in list(self.ready):
            if r in wanted:
                got, more = self.claim(conn, r, now)
                effects += more
                if isinstance(got, Refusal):  # named: the engine fails that one, no other
                    return Refusal(got.code, got.why, r), effects
                if not isinstance(got, Wait):
                    return got, effects
        requests, finished = self.requests, self.finished
        for rid in rids:
            req = requests.get(rid)
            if req is None:
                if rid not in finished:
                    continue  # not begun yet, the common case of a poll: WAIT, cheaply
            elif req.state in ARRIVING:
                continue  # on its way: WAIT
            got, more = self.claim(conn, rid, now)
            effects += more
            if isinstance(got, Refusal):
                return Refusal(got.code, got.why, rid), effects
            if isinstance(got, RxRequest):  # claimed meanwhile by this very connection
                return got, effects
        return WAIT, effects

    def state_of(self, rid: str) -> str:
        """Where ``rid`` stands, for an engine that looks without claiming (``Look``): its
        state's value, ``done`` / ``failed`` once it ended (remembered, bounded),
        ``discarded`` when its decode gave it up before it began, else ``unknown``."""
        req = self.requests.get(rid)
        if req is not None:
            return req.state.value
        fin = self.finished.get(rid)
        if fin is not None:
            return (RxState.DONE if fin.delivered else RxState.FAILED).value
        return "discarded" if rid in self.early_discards else "unknown"

    def known(self, rid: str) -> bool:
        """Whether the receiver ever heard of ``rid`` (recently): arriving, complete, ended or
        discarded early. A wait for an unknown one is UNKNOWN_REQUEST, not TIMEOUT."""
        return rid in self.requests or rid in self.finished or rid in self.early_discards

    def discard(
        self, conn: Conn, rid: str, why: str, now: float
    ) -> tuple[Refusal | None, list[Effect]]:
        """The decode engine will never use ``rid`` (its request was aborted, it timed out
        and recomputed): stop it arriving (its sender is told), free it if complete, or
        refuse it when it comes."""
        req = self.requests.get(rid)
        if req is None:
            if rid not in self.finished:
                self.early_discards[rid] = why
                while len(self.early_discards) > self.memory:
                    self.early_discards.popitem(last=False)
            return None, []
        if req.state in ARRIVING:
            return None, self._fail(
                req, ErrorCode.CANCELLED, f"discarded by the decode engine: {why}", now
            )
        if req.state is RxState.COMPLETE:
            return None, self._drop_complete(req, ErrorCode.CANCELLED, f"discarded: {why}")
        if req.state is RxState.CLAIMED:
            if conn not in req.claims:
                return Refusal("NOT_OWNER", f"{rid} was handed to another engine connection"), []
            return self.release(conn, rid)
        return None, []  # ended already

    def pin_layer(self, conn: Conn, rid: str, layer: int) -> RxRequest | Wait | Refusal:
        """Layer-wise decode: ``layer`` of ``rid`` once it is verified, pinned for ``conn``
        until it releases the request."""
        req = self.requests.get(rid)
        if req is None:
            fin = self.finished.get(rid)
            if fin is None:
                return WAIT
            if fin.delivered:
                return Refusal("RELEASED", f"{rid} was delivered and released already")
            return Refusal((fin.code or ErrorCode.CANCELLED).name, fin.why)
        if not 0 <= layer < len(req.begin.layer_sizes):
            return Refusal("BAD_REQUEST", f"{rid} has no layer {layer}")
        if req.state is RxState.FAILED:
            return Refusal((req.code or ErrorCode.CANCELLED).name, req.why)
        if req.state is RxState.DONE:
            return Refusal("RELEASED", f"{rid} was delivered and released already")
        if req.state is RxState.CLAIMED and conn not in req.claims:
            return Refusal("NOT_OWNER", f"{rid} was handed to another engine connection")
        if req.tracker is None or not req.tracker.layer_complete(layer):
            return WAIT
        req.pins.add(conn)
        return req

    def release(self, conn: Conn, rid: str) -> tuple[Refusal | None, list[Effect]]:
        """``conn`` is done with ``rid``: its claim ends (the request is delivered for good
        once all its readers released it) and its pins go."""
        req = self.requests.get(rid)
        if req is None:
            fin = self.finished.get(rid)
            if fin is not None and fin.delivered:
                return Refusal("RELEASED", f"{rid} was released already"), []
            return Refusal("UNKNOWN_REQUEST", f"no request {rid!r} here"), []
        if conn in req.claims and req.state is RxState.CLAIMED:
            req.pins.discard(conn)
            req.claims.discard(conn)
            req.read_by.add(conn)
            if len(req.read_by) < req.readers:
                return None, []  # its other readers still read it
            return None, self._released_for_good(req)
        if conn in req.pins:
            req.pins.discard(conn)
            return None, self._maybe_let_go(req)
        if req.state is RxState.DONE:
            return Refusal("RELEASED", f"{rid} was released already"), []
        if req.state is RxState.CLAIMED:
            return Refusal("NOT_OWNER", f"{rid} was handed to another engine connection"), []
        return Refusal("NOT_OWNER", f"{rid} was not handed to this connection"), []

    def engine_gone(self, conn: Conn) -> list[Effect]:
        """An engine connection closed: its claims go back to the ready queue (oldest
        first), its pins go. A shared request some reader still holds, or already read,
        stays claimed: the place of the one that left is open again."""
        self._forget_layout(conn)
        self.engine_readers.pop(conn, None)
        out: list[Effect] = []
        back: list[RxRequest] = []
        for req in list(self.requests.values()):
            if conn in req.claims and req.state is RxState.CLAIMED:
                req.claims.discard(conn)
                if not req.claims and not req.read_by:
                    req.state = RxState.COMPLETE
                    req.readers = 1
                    back.append(req)
                    out.append(Requeued(req.rid))
            if conn in req.pins:
                req.pins.discard(conn)
                out += self._maybe_let_go(req)
        for req in sorted(back, key=lambda r: r.completed_at, reverse=True):
            self.ready.appendleft(req.rid)
        return out

    # --- the clock and shutdown --------------------------------------------------------------

    def tick(self, now: float) -> list[Effect]:
        out: list[Effect] = []
        for req in list(self.requests.values()):
            if req.state in ARRIVING:
                gone = self.gone_since.get(req.session)
                if gone is not None and now - gone > self.orphan_grace_s:
                    out += self._fail(
                        req,
                        ErrorCode.PEER_GONE,
                        f"its sender session has had no connection for {now - gone:.1f}s",
                        now,
                    )
                elif req.clock.passed(now):
                    got = req.tracker.verified_bytes if req.tracker else 0
                    out += self._fail(
                        req,
                        ErrorCode.DEADLINE,
                        f"{req.clock.why(req.created)} "
                        f"({got}/{req.begin.total_bytes} bytes received)",
                        now,
                    )
            elif (
                req.state is RxState.COMPLETE
                and not req.pins
                and now - req.completed_at > self.unclaimed_ttl_s
            ):
                why = f"complete but claimed by no engine for {self.unclaimed_ttl_s:g}s"
                out += self._drop_complete(req, ErrorCode.DEADLINE, why)
            elif (
                req.state is RxState.CLAIMED
                and not req.claims
                and not req.pins
                and now - req.completed_at > self.unclaimed_ttl_s
            ):
                # read by some of its readers; the others never came for it
                out += self._released_for_good(req)
        for session, since in list(self.gone_since.items()):
            if now - since > max(self.orphan_grace_s, 1.0) * 4 and not self.held[session]:
                del self.gone_since[session]  # nothing of it left to fail: forget it
                self.owners.pop(session, None)
        return out

    def fail_arriving(self, code: ErrorCode, why: str, now: float) -> list[Effect]:
        out: list[Effect] = []
        for req in self.arriving():
            out += self._fail(req, code, why, now)
        return out

    # --- internals ---------------------------------------------------------------------------

    def _take(self, req: RxRequest, conn: Conn) -> RxRequest:
        self.ready.remove(req.rid)
        req.state = RxState.CLAIMED
        req.claims = {conn}
        req.readers = self.engine_readers.get(conn, 1)
        req.read_by = set()
        return req

    def _released_for_good(self, req: RxRequest) -> list[Effect]:
        """A claimed request every reader that will come is done with: delivered for good."""
        req.state = RxState.DONE
        self._remember(req.rid, Finished(True, req.session, None, ""))
        return self._maybe_let_go(req)

    def _may_share(self, req: RxRequest, conn: Conn) -> bool:
        """Whether ``conn`` is one more reader of a shared request: its engine reads with
        as many connections as the first claimer's, of the same layout, and a place is open."""
        first = next(iter(req.claims), None)
        layout = self.engine_layouts.get(conn)
        return (
            req.readers > 1
            and self.engine_readers.get(conn, 1) == req.readers
            and len(req.claims) + len(req.read_by) < req.readers
            and conn not in req.read_by  # one read per connection: its other ranks need theirs
            and (layout is None or layout == req.begin.layout)
            and (first is None or self.engine_layouts.get(first) == layout)
        )

    def _complete(self, req: RxRequest, now: float) -> list[Effect]:
        req.state = RxState.COMPLETE
        req.completed_at = now
        self.ready.append(req.rid)
        out: list[Effect] = [Send(req.session, Complete(req.rid, req.begin.total_bytes))]
        if req.rdma_hold:  # every chunk landed: the sender writes no more to it
            req.rdma_hold = False
            out.append(ReleaseRdma(req.rid))
        out.append(Delivered(req.rid))
        return out

    def _fail(
        self, req: RxRequest, code: ErrorCode, why: str, now: float, *, tell: bool = True
    ) -> list[Effect]:
        """An arriving request fails; its sender is told (unless it is the one that gave up)."""
        if req.state not in ARRIVING:
            return []
        req.state = RxState.FAILED
        req.code, req.why, req.failed_at = code, why, now
        out: list[Effect] = [Failed(req.rid, code, why)]
        if tell:
            out.append(Send(req.session, Error(int(code), why, req.rid)))
        self._remember(req.rid, Finished(False, req.session, code, why))
        return out + self._maybe_let_go(req)

    def _mismatch(self, req: RxRequest, layout: str, now: float) -> list[Effect]:
        """A complete request of another layout than the engine's: it can never be used."""
        why = f"request layout {req.begin.layout or '(none)'!r} is not this engine's {layout!r}"
        return self._drop_complete(req, ErrorCode.LAYOUT_MISMATCH, why)

    def _drop_complete(self, req: RxRequest, code: ErrorCode, why: str) -> list[Effect]:
        """A complete, unclaimed request that no engine will ever use."""
        self.ready.remove(req.rid)
        req.state, req.code, req.why = RxState.FAILED, code, why
        self._remember(req.rid, Finished(False, req.session, code, why))
        return [Failed(req.rid, code, why), *self._maybe_let_go(req)]

    def _maybe_let_go(self, req: RxRequest) -> list[Effect]:
        """An ended request leaves the book once nothing holds its buffer."""
        if req.state not in ENDED or req.pins or req.rdma_hold:
            return []
        if self.requests.pop(req.rid, None) is not None:
            self.held[req.session] -= 1
            if self.held[req.session] <= 0:
                del self.held[req.session]
        if req.offset is None:
            return []
        offset, req.offset = req.offset, None
        return [Free(req.rid, offset)]

    def _refuse(self, session: str, rid: str, code: ErrorCode, why: str) -> list[Effect]:
        return [Refused(rid, code, why), Send(session, Error(int(code), why, rid))]

    def _remember(self, rid: str, fin: Finished) -> None:
        self.finished[rid] = fin
        self.finished.move_to_end(rid)
        while len(self.finished) > self.memory:
            self.finished.popitem(last=False)

    def _forget_layout(self, conn: Conn) -> None:
        layout = self.engine_layouts.pop(conn, None)
        if layout is not None:
            self.layouts[layout] -= 1
            if self.layouts[layout] <= 0:
                del self.layouts[layout]
