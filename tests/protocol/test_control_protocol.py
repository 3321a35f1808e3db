"""The engine control protocol without sockets: every request round-trips, and no input a
buggy or hostile engine can send decodes to anything but a checked request or a
ControlError that says what was wrong."""

from __future__ import annotations

import contextlib
import math
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xdc.errors import ControlError, ResultCode
from xdc.protocol.engine_control import (
    LEN,
    MAX_MESSAGE,
    RECEIVER_OPS,
    SENDER_OPS,
    Admit,
    Alloc,
    Await,
    AwaitLayer,
    BeginRequest,
    CancelRequest,
    Discard,
    EngineHello,
    ErrorEvent,
    Framer,
    Look,
    Outcome,
    Ready,
    Release,
    Reply,
    Request,
    Status,
    decode_daemon_message,
    decode_request,
    encode_request,
    failure,
    outcome_event,
    reply,
)

ALL_OPS = SENDER_OPS | RECEIVER_OPS

REQUESTS: list[Request] = [
    EngineHello(),
    EngineHello("model=m dtype=bfloat16 block=32"),
    EngineHello("model=m", readers=8),
    Status(),
    Admit(),
    Admit("10.0.0.2:7400"),
    BeginRequest("r-1", (0, 4096, 1 << 40)),
    BeginRequest("r" * 128, (1,), (1, (1 << 64) - 1), 2, 2.5, "10.0.0.1:7400", "layout x"),
    Alloc("r-1", (0,)),
    Alloc("r-1", tuple(range(64))),
    Ready("r-1", 3),
    Ready("r-1", 3, 0),
    Ready("r-1", 3, 1 << 40),
    CancelRequest("r-1"),
    CancelRequest("r-1", "x" * 1024),
    Await(None, 0.0),
    Await("r-1", 86400.0),
    AwaitLayer("r-1", 0, 2.5),
    Await(None, 1.0, ("r-1", "r-2")),
    Look(("r-1",)),
    Look(tuple(f"r-{i}" for i in range(1024))),
    Release("r-1"),
    Discard("r-1"),
]


def _body(msg: object) -> bytes:
    return bytes(msgpack.packb(msg, use_bin_type=True))


def _decode(msg: dict[Any, Any]) -> Request:
    return decode_request(_body(msg), ALL_OPS).request


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("mid", [None, 1, (1 << 63) - 1])
def test_every_request_round_trips(request_: Request, mid: int | None) -> None:
    frame = encode_request(request_, mid)
    (n,) = LEN.unpack_from(frame)
    env = decode_request(frame[LEN.size :], ALL_OPS)
    assert n == len(frame) - LEN.size
    assert env.id == mid and env.request == request_


