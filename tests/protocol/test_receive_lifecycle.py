"""The receiver's request lifecycle without sockets: who owns a request, who may read and
release it, and what happens at every end (tests named after the rule they check)."""

from __future__ import annotations

from typing import Any

from xdc.protocol import Accept, Begin, ChunkHeader, Complete, Error, ErrorCode, LayerDone
from xdc.protocol.books.receive import (
    WAIT,
    Allocate,
    ChunkVerdict,
    Delivered,
    Effect,
    Failed,
    Free,
    ReceiveBook,
    Refusal,
    Refused,
    ReleaseRdma,
    Requeued,
    RxRequest,
    RxState,
    Send,
)

CHUNK = 4096
A, B = "session-a", "session-b"


def book(**kw: object) -> ReceiveBook:
    args: dict[str, object] = {"fits": lambda n: n <= 1 << 30, "max_concurrent": 8}
    args.update(kw)
    return ReceiveBook(**args)  # type: ignore[arg-type]


def begin(rid: str = "r", sizes: tuple[int, ...] = (2 * CHUNK, CHUNK), **kw: object) -> Begin:
    fields: dict[str, object] = {"deadline_ms": 10_000}
    fields.update(kw)
    return Begin(rid, sizes, CHUNK, (), 0, **fields)  # type: ignore[arg-type]


def state_of(req: RxRequest) -> RxState:
    """The state now, read through a call so that mypy keeps no narrowing from a check above."""
    return req.state


def sent(effects: list[Effect]) -> list[object]:
    return [e.event for e in effects if isinstance(e, Send)]


def started(
    b: ReceiveBook,
    rid: str = "r",
    session: str = A,
    offset: int = 0,
    **kw: Any,
) -> RxRequest:
    """BEGIN accepted and allocated (at 0 s): receiving."""
    out = b.begin(session, begin(rid, **kw), 0.0)
    assert out == [Allocate(rid, begin(rid, **kw).total_bytes)], out
    assert sent(b.allocated(rid, offset)) == [Accept(rid)]
    req = b.get(rid)
    assert req is not None and req.state is RxState.RECEIVING
    return req


def shared_ready(b: ReceiveBook, *ranks: str, now: float = 1.0) -> RxRequest:
    """Request "r" complete, and ``ranks`` the connections of a two-rank shared-read engine."""
    req = started(b)
    land_all(b, req, now)
    for rank in ranks:
        b.engine_readers_of(rank, 2)
    return req


def land_all(b: ReceiveBook, req: RxRequest, now: float = 1.0) -> list[Effect]:
    """Every chunk verified, in order, as the TCP path would report them."""
    assert req.tracker is not None
    out: list[Effect] = []
    for layer in range(len(req.begin.layer_sizes)):
        for off, n in req.tracker.grid.chunks(layer):
            hdr = ChunkHeader(req.rid, layer, off, n, 0)
            _, disp = req.tracker.locate(hdr)
            out += b.chunk_done(req, req.tracker.finish(hdr, disp, True), now)
    return out


def test_a_request_is_delivered_only_when_every_byte_is_verified_and_freed_when_released() -> None:
    b = book()
    req = started(b)
    assert b.claim("engine", "r", 0.5)[0] is WAIT  # arriving: not visible yet
    out = land_all(b, req)
    assert sent(out) == [LayerDone("r", 0), LayerDone("r", 1), Complete("r", 3 * CHUNK)]
    assert Delivered("r") in out and req.state is RxState.COMPLETE
    got, _ = b.claim("engine", None, 2.0)
    assert got is req and state_of(req) is RxState.CLAIMED
    refusal, out = b.release("engine", "r")
    assert refusal is None and out == [Free("r", 0)]
    assert b.get("r") is None and b.finished["r"].delivered


