"""The sender's request lifecycle without sockets: ownership by engine connection, hand-over
in parts, when a request is complete, and what a late call is told. The book answers with
effects (what the daemon must do, in order), as the receive side's does."""

from __future__ import annotations

import pytest

from xdc.errors import ResultCode, TransferError
from xdc.protocol import Begin
from xdc.protocol.books.send import (
    Accepted,
    Completed,
    Failed,
    Give,
    LayerAcked,
    SendBook,
    TellEnd,
    TxRequest,
    TxState,
)

CHUNK = 4096


def book(**kw: object) -> SendBook:
    args: dict[str, object] = {
        "max_layers": 8,
        "max_request_bytes": 1 << 30,
        "max_block_hashes": 16,
        "max_concurrent": 4,
        "fits": lambda n: n <= 1 << 20,
    }
    args.update(kw)
    return SendBook(**args)  # type: ignore[arg-type]


def state_of(req: TxRequest) -> TxState:
    """The state now, read through a call so that mypy keeps no narrowing from a check above."""
    return req.state


def begin(rid: str = "r", sizes: tuple[int, ...] = (2 * CHUNK, CHUNK)) -> Begin:
    return Begin(rid, sizes, CHUNK, (), 0, 10_000)


def started(
    b: SendBook,
    rid: str = "r",
    owner: str = "engine",
    sizes: tuple[int, ...] = (2 * CHUNK, CHUNK),
) -> TxRequest:
    req = b.begin(owner, begin(rid, sizes), "peer", 0.0, 10.0)
    for layer in range(len(req.handed)):
        req.layer_slot[layer] = layer * 1 << 20  # as the daemon's alloc would
    return req


def test_only_the_engine_connection_that_began_a_request_may_fill_or_hand_it_over() -> None:
    b = book()
    started(b, owner="one")
    for call in (
        lambda: b.may_allocate("two", "r", 0),
        lambda: b.hand_over("two", "r", 0, None, 1.0),
        lambda: b.owned("two", "r"),
    ):
        with pytest.raises(TransferError) as e:
            call()
        assert e.value.code is ResultCode.NOT_OWNER
    assert b.hand_over("one", "r", 0, None, 1.0) == []  # not accepted: nothing to send yet
    assert b.owned("one", "r").handed == [True, False]


def test_a_request_completes_only_when_every_layer_is_handed_over_and_acked() -> None:
    b = book()
    req = started(b)
    assert b.accepted("r") == [Accepted(req)] and req.state is TxState.SENDING
    assert b.accepted("r") == []  # a second ACCEPT is no news
    assert b.hand_over("engine", "r", 0, None, 1.0) == [Give(req, 0)]
    assert b.acked("r", 0, 0, 1.1) == []
    assert b.acked("r", 0, CHUNK, 1.2) == [LayerAcked(req, 0)]  # the receiver holds layer 0
    assert b.acked("r", 0, 0, 1.3) == []  # a duplicate ACK is no news
    # the last layer: END goes out; not complete, layer 1 is not acked yet
    assert b.hand_over("engine", "r", 1, None, 2.0) == [Give(req, 1), TellEnd(req)]
    assert b.acked("r", 1, 0, 3.0) == [LayerAcked(req, 1), Completed(req)]
    assert state_of(req) is TxState.COMPLETE and req.t_done == 3.0
    assert b.complete(req, 4.0) == []  # it ended once
    b.finish(req)
    assert b.ended["r"] == (ResultCode.OK, "")
    with pytest.raises(TransferError) as e:
        b.owned("engine", "r")
    assert "delivered" in e.value.message


def test_hand_over_in_parts_grows_and_never_shrinks() -> None:
    b = book()
    started(b, sizes=(4 * CHUNK,))
    req = b.owned("engine", "r")
    assert b.hand_over("engine", "r", 0, CHUNK + 1, 1.0) == []
    assert req.ready_upto == [CHUNK + 1]
    with pytest.raises(TransferError) as e:
        b.hand_over("engine", "r", 0, CHUNK, 1.1)
    assert e.value.code is ResultCode.BAD_REQUEST
    with pytest.raises(TransferError):
        b.hand_over("engine", "r", 0, 5 * CHUNK, 1.2)
    assert b.hand_over("engine", "r", 0, 4 * CHUNK, 1.3) == [TellEnd(req)]
    assert req.handed == [True] and req.t_last_handed == 1.3
    with pytest.raises(TransferError):  # once whole, a layer is never handed over again
        b.hand_over("engine", "r", 0, None, 1.4)


def test_a_layer_without_a_buffer_cannot_be_handed_over_but_an_empty_one_can() -> None:
    b = book()
    req = b.begin("engine", begin(sizes=(CHUNK, 0)), "peer", 0.0, 10.0)
    with pytest.raises(TransferError) as e:
        b.hand_over("engine", "r", 0, None, 1.0)
    assert "no buffer" in e.value.message
    assert b.hand_over("engine", "r", 1, None, 1.0) == []
    assert req.handed == [False, True] and req.layer_slot == [None, None]


def test_an_engine_that_leaves_dooms_only_what_it_had_not_handed_over() -> None:
    b = book()
    partial = started(b, "partial")
    whole = started(b, "whole", sizes=(CHUNK,))
    b.hand_over("engine", "whole", 0, None, 1.0)
    assert b.engine_gone("engine") == [Failed(partial, notify=True)]
    assert (partial.code, partial.why) == (
        ResultCode.ENGINE_GONE,
        "prefill engine disconnected mid-request",
    )
    assert whole.owner is None and whole.live  # it goes on and is delivered without its engine