@pytest.mark.parametrize(
    ("msg", "says"),
    [
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "colour": 3}, "colour"),
        ({"op": "begin", "id": 1, "layer_sizes": [1]}, "rid"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": []}, "layer_sizes"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [-1]}, "layer_sizes"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [True]}, "layer_sizes"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1.0]}, "layer_sizes"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": "1"}, "layer_sizes"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1 << 63]}, "layer_sizes"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "deadline_s": math.nan}, "dead"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "deadline_s": -1}, "dead"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "deadline_s": 0}, "dead"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "deadline_s": 1e300}, "dead"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "cached_blocks": 1}, "cached"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "peer": "nowhere"}, "peer"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "peer": "h:99999"}, "peer"),
        ({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "layout": "a\nb"}, "layout"),
        ({"op": "begin", "id": 1, "rid": "a\nb", "layer_sizes": [1]}, "rid"),
        ({"op": "begin", "id": 1, "rid": "", "layer_sizes": [1]}, "rid"),
        ({"op": "begin", "id": 1, "rid": "x" * 129, "layer_sizes": [1]}, "rid"),
        ({"op": "begin", "id": 1, "rid": 7, "layer_sizes": [1]}, "rid"),
        ({"op": "admit", "id": 1, "peer": "nowhere"}, "peer"),
        ({"op": "admit", "id": 1, "peer": "h:0"}, "peer"),
        ({"op": "admit", "id": 1, "peer": 7}, "peer"),
        ({"op": "admit", "id": 1, "peer": "h:1", "rid": "r"}, "unknown"),
        ({"op": "ready", "rid": "r", "layer": -1}, "layer"),
        ({"op": "ready", "rid": "r", "layer": 0, "upto": -5}, "upto"),
        ({"op": "ready", "rid": "r", "layer": "0"}, "layer"),
        ({"op": "alloc", "id": 1, "rid": "r", "layers": []}, "layers"),
        ({"op": "alloc", "id": 1, "rid": "r", "layers": list(range(65))}, "layers"),
        ({"op": "await", "id": 1, "timeout_s": -1}, "timeout_s"),
        ({"op": "await", "id": 1, "timeout_s": math.nan}, "timeout_s"),
        ({"op": "await", "id": 1, "timeout_s": math.inf}, "timeout_s"),
        ({"op": "await", "id": 1, "timeout_s": True}, "timeout_s"),
        ({"op": "await", "id": 1}, "timeout_s"),
        ({"op": "await_layer", "id": 1, "rid": "r", "layer": 0, "timeout_s": "1"}, "timeout_s"),
        ({"op": "cancel", "id": 1, "rid": "r", "reason": "x" * 1025}, "reason"),
        ({"op": "await", "id": 1, "timeout_s": 1, "rid": "r", "rids": ["s"]}, "not both"),
        ({"op": "await", "id": 1, "timeout_s": 1, "rids": []}, "rids"),
        ({"op": "await", "id": 1, "timeout_s": 1, "rids": ["ok", "a\nb"]}, "rid"),
        ({"op": "await", "id": 1, "timeout_s": 1, "rids": ["x"] * 1025}, "rids"),
        ({"op": "discard", "id": 1}, "rid"),
        ({"op": "look", "id": 1}, "rids"),
        ({"op": "look", "id": 1, "rids": []}, "rids"),
        ({"op": "look", "id": 1, "rids": "r"}, "rids"),
        ({"op": "look", "id": 1, "rids": ["ok", 7]}, "rid"),
        ({"op": "look", "id": 1, "rids": ["x"] * 1025}, "rids"),
        ({"op": "look", "id": 1, "rids": ["r"], "timeout_s": 1}, "unknown"),
        ({"op": "hello", "id": 1, "pool_fd": 1}, "pool_fd"),
        ({"op": "hello", "id": 1, "readers": 0}, "readers"),
        ({"op": "hello", "id": 1, "readers": 1025}, "readers"),
        ({"op": "hello", "id": 1, "readers": "2"}, "readers"),
        ({"op": "hello", "id": 1, "readers": True}, "readers"),
        ({"op": "begin", "id": 0, "rid": "r", "layer_sizes": [1]}, "id"),
        ({"op": "begin", "id": "1", "rid": "r", "layer_sizes": [1]}, "id"),
        ({"op": "begin", "id": 1 << 63, "rid": "r", "layer_sizes": [1]}, "id"),
    ],
)
def test_a_bad_field_is_refused_and_named(msg: dict[str, Any], says: str) -> None:
    with pytest.raises(ControlError) as e:
        _decode(msg)
    assert e.value.code is ResultCode.BAD_REQUEST
    assert says in e.value.message
    if type(msg.get("id")) is int and 1 <= msg["id"] < 1 << 63:
        assert e.value.id == msg["id"]  # the engine learns which call was refused


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        _body({"op": "status", "id": 1}) + b"\x00",  # trailing bytes
        _body([1, 2, 3]),  # not a map
        _body({1: "status"}),  # a non-string key
        _body({"op": None, "id": 1}),
        _body({"op": "status", "id": 1, "x": float("nan")}),
        b"\x81\xa2op\xa6status\xa2id",  # truncated
    ],
)
def test_bytes_that_are_not_one_request_are_bad_requests(body: bytes) -> None:
    with pytest.raises(ControlError) as e:
        decode_request(body, ALL_OPS)
    assert e.value.code in (ResultCode.BAD_REQUEST, ResultCode.BAD_OP)


def test_an_op_the_daemon_does_not_serve_is_bad_op_with_its_id() -> None:
    with pytest.raises(ControlError) as e:
        decode_request(_body({"op": "release", "id": 9, "rid": "r"}), SENDER_OPS)
    assert (e.value.code, e.value.id) == (ResultCode.BAD_OP, 9)
    with pytest.raises(ControlError) as e:
        decode_request(_body({"op": "launch_missiles", "id": 3}), RECEIVER_OPS)
    assert (e.value.code, e.value.id) == (ResultCode.BAD_OP, 3)