def test_a_look_says_where_a_request_stands_and_claims_nothing() -> None:
    """What a decode scheduler reads before it gives a request KV blocks (``Look``)."""
    b = book()
    assert b.state_of("r") == "unknown"
    b.begin(A, begin("r"), 0.0)
    assert b.state_of("r") == "allocating"
    b.allocated("r", 0)
    req = b.get("r")
    assert req is not None and b.state_of("r") == "receiving"
    land_all(b, req)
    assert b.state_of("r") == "complete" and b.state_of("r") == "complete"
    assert list(b.ready) == ["r"]  # looking took nothing from the ready queue
    b.claim("engine", "r", 2.0)
    assert b.state_of("r") == "claimed"
    b.release("engine", "r")
    assert b.state_of("r") == "done"
    started(b, "f")
    b.cancel(A, "f", "sender gave up", 3.0)
    assert b.state_of("f") == "failed"
    b.discard("engine", "gone", "aborted", 3.0)
    assert b.state_of("gone") == "discarded"


def test_another_session_can_neither_land_cancel_nor_rebegin_a_request_it_did_not_begin() -> None:
    b = book()
    req = started(b)
    b.connection_up(A)
    assert b.chunk_verdict(B, "r") == (ChunkVerdict.UNKNOWN, None)
    assert b.cancel(B, "r", "mine now", 1.0) == []
    out = b.begin(B, begin("r"), 1.0)
    assert Refused("r", ErrorCode.DUPLICATE_REQUEST, out[0].why) in out  # type: ignore[union-attr]
    assert req.state is RxState.RECEIVING and b.chunk_verdict(A, "r") == (ChunkVerdict.LAND, req)


def test_the_same_begin_again_gets_its_accept_again_and_other_contents_are_refused() -> None:
    b = book()
    started(b)
    assert sent(b.begin(A, begin("r"), 1.0)) == [Accept("r")]
    out = b.begin(A, begin("r", sizes=(CHUNK,)), 1.0)
    assert isinstance(out[0], Refused) and out[0].code is ErrorCode.DUPLICATE_REQUEST
    b2 = book()
    b2.begin(A, begin("q"), 0.0)
    assert b2.begin(A, begin("q"), 0.5) == []  # still allocating: the ACCEPT is still to come


def test_a_repeated_begin_under_an_rdma_grant_gives_the_slot_back() -> None:
    """It never saw our ACCEPT, so it wrote nothing by RDMA under that grant."""
    b = book()
    started(b)
    b.hold_for_rdma("r")
    out = b.begin(A, begin("r"), 1.0)
    assert out == [ReleaseRdma("r"), Send(A, Accept("r"))]
    assert b.get("r").rdma_hold is False  # type: ignore[union-attr]


def test_a_cancel_that_overtakes_its_begin_makes_the_late_begin_refused() -> None:
    b = book()
    assert b.cancel(A, "r", "engine gave up", 0.0) == []
    out = b.begin(A, begin("r"), 0.1)
    assert isinstance(out[0], Refused) and out[0].code is ErrorCode.CANCELLED
    assert b.get("r") is None
    # only that session's: another session's request of the same id is not cancelled
    assert b.cancel(A, "s", "x", 0.0) == [] and isinstance(b.begin(B, begin("s"), 0.1)[0], Allocate)


def test_a_request_past_its_deadline_fails_and_its_sender_is_told() -> None:
    b = book()
    req = started(b)
    assert b.tick(5.0) == []
    out = b.tick(10.5)
    assert Failed("r", ErrorCode.DEADLINE, req.why) in out and Free("r", 0) in out
    errors = [e for e in sent(out) if isinstance(e, Error)]
    assert errors and errors[0].code == ErrorCode.DEADLINE and errors[0].rid == "r"
    refusal, _ = b.claim("engine", "r", 11.0)
    assert isinstance(refusal, Refusal) and refusal.code == "DEADLINE"


