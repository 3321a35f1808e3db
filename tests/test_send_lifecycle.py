"""The sender's request lifecycle without sockets: ownership by engine connection, hand-over
in parts, when a request is complete, and what a late call is told."""

from __future__ import annotations

import pytest

from xdc.protocol import Begin, ProtocolError
from xdc.protocol.errors import ResultCode, TransferError
from xdc.protocol.send_lifecycle import SendBook, TxState

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


def begin(rid: str = "r", sizes: tuple[int, ...] = (2 * CHUNK, CHUNK)) -> Begin:
    return Begin(rid, sizes, CHUNK, (), 0, 10_000)


def started(b: SendBook, rid: str = "r", owner: str = "engine", **kw: object):  # type: ignore[no-untyped-def]
    req = b.begin(owner, begin(rid, **kw), "peer", 0.0, 10.0)  # type: ignore[arg-type]
    for layer in range(len(req.handed)):
        req.layer_slot[layer] = layer * 1 << 20  # as the daemon's alloc would
    return req


def test_only_the_engine_connection_that_began_a_request_may_fill_or_hand_it_over():
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
    assert b.hand_over("one", "r", 0, None, 1.0)[0].handed == [True, False]


def test_a_request_completes_only_when_every_layer_is_handed_over_and_acked():
    b = book()
    req = started(b)
    assert b.accepted("r") is req and req.state is TxState.SENDING
    _, h = b.hand_over("engine", "r", 0, None, 1.0)
    assert h.give and not h.last and not h.complete
    for off in (0, CHUNK):
        assert b.acked("r", 0, off) == (req, False)
    assert b.acked("r", 0, 0) == (None, False)  # a duplicate ACK is no news
    _, h = b.hand_over("engine", "r", 1, None, 2.0)
    assert h.last and not h.complete  # layer 1 not acked yet
    assert b.acked("r", 1, 0) == (req, True)
    assert b.complete(req, 3.0) and req.state is TxState.COMPLETE
    b.finish(req)
    assert b.ended["r"] == (ResultCode.OK, "")
    with pytest.raises(TransferError) as e:
        b.owned("engine", "r")
    assert "delivered" in e.value.message


def test_hand_over_in_parts_grows_and_never_shrinks():
    b = book()
    started(b, sizes=(4 * CHUNK,))
    req, h = b.hand_over("engine", "r", 0, CHUNK + 1, 1.0)
    assert req.ready_upto == [CHUNK + 1] and not h.last
    with pytest.raises(TransferError) as e:
        b.hand_over("engine", "r", 0, CHUNK, 1.1)
    assert e.value.code is ResultCode.BAD_REQUEST
    with pytest.raises(TransferError):
        b.hand_over("engine", "r", 0, 5 * CHUNK, 1.2)
    req, h = b.hand_over("engine", "r", 0, 4 * CHUNK, 1.3)
    assert req.handed == [True] and h.last
    with pytest.raises(TransferError):  # once whole, a layer is never handed over again
        b.hand_over("engine", "r", 0, None, 1.4)


def test_a_layer_without_a_buffer_cannot_be_handed_over_but_an_empty_one_can():
    b = book()
    req = b.begin("engine", begin(sizes=(CHUNK, 0)), "peer", 0.0, 10.0)
    with pytest.raises(TransferError) as e:
        b.hand_over("engine", "r", 0, None, 1.0)
    assert "no buffer" in e.value.message
    assert b.hand_over("engine", "r", 1, None, 1.0)[0].handed == [False, True]
    assert req.layer_slot == [None, None]


def test_an_engine_that_leaves_dooms_only_what_it_had_not_handed_over():
    b = book()
    partial = started(b, "partial")
    whole = started(b, "whole", sizes=(CHUNK,))
    b.hand_over("engine", "whole", 0, None, 1.0)
    assert b.engine_gone("engine") == [partial]
    assert whole.owner is None and whole.live  # it goes on and is delivered without its engine


def test_a_receiver_restart_fails_accepted_requests_and_leaves_pending_ones_to_begin_again():
    b = book()
    accepted, pending = started(b, "a"), started(b, "p")
    b.accepted("a")
    assert b.peer_restarted("peer") == [accepted]
    assert pending.state is TxState.PENDING
    assert b.peer_restarted("other-peer") == []


def test_failure_is_final_and_remembered_with_its_code():
    b = book()
    req = started(b)
    assert b.fail("r", ResultCode.DEADLINE, "too slow") is req
    assert b.fail("r", ResultCode.CANCELLED, "again") is None  # the first ending stands
    assert b.accepted("r") is None and b.acked("r", 0, 0) == (None, False)
    with pytest.raises(TransferError) as e:
        b.hand_over("engine", "r", 0, None, 1.0)
    assert e.value.code is ResultCode.DEADLINE
    b.finish(req)
    with pytest.raises(TransferError) as e:
        b.owned("engine", "r")
    assert (e.value.code, e.value.message) == (ResultCode.DEADLINE, "too slow")


def test_an_ack_off_the_grid_is_a_protocol_error():
    b = book()
    started(b)
    b.accepted("r")
    with pytest.raises(ProtocolError):
        b.acked("r", 0, 1)
    with pytest.raises(ProtocolError):
        b.acked("r", 7, 0)


@pytest.mark.parametrize(
    ("sizes", "code"),
    [
        ((1,) * 9, ResultCode.LIMIT),  # more layers than allowed
        ((0, 0), ResultCode.LIMIT),  # no bytes at all
        ((2 << 20,), ResultCode.NO_SPACE),  # a layer that can never fit the pool
    ],
)
def test_begin_refuses_what_could_never_be_sent(sizes: tuple[int, ...], code: ResultCode):
    with pytest.raises(TransferError) as e:
        book().begin("engine", begin(sizes=sizes), "peer", 0.0, 1.0)
    assert e.value.code is code


def test_begin_refuses_duplicates_when_draining_and_when_full():
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


def test_the_memory_of_ended_requests_is_bounded():
    b = book(memory=16, max_concurrent=64)
    for i in range(40):
        req = started(b, f"r{i}")
        b.fail(req.rid, ResultCode.CANCELLED, "")
        b.finish(req)
    assert len(b.ended) == 16 and "r39" in b.ended and "r0" not in b.ended