def test_the_framer_splits_a_stream_anywhere_and_refuses_a_huge_length() -> None:
    frames = b"".join(encode_request(r, i + 1) for i, r in enumerate(REQUESTS))
    for step in (1, 3, 7, 64, len(frames)):
        framer = Framer()
        got = []
        for i in range(0, len(frames), step):
            framer.feed(frames[i : i + step])
            while (body := framer.next_body()) is not None:
                got.append(decode_request(body, ALL_OPS).request)
        assert got == REQUESTS and framer.pending == 0
    framer = Framer()
    framer.feed(struct.pack("!I", MAX_MESSAGE + 1))
    with pytest.raises(ControlError) as e:
        framer.next_body()
    assert e.value.code is ResultCode.LIMIT


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_but_control_error(body: bytes) -> None:
    with contextlib.suppress(ControlError):
        decode_request(body, ALL_OPS)


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70).filter(lambda i: -(1 << 63) <= i < 1 << 64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=10)
)
_VALUES = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=4), max_leaves=12)
_KEYS = st.sampled_from(
    [
        "op",
        "id",
        "rid",
        "layer_sizes",
        "block_hashes",
        "cached_blocks",
        "deadline_s",
        "peer",
        "layout",
        "layer",
        "layers",
        "upto",
        "reason",
        "timeout_s",
        "readers",
        "x",
    ]
)


@settings(max_examples=1500, deadline=None)
@given(
    st.sampled_from(sorted(ALL_OPS)),
    st.dictionaries(_KEYS, _VALUES, max_size=7),
    st.integers(1, 100),
)
def test_arbitrary_fields_decode_to_checked_requests_or_control_errors(
    op: str, fields: dict[str, Any], mid: int
) -> None:
    """Whatever the values: a request whose every field is in range, or a ControlError."""
    msg = {"id": mid, **fields, "op": op}
    try:
        env = decode_request(_body(msg), ALL_OPS)
    except ControlError as e:
        assert e.code in (ResultCode.BAD_REQUEST, ResultCode.BAD_OP)
        return
    r = env.request
    for name in ("timeout_s", "deadline_s"):
        v = getattr(r, name, None)
        assert v is None or (isinstance(v, float) and 0 <= v <= 86400 and not math.isnan(v))
    for name in ("rid", "layout", "peer"):
        v = getattr(r, name, None)
        assert v is None or (isinstance(v, str) and v.isprintable())
    for name in ("layer", "upto", "cached_blocks"):
        v = getattr(r, name, None)
        assert v is None or (type(v) is int and v >= 0)
    readers = getattr(r, "readers", None)
    assert readers is None or (type(readers) is int and 1 <= readers <= 1024)
    if isinstance(r, BeginRequest):
        assert r.layer_sizes and all(type(x) is int and x >= 0 for x in r.layer_sizes)
        assert r.cached_blocks <= len(r.block_hashes)


def test_replies_and_pushed_events_decode_on_the_engine_side() -> None:
    frames = [
        reply(4, shm="xdc-rx-1", size=4096),
        failure(5, ResultCode.NO_SPACE, "too big"),
        failure(None, ResultCode.BAD_REQUEST, "bad upto", rid="r-1"),
        outcome_event(Outcome("r-1", True, "", "", 10, 0.5, 0.01, 0)),
    ]
    msgs = [decode_daemon_message(f[LEN.size :]) for f in frames]
    assert msgs[0] == Reply(4, True, ResultCode.OK, "", {"shm": "xdc-rx-1", "size": 4096})
    assert msgs[1] == Reply(5, False, ResultCode.NO_SPACE, "too big", {})
    assert msgs[2] == ErrorEvent("r-1", ResultCode.BAD_REQUEST, "bad upto")
    assert msgs[3] == Outcome("r-1", True, "", "", 10, 0.5, 0.01, 0)


@pytest.mark.parametrize(
    "msg",
    [
        {"ok": True},  # no id
        {"id": 1, "ok": "yes"},
        {"event": "outcome", "rid": "r"},
        {"event": "outcome", "rid": "r", "ok": True, "bytes": -1},
        {"event": "surprise"},
    ],
)
def test_a_broken_daemon_message_is_a_control_error_in_the_engine(msg: dict[str, Any]) -> None:
    with pytest.raises(ControlError) as e:
        decode_daemon_message(_body(msg))
    assert e.value.code in (ResultCode.PROTOCOL, ResultCode.BAD_REQUEST)