def land_one(b: ReceiveBook, req: RxRequest, layer: int, off: int, now: float) -> None:
    """One chunk verified, as the TCP path reports it (progress, then chunk_done)."""
    assert req.tracker is not None
    hdr = ChunkHeader(req.rid, layer, off, CHUNK, 0)
    _, disp = req.tracker.locate(hdr)
    out = req.tracker.finish(hdr, disp, True)
    if out.newly_verified:
        b.progressed(req, now)
    b.chunk_done(req, out, now)


def test_a_request_that_keeps_arriving_outlives_its_window() -> None:
    """Its sender streams as the prefill runs: only a stall of a window fails it."""
    b = book()
    req = started(b)  # window 10 s from 0
    land_one(b, req, 0, 0, 8.0)
    assert b.tick(10.5) == [] and req.deadline == 18.0
    land_one(b, req, 0, 0, 15.0)  # a duplicate is no progress
    assert req.deadline == 18.0
    land_one(b, req, 0, CHUNK, 17.0)
    assert b.tick(26.0) == []
    out = b.tick(27.5)
    assert Failed("r", ErrorCode.DEADLINE, req.why) in out
    assert req.why.startswith("no progress for 10.0s (8192/12288 bytes received)")


def test_keep_or_end_from_its_own_session_start_its_window_again() -> None:
    """Chunks go out only once all their bytes are final, so they may pause for a whole
    prefill: the sender, which sees the engine, says KEEP while it holds the request."""
    b = book(max_transfer_s=100.0)
    req = started(b)
    b.kept(A, "r", 8.0)
    assert req.deadline == 18.0
    b.kept(B, "r", 12.0)  # another session's word is nothing to this request
    b.kept(A, "other", 12.0)
    assert req.deadline == 18.0 and b.tick(17.0) == []
    b.kept(A, "r", 17.5)  # END
    assert b.tick(27.0) == []
    assert Free("r", 0) in b.tick(28.0)
    assert req.why == "no progress for 10.0s (0/12288 bytes received)"
    b.kept(A, "r", 28.5)  # too late: an ended request stays ended
    assert req.state is RxState.FAILED


def test_no_keep_holds_a_request_past_max_transfer_s() -> None:
    """A sender saying KEEP forever (a bug, or hostile) cannot hold pool space forever."""
    b = book(max_transfer_s=100.0)
    req = started(b)
    for t in range(5, 100, 5):
        b.kept(A, "r", float(t))
        assert b.tick(float(t)) == []
    assert Free("r", 0) in b.tick(100.5)
    assert req.why.startswith("not done within its limit of 100.0s")


def test_the_window_is_the_senders_but_never_longer_than_ours() -> None:
    b = book(max_deadline_s=4.0)
    req = started(b)  # the sender asks for 10 s
    assert req.deadline == 4.0
    land_one(b, req, 0, 0, 3.0)
    assert req.deadline == 7.0


def test_no_trickle_of_chunks_keeps_a_request_past_max_transfer_s() -> None:
    """A sender dripping a chunk now and then cannot hold pool space forever."""
    b = book(max_transfer_s=12.0)
    req = started(b)
    land_one(b, req, 0, 0, 5.0)
    land_one(b, req, 0, CHUNK, 9.0)
    assert req.deadline == 12.0
    out = b.tick(12.5)
    assert Free("r", 0) in out
    assert req.why.startswith("not done within its limit of 12.0s")


def test_a_session_gone_longer_than_the_grace_loses_its_partial_requests() -> None:
    b = book(orphan_grace_s=2.0)
    started(b)
    b.connection_up(A)
    b.connection_down(A, 1.0)
    assert b.tick(2.5) == []  # a blip: it may reconnect
    out = b.tick(3.5)
    assert any(isinstance(e, Failed) and e.code is ErrorCode.PEER_GONE for e in out)
    assert Free("r", 0) in out


def test_a_reconnecting_session_keeps_its_partial_requests() -> None:
    b = book(orphan_grace_s=2.0)
    req = started(b)
    b.connection_up(A)
    b.connection_down(A, 1.0)
    b.connection_up(A)
    assert b.tick(9.0) == [] and req.state is RxState.RECEIVING