def test_a_receiver_restart_fails_accepted_requests_and_leaves_pending_ones_to_begin_again() -> (
    None
):
    b = book()
    accepted, pending = started(b, "a"), started(b, "p")
    b.accepted("a")
    assert b.peer_restarted("peer") == [Failed(accepted, notify=False)]  # it never heard
    assert accepted.code is ResultCode.PEER_RESTARTED
    assert pending.state is TxState.PENDING
    assert b.peer_restarted("other-peer") == []


def test_failure_is_final_and_remembered_with_its_code() -> None:
    b = book()
    req = started(b)
    assert b.fail("r", ResultCode.DEADLINE, "too slow") == [Failed(req, notify=True)]
    assert b.fail("r", ResultCode.CANCELLED, "again") == []  # the first ending stands
    assert b.accepted("r") == [] and b.acked("r", 0, 0, 1.0) == []
    with pytest.raises(TransferError) as e:
        b.hand_over("engine", "r", 0, None, 1.0)
    assert e.value.code is ResultCode.DEADLINE
    b.finish(req)
    with pytest.raises(TransferError) as e:
        b.owned("engine", "r")
    assert (e.value.code, e.value.message) == (ResultCode.DEADLINE, "too slow")


@pytest.mark.parametrize(("layer", "offset"), [(0, 1), (7, 0)])
def test_an_ack_off_the_grid_fails_the_request_as_a_protocol_error(layer: int, offset: int) -> None:
    b = book()
    req = started(b)
    b.accepted("r")
    assert b.acked("r", layer, offset, 1.0) == [Failed(req, notify=True)]
    assert req.code is ResultCode.PROTOCOL and req.why.startswith("bad ack:"), req.why


@pytest.mark.parametrize(
    ("sizes", "code"),
    [
        ((1,) * 9, ResultCode.LIMIT),  # more layers than allowed
        ((0, 0), ResultCode.LIMIT),  # no bytes at all
        ((2 << 20,), ResultCode.NO_SPACE),  # a layer that can never fit the pool
    ],
)
def test_begin_refuses_what_could_never_be_sent(sizes: tuple[int, ...], code: ResultCode) -> None:
    with pytest.raises(TransferError) as e:
        book().begin("engine", begin(sizes=sizes), "peer", 0.0, 1.0)
    assert e.value.code is code


def test_begin_refuses_duplicates_when_draining_and_when_full() -> None:
    b = book(max_concurrent=1)
    started(b)
    with pytest.raises(TransferError) as e:
        b.begin("engine", begin("r"), "peer", 0.0, 1.0)
    assert e.value.code is ResultCode.DUPLICATE_REQUEST
    with pytest.raises(TransferError) as e:
        b.begin("engine", begin("s"), "peer", 0.0, 1.0)
    assert e.value.code is ResultCode.TOO_BUSY
    b2 = book()
    b2.draining = True
    with pytest.raises(TransferError) as e:
        b2.begin("engine", begin("t"), "peer", 0.0, 1.0)
    assert e.value.code is ResultCode.SHUTTING_DOWN


def test_the_memory_of_ended_requests_is_bounded() -> None:
    b = book(memory=16, max_concurrent=64)
    for i in range(40):
        req = started(b, f"r{i}")
        b.fail(req.rid, ResultCode.CANCELLED, "")
        b.finish(req)
    assert len(b.ended) == 16 and "r39" in b.ended and "r0" not in b.ended


def test_each_hand_over_of_new_bytes_moves_the_deadline_a_window_on() -> None:
    """The prefill may run longer than the window: what fails a request is a stall."""
    b = book(max_transfer_s=100.0)
    req = started(b)  # window 10 s from 0
    assert req.deadline == 10.0
    b.hand_over("engine", "r", 0, CHUNK, 8.0)
    assert req.deadline == 18.0
    b.hand_over("engine", "r", 0, CHUNK, 17.0)  # the same bytes again: no progress
    assert req.deadline == 18.0
    b.hand_over("engine", "r", 0, None, 17.5)
    b.hand_over("engine", "r", 1, None, 26.0)  # 26 s after BEGIN, never 10 s without news
    assert req.deadline == 36.0
    assert req.clock.why(req.created) == "no progress for 10.0s"


def test_an_empty_layer_handed_over_is_progress_too() -> None:
    b = book()
    req = started(b, sizes=(CHUNK, 0))
    b.hand_over("engine", "r", 1, None, 5.0)
    assert req.deadline == 15.0


def test_no_hand_over_moves_the_deadline_past_max_transfer_s() -> None:
    """An engine handing over a byte at a time cannot keep a request (and its pool space)
    forever."""
    b = book(max_transfer_s=25.0)
    req = started(b, sizes=(8 * CHUNK,))
    for i in range(1, 8):
        b.hand_over("engine", "r", 0, i * 100, i * 4.0)
    assert req.deadline == 25.0
    assert req.clock.why(req.created) == "not done within its limit of 25.0s"


def test_a_window_longer_than_max_transfer_s_is_the_limit() -> None:
    b = book(max_transfer_s=5.0)
    req = started(b)  # asks for 10 s
    assert req.deadline == 10.0 and req.clock.cap == 10.0