def test_a_restarted_sender_retrying_a_partial_request_supersedes_it_at_once() -> None:
    b = book(orphan_grace_s=60.0)
    started(b)
    b.connection_up(A)
    b.connection_down(A, 1.0)  # the old sender died
    out = b.begin(B, begin("r"), 1.5)
    assert any(isinstance(e, Failed) and e.code is ErrorCode.PEER_GONE for e in out)
    assert Free("r", 0) in out and Allocate("r", 3 * CHUNK) in out
    assert b.get("r").session == B  # type: ignore[union-attr]


def test_a_retry_of_a_failed_request_from_another_session_is_a_new_attempt() -> None:
    b = book()
    started(b)
    b.tick(11.0)  # failed at its deadline
    assert isinstance(b.begin(B, begin("r"), 12.0)[0], Allocate)
    # but its own session re-sending the BEGIN learns the failure
    b2 = book()
    started(b2)
    b2.tick(11.0)
    errors = [e for e in sent(b2.begin(A, begin("r"), 12.0)) if isinstance(e, Error)]
    assert errors and errors[0].code == ErrorCode.DEADLINE


def test_a_delivered_request_cannot_be_begun_again_by_another_session() -> None:
    b = book()
    req = started(b)
    land_all(b, req)
    b.claim("e", "r", 2.0)
    b.release("e", "r")
    out = b.begin(B, begin("r"), 3.0)
    assert isinstance(out[0], Refused) and out[0].code is ErrorCode.DUPLICATE_REQUEST
    assert sent(b.begin(A, begin("r"), 3.0)) == [Accept("r")]  # its own sender missed it
    assert b.chunk_verdict(A, "r") == (ChunkVerdict.ACK_DUPLICATE, None)
    assert b.chunk_verdict(B, "r") == (ChunkVerdict.UNKNOWN, None)


def test_only_the_engine_connection_it_was_handed_to_may_release_it() -> None:
    b = book()
    req = started(b)
    land_all(b, req)
    assert b.claim("one", "r", 2.0)[0] is req
    refusal, out = b.release("two", "r")
    assert isinstance(refusal, Refusal) and refusal.code == "NOT_OWNER" and out == []
    assert b.claim("two", "r", 2.0)[0] == Refusal("NOT_OWNER", b.claim("two", "r", 2.0)[0].why)  # type: ignore[union-attr]
    assert b.claim("one", "r", 2.0)[0] is req  # asking again is harmless
    assert req.state is RxState.CLAIMED and req.offset == 0


def test_a_claimed_request_goes_back_to_the_front_of_the_queue_when_its_engine_leaves() -> None:
    b = book()
    first, second = started(b, "first", offset=0), started(b, "second", offset=1 << 20)
    land_all(b, first, now=1.0)
    land_all(b, second, now=2.0)
    assert b.claim("crashy", None, 3.0)[0] is first
    assert b.engine_gone("crashy") == [Requeued("first")]
    assert list(b.ready) == ["first", "second"]
    assert b.claim("next", None, 4.0)[0] is first  # not lost, not reordered


def test_a_pinned_layer_keeps_its_buffer_when_the_request_fails_until_the_pin_goes() -> None:
    """The engine reading a layer of a request that then fails must not see its bytes change
    to another request's: the buffer is not reused while it holds the view."""
    b = book()
    req = started(b)
    assert req.tracker is not None
    for off, n in req.tracker.grid.chunks(0):
        hdr = ChunkHeader("r", 0, off, n, 0)
        _, disp = req.tracker.locate(hdr)
        b.chunk_done(req, req.tracker.finish(hdr, disp, True), 1.0)
    assert b.pin_layer("reader", "r", 1) is WAIT
    assert b.pin_layer("reader", "r", 0) is req
    out = b.tick(11.5)  # a window after layer 0 arrived: layer 1 never came
    assert any(isinstance(e, Failed) for e in out) and not any(isinstance(e, Free) for e in out)
    assert b.get("r") is req and req.offset == 0  # held
    refusal, out = b.release("reader", "r")
    assert refusal is None and out == [Free("r", 0)] and b.get("r") is None


def test_a_request_released_by_its_claimer_stays_held_while_another_connection_pins_it() -> None:
    b = book()
    req = started(b)
    land_all(b, req)
    assert b.pin_layer("layer-reader", "r", 0) is req
    b.claim("claimer", "r", 2.0)
    refusal, out = b.release("claimer", "r")
    assert refusal is None and out == [] and req.state is RxState.DONE
    assert b.release("layer-reader", "r") == (None, [Free("r", 0)])
    assert b.get("r") is None


def test_an_engine_leaving_drops_its_pins() -> None:
    b = book()
    req = started(b)
    land_all(b, req)
    b.pin_layer("reader", "r", 0)
    b.claim("claimer", "r", 2.0)
    b.release("claimer", "r")
    assert b.engine_gone("reader") == [Free("r", 0)]


def test_a_complete_request_nobody_claims_is_freed_after_the_ttl() -> None:
    b = book(unclaimed_ttl_s=30.0)
    req = started(b)
    land_all(b, req, now=1.0)
    assert b.tick(20.0) == []
    out = b.tick(31.5)
    assert Free("r", 0) in out and not b.ready
    refusal, _ = b.claim("late", "r", 32.0)
    assert isinstance(refusal, Refusal) and refusal.code == "DEADLINE"


def test_a_registered_layout_refuses_other_layouts_before_any_byte_and_remembers_why() -> None:
    b = book()
    b.engine_layout("decoder", "block=32")
    out = b.begin(A, begin("r", layout="block=16"), 0.0)
    assert isinstance(out[0], Refused) and out[0].code is ErrorCode.LAYOUT_MISMATCH
    assert "block=16" in out[0].why and "block=32" in out[0].why
    refusal, _ = b.claim("decoder", "r", 0.1)
    assert isinstance(refusal, Refusal) and refusal.code == "LAYOUT_MISMATCH"
    assert isinstance(b.begin(A, begin("s", layout="block=32"), 0.2)[0], Allocate)
    b.engine_gone("decoder")
    assert not b.layouts  # nobody to ask any more: anything is accepted again


def test_a_request_of_another_layout_delivered_before_the_engine_said_is_refused_at_claim() -> None:
    b = book()
    req = started(b, layout="block=16")
    land_all(b, req)
    b.engine_layout("decoder", "block=32")
    refusal, out = b.claim("decoder", "r", 2.0)
    assert isinstance(refusal, Refusal) and refusal.code == "LAYOUT_MISMATCH"
    assert Free("r", 0) in out and b.get("r") is None


def test_a_complete_request_refused_at_claim_any_is_named() -> None:
    """An await over several transfers must name the one it refuses, or the engine cannot
    tell which failed: the vLLM loader took an unnamed refusal (one pending load whose
    transfer had another layout) for a dead receiver and reconnected."""
    b = book()
    land_all(b, started(b, layout="block=16"))
    b.engine_layout("decoder", "block=32")
    refusal, _ = b.claim_any("decoder", ("r",), 2.0)
    assert refusal == Refusal("LAYOUT_MISMATCH", refusal.why, "r")  # type: ignore[union-attr]


def test_an_rdma_hold_keeps_a_failed_buffer_until_the_sender_says_it_stopped() -> None:
    b = book()
    req = started(b)
    b.hold_for_rdma("r")
    out = b.tick(11.0)
    assert not any(isinstance(e, Free) for e in out) and req.state is RxState.FAILED
    out = b.cancel(A, "r", "writes drained", 11.5)
    assert ReleaseRdma("r") in out and Free("r", 0) in out


def test_a_destroyed_queue_pair_lets_held_buffers_go() -> None:
    b = book()
    started(b)
    b.hold_for_rdma("r")
    b.tick(11.0)
    assert b.rdma_gone(["r", "unknown"]) == [Free("r", 0)]


def test_completion_ends_the_rdma_hold() -> None:
    b = book()
    req = started(b)
    b.hold_for_rdma("r")
    assert ReleaseRdma("r") in land_all(b, req) and not req.rdma_hold


def test_refusals_when_draining_full_or_too_big() -> None:
    b = book(max_concurrent=1, fits=lambda n: n < 10 * CHUNK)
    b.draining = True
    assert b.begin(A, begin("r"), 0)[0].code is ErrorCode.TOO_BUSY  # type: ignore[union-attr]
    b.draining = False
    started(b, "r")
    assert b.begin(A, begin("s"), 0)[0].code is ErrorCode.TOO_BUSY  # type: ignore[union-attr]
    b2 = book(fits=lambda n: n < 10 * CHUNK)
    out = b2.begin(A, begin("big", sizes=(20 * CHUNK,)), 0)
    assert out[0].code is ErrorCode.NO_SPACE  # type: ignore[union-attr]


def test_a_chunk_before_the_accept_is_a_protocol_violation_and_after_failure_is_ended() -> None:
    b = book()
    b.begin(A, begin("r"), 0.0)
    assert b.chunk_verdict(A, "r")[0] is ChunkVerdict.EARLY
    b.allocated("r", 0)
    b.tick(11.0)
    assert b.chunk_verdict(A, "r") == (ChunkVerdict.ENDED, None)


def test_the_memory_of_finished_requests_is_bounded() -> None:
    b = book(memory=16)
    for i in range(40):
        req = started(b, f"r{i}")
        land_all(b, req)
        b.claim("e", f"r{i}", 2.0)
        b.release("e", f"r{i}")
    assert len(b.finished) == 16 and "r39" in b.finished and "r0" not in b.finished
    for i in range(40):
        b.cancel(A, f"early{i}", "", 0.0)
    assert len(b.early_cancels) == 16


def test_a_request_that_ends_while_its_buffer_is_being_found_frees_it_at_once() -> None:
    b = book()
    b.begin(A, begin("r"), 0.0)
    b.cancel(A, "r", "gave up", 0.5)
    assert b.allocated("r", 4096) == [Free("r", 4096)]


def test_discarding_an_arriving_request_fails_it_and_tells_its_sender() -> None:
    b = book()
    started(b)
    refusal, out = b.discard("engine", "r", "aborted", 1.0)
    assert refusal is None
    errors = [e for e in sent(out) if isinstance(e, Error)]
    assert errors and errors[0].code == ErrorCode.CANCELLED and Free("r", 0) in out


def test_a_request_discarded_before_it_began_is_refused_when_it_comes() -> None:
    b = book()
    assert b.discard("engine", "r", "aborted", 0.0) == (None, [])
    assert b.known("r")
    out = b.begin(A, begin("r"), 1.0)
    assert isinstance(out[0], Refused) and out[0].code is ErrorCode.CANCELLED
    assert not b.known("never")


def test_claim_any_takes_the_oldest_complete_one_and_names_a_failed_one() -> None:
    b = book()
    for rid, offset in (("x", 0), ("y", 1 << 20)):
        land_all(b, started(b, rid, offset=offset))
    got, _ = b.claim_any("e", ("y", "x"), 2.0)
    assert isinstance(got, RxRequest) and got.rid == "x"  # x completed first
    started(b, "z", offset=2 << 20)
    b.tick(11.0)  # z fails at its deadline
    got, _ = b.claim_any("e", ("nope", "z"), 12.0)
    assert got == Refusal("DEADLINE", got.why, "z")  # type: ignore[union-attr]
    assert b.claim_any("e", ("nope",), 12.0)[0] is WAIT


def test_one_session_cannot_take_every_transfer_slot() -> None:
    """256 BEGINs from one peer used to make every other sender's TOO_BUSY for a whole
    deadline, again and again: a session alone keeps a quarter free for newcomers; with
    others active it holds at most an equal share; and when the table is full, a session
    under its share gets a slot from the session most over its (the newest request that has
    not received a byte: its sender hears TOO_BUSY, preempted)."""
    b = book(max_concurrent=8)
    b.connection_up(A)
    for r in range(6):
        assert b.begin(A, begin(f"a{r}"), 0.0) == [Allocate(f"a{r}", 3 * CHUNK)]
    refused = b.begin(A, begin("a-more"), 0.0)
    assert isinstance(refused[0], Refused) and refused[0].code is ErrorCode.TOO_BUSY
    assert "its share of 8 with 1 session(s)" in refused[0].why
    b.connection_up(B)  # a second sender: its share is 4
    assert b.begin(B, begin("b0"), 0.0) == [Allocate("b0", 3 * CHUNK)]
    assert b.begin(B, begin("b1"), 0.0) == [Allocate("b1", 3 * CHUNK)]
    for rid, victim in (("b2", "a5"), ("b3", "a4")):  # full: A gives way, newest first
        got = b.begin(B, begin(rid), 1.0)
        failed = got[0]
        assert isinstance(failed, Failed), got
        assert failed == Failed(victim, ErrorCode.TOO_BUSY, failed.why), got
        assert "preempted: session session-a holds 6" in failed.why or "holds 5" in failed.why
        assert sent(got)[0] == Error(int(ErrorCode.TOO_BUSY), failed.why, victim)
        assert got[-1] == Allocate(rid, 3 * CHUNK)
    assert b.held == {A: 4, B: 4} and len(b.requests) == 8
    for s_, rid in ((A, "a-again"), (B, "b4")):  # both at their share now
        over = b.begin(s_, begin(rid), 1.0)
        assert isinstance(over[0], Refused) and "its share of 8 with 2 session(s)" in over[0].why
    C = "session-c"
    b.connection_up(C)  # share 2: one of the others gives way again
    got = b.begin(C, begin("c0"), 2.0)
    assert isinstance(got[0], Failed) and "preempted" in got[0].why, got
    assert got[-1] == Allocate("c0", 3 * CHUNK) and len(b.requests) == 8


def test_a_session_is_bound_to_the_identity_of_its_first_connection() -> None:
    b = book()
    assert b.connection_up(A, "tls:tx.example") == ""
    assert b.connection_up(A, "tls:tx.example") == ""  # its own second connection
    why = b.connection_up(A, "tls:intruder.example")
    assert "belongs to another peer (tls:tx.example)" in why
    assert b.connections[A] == 2  # the refused one was not counted
    b.connection_down(A, 0.0)
    b.connection_down(A, 0.0)
    assert b.connection_up(A, "tls:intruder.example") != ""  # still bound while remembered
    b.tick(100.0)  # gone, with nothing left of it: forgotten
    assert b.connection_up(A, "tls:intruder.example") == ""


def test_a_shared_request_is_read_by_each_of_its_engines_readers_and_freed_after_the_last() -> None:
    """An engine whose ranks all hold the same bytes (MLA's latent) reads one transfer with
    each rank's connection: the first release keeps the buffer, the last frees it."""
    b = book()
    req = shared_ready(b, "rank0", "rank1")
    assert b.claim("rank0", "r", 2.0)[0] is req
    assert b.claim_any("rank1", ("r",), 2.0)[0] is req  # the poll a loader makes
    assert b.release("rank0", "r") == (None, [])  # rank 1 still reads it
    assert state_of(req) is RxState.CLAIMED and req.offset == 0
    refusal, _ = b.release("rank0", "r")
    assert isinstance(refusal, Refusal) and refusal.code == "NOT_OWNER"  # released once only
    assert b.release("rank1", "r") == (None, [Free("r", 0)])
    assert state_of(req) is RxState.DONE and b.get("r") is None


def test_a_shared_request_takes_no_more_readers_than_its_engine_has_and_none_of_another() -> None:
    b = book()
    req = shared_ready(b, "rank0", "rank1", "rank2")
    b.engine_readers_of("alone", 1)
    assert b.claim("rank0", "r", 2.0)[0] is req
    got = b.claim("alone", "r", 2.0)[0]  # a one-rank engine: not one of its readers
    assert isinstance(got, Refusal) and got.code == "NOT_OWNER", got
    assert b.claim("rank1", "r", 2.0)[0] is req
    got = b.claim("rank2", "r", 2.0)[0]  # both places taken
    assert isinstance(got, Refusal) and got.code == "NOT_OWNER", got
    assert b.release("rank1", "r") == (None, [])
    got = b.claim("rank2", "r", 2.0)[0]  # rank 1 read it: its place is not open again
    assert isinstance(got, Refusal) and got.code == "NOT_OWNER", got


def test_a_shared_reader_reads_once_so_a_rank_claiming_twice_can_not_take_its_peers_read() -> None:
    """A buggy rank that claims and releases the request twice would otherwise count as both
    readers, and the buffer would be freed before the other rank read it."""
    b = book()
    req = shared_ready(b, "rank0", "rank1")
    assert b.claim("rank0", "r", 2.0)[0] is req
    assert b.release("rank0", "r") == (None, [])
    got = b.claim("rank0", "r", 2.0)[0]
    assert isinstance(got, Refusal) and got.code == "NOT_OWNER", got
    assert b.claim("rank1", "r", 2.0)[0] is req  # its read is still there
    assert b.release("rank1", "r") == (None, [Free("r", 0)])


def test_a_shared_reader_that_leaves_opens_its_place_and_the_request_is_not_lost() -> None:
    b = book()
    req = shared_ready(b, "rank0", "rank1", "rank1-again")
    assert b.claim("rank0", "r", 2.0)[0] is req
    assert b.claim("rank1", "r", 2.0)[0] is req
    assert b.engine_gone("rank1") == []  # rank 0 still holds it: no requeue
    assert state_of(req) is RxState.CLAIMED
    assert b.claim("rank1-again", "r", 3.0)[0] is req  # the restarted rank reads it
    assert b.engine_gone("rank0") == []
    assert b.release("rank1-again", "r") == (None, [])
    assert b.tick(30.0) == []  # within unclaimed_ttl_s rank 0's successor may come
    assert state_of(req) is RxState.CLAIMED and req.offset == 0


def test_a_shared_request_all_of_whose_readers_left_unread_goes_back_to_the_queue() -> None:
    b = book()
    req = shared_ready(b, "rank0", "rank1")
    b.claim("rank0", "r", 2.0)
    b.claim("rank1", "r", 2.0)
    assert b.engine_gone("rank0") == []
    assert b.engine_gone("rank1") == [Requeued("r")]
    assert state_of(req) is RxState.COMPLETE and list(b.ready) == ["r"]
    assert b.claim("plain", None, 3.0)[0] is req  # any engine may take it now
    assert b.release("plain", "r") == (None, [Free("r", 0)])


def test_a_shared_request_some_reader_never_came_for_is_freed_after_the_unclaimed_ttl() -> None:
    b = book(unclaimed_ttl_s=10.0)
    req = started(b)
    land_all(b, req, now=1.0)
    b.engine_readers_of("rank0", 2)
    b.claim("rank0", "r", 2.0)
    assert b.release("rank0", "r") == (None, [])
    assert b.tick(10.5) == []
    assert b.tick(11.5) == [Free("r", 0)]
    assert b.get("r") is None
    b.engine_readers_of("rank1", 2)
    got = b.claim("rank1", "r", 12.0)[0]  # too late: it was delivered (to rank 0)
    assert isinstance(got, Refusal) and got.code == "RELEASED", got
