"""The daemon <-> data worker protocol (xdc/protocol/worker_jobs.py), without processes: every
message survives the round trip, frames split anywhere reassemble, and anything neither side
would write is refused with WorkerProtocolError (and the reader stays refused)."""

from __future__ import annotations

import os

import msgpack
import pytest

from xdc.protocol.length_prefixed import PREFIX, prefixed
from xdc.protocol.worker_jobs import (
    MAX_AHEAD,
    MAX_CHUNKS,
    MAX_FRAME,
    MAX_LEASES,
    STOP_SLOTS,
    AddLease,
    Adopt,
    Done,
    Drop,
    Failure,
    JobReader,
    Landed,
    Lease,
    Message,
    Op,
    RecordState,
    Recv,
    Run,
    Send,
    SendChunk,
    WorkerProtocolError,
    decode,
    encode,
)

LEASE = ["r", 0, [1], 4, 0]
STATE = RecordState("aegis-128l", os.urandom(32), 3, 17, 4 << 20, 1 << 34, os.urandom(100))
MESSAGES: list[Message] = [
    Adopt(7, True, 30.0),
    Adopt(8, False, 0.0),
    Recv(1, 7, 4096, 2 << 20, 1200, ("req-1", 5, 2 << 20), 0xDEADBEEF, STATE),
    Recv(2, 8, 0, 10, 0, ("r", 0, 0), None, None),
    Recv(5, 8, 0, 10, 0, ("r", 0, 0), None, None, STOP_SLOTS - 1),
    Send(
        3,
        7,
        (
            SendChunk("req-1", 0, 0, 1 << 20, 8192, None),
            SendChunk("x", 1, 9, 5, 0, 12, True),
            SendChunk("y", 2, 0, 5, 0, 12, False),
        ),
        STATE,
    ),
    Drop(7),
    Run(9, 7, (Lease("req-1", 4096, (1 << 20, 0, 5), 1 << 20, 3),), b"XD\x04", 12),
    Run(10, 8, tuple(Lease(f"r{i}", i << 30, (4096,) * 64, 4096, i) for i in range(256)), b""),
    Run(11, 7, (Lease("req-3", 0, (4096,), 4096, 5),), b"XD", None, STATE, True),
    AddLease(7, 9, Lease("req-2", 1 << 30, (4096,) * 3, 4096, 4)),
    Landed(
        9,
        (
            ("req-1", 0, 0, 1 << 20, 0xFEED, True),
            ("req-1", 2, 0, 5, 1, False),
            ("req-1", 1, 0, 5, 1, None),
        ),
    ),
    Done(9, 12, None, None, ahead=b"XD\x01", skip=(1 << 20) - 100),
    Done(1, 2 << 20, True, STATE),
    Done(3, 0, None, None, Failure.SEALED, "record failed authentication"),
    Done(4, 65536, True, None, ahead=b"XDC1 the next frame's first bytes"),
    Done(5, 3, None, None, Failure.SUPERSEDED, "a resend of this chunk was verified first"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_round_trip(msg: Message) -> None:
    assert JobReader().feed(encode(msg)) == [msg]


def test_frames_split_anywhere_reassemble_in_order() -> None:
    wire = b"".join(encode(m) for m in MESSAGES)
    for step in (1, 3, 7, 64):
        reader, got = JobReader(), []
        for i in range(0, len(wire), step):
            got += reader.feed(wire[i : i + step])
        assert got == MESSAGES
        assert reader.pending == 0
    half = JobReader()
    assert half.feed(wire[:5]) == [] and half.pending == 5  # a channel cut here was cut mid-frame


def _frame(body: object) -> bytes:
    raw: bytes = msgpack.packb(body, use_bin_type=True)
    return prefixed(raw)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ([], "non-empty array"),
        ({"op": 1}, "non-empty array"),
        ([99, 1], "unknown op"),
        ([Op.ADOPT, 1, True], "expected 3 fields"),
        ([Op.ADOPT, -1, True, 1.0], "unsigned"),
        ([Op.ADOPT, True, True, 1.0], "unsigned"),
        ([Op.ADOPT, 1, 1, 1.0], "boolean"),
        ([Op.ADOPT, 1, True, -5], "seconds"),
        ([Op.RECV, 1, 1, 0, 10, 0, ["r", 0], None, None, None], "cell"),
        ([Op.RECV, 1, 1, 0, 10, 0, ["r", 0, 0], None, None], "expected 9 fields"),
        ([Op.RECV, 1, 1, 0, 10, 0, ["r", 0, 0], None, None, STOP_SLOTS], "stop flag"),
        ([Op.RECV, 1, 1, 0, 10, 0, ["r", 0, 0], None, None, -1], "unsigned"),
        (
            [
                Op.RECV,
                *(1, 1, 0, 10, 0, ["r", 0, 0], None),
                ["aes-128-gcm", b"k", 0, 0, 0, 1, b""],
                None,
            ],
            "32 bytes",
        ),
        (
            [
                Op.RECV,
                1,
                1,
                0,
                10,
                0,
                ["r", 0, 0],
                None,
                ["c", b"k" * 32, 0, 0, 0, 1, b"x" * (200 << 10)],
                None,
            ],
            "buffered",
        ),
        ([Op.RECV, 1, 1, 0, 10, 0, ["x" * 2000, 0, 0], None, None, None], "1024"),
        ([Op.SEND, 1, 1, [], None], "1..64 chunks"),
        ([Op.SEND, 1, 1, [["r", 0, 0, 1, 0, None, None]] * (MAX_CHUNKS + 1), None], "1..64"),
        ([Op.SEND, 1, 1, [["r", 0, 0, 1, 0, None]], None], "7-element"),
        ([Op.SEND, 1, 1, [["r", 0, 0, 1, 0, None, True, 1]], None], "7-element"),
        ([Op.SEND, 1, 1, [["r", 0, 0, 1, 0, None, 1]], None], "boolean"),
        ([Op.DONE, 1, 0, None, None, 42, "", b"", 0], "unknown failure"),
        ([Op.DONE, 1, 0, "yes", None, 0, "", b"", 0], "boolean"),
        ([Op.DONE, 1, 0, None, None, 0, "", b""], "8 fields"),
        ([Op.DONE, 1, 0, None, None, 0, "", "header", 0], "read ahead"),
        ([Op.DONE, 1, 0, None, None, 0, "", b"x" * (MAX_AHEAD + 1), 0], "read ahead"),
        ([Op.DONE, 1, 0, None, None, 0, "", b"", -1], "unsigned"),
        ([Op.RUN, 1, 1, [], b"", None, None, False], "1..256 leases"),
        ([Op.RUN, 1, 1, [LEASE] * (MAX_LEASES + 1), b"", None, None, False], "1..256 leases"),
        ([Op.RUN, 1, 1, [["r", 0, [1], 0, 0]], b"", None, None, False], "chunk bytes must be > 0"),
        ([Op.RUN, 1, 1, [["r", 0, 1, 4, 0]], b"", None, None, False], "a lease is"),
        ([Op.RUN, 1, 1, [["r", 0, [1] * 4097, 4, 0]], b"", None, None, False], "layers"),
        ([Op.RUN, 1, 1, [["r", 0, [-1], 4, 0]], b"", None, None, False], "unsigned"),
        ([Op.RUN, 1, 1, [LEASE], b"x" * (MAX_AHEAD + 1), None, None, False], "at most"),
        ([Op.RUN, 1, 1, [LEASE], "bytes", None, None, False], "at most"),
        ([Op.RUN, 1, 1, [LEASE], b"", STOP_SLOTS, None, False], "stop flag"),
        ([Op.RUN, 1, 1, [["r", 0, [1], 4, STOP_SLOTS]], b"", None, None, False], "stop flag"),
        ([Op.RUN, 1, 1, [["r", 0, [1], 4]], b"", None, None, False], "a lease is"),
        ([Op.RUN, 1, 1, [LEASE], b"", None, None], "7 fields"),
        ([Op.RUN, 1, 1, [LEASE], b"", None, None, 1], "boolean"),
        ([Op.RUN, 1, 1, [LEASE], b"", None, [1], False], "7-element"),
        ([Op.LEASE, 1, 9, ["r", 0, [1], 4]], "a lease is"),
        ([Op.LEASE, 1, 9], "3 fields"),
        ([Op.LANDED, 1, []], "1..1024 cells"),
        ([Op.LANDED, 1, [["r", 0, 0, 1, 2, True]] * 1025], "1..1024 cells"),
        ([Op.LANDED, 1, [["r", 0, 0, 1, 2, 1]]], "boolean"),
        ([Op.LANDED, 1, [["r", 0, 0, 1, 2]]], "a LANDED cell is"),
    ],
)
def test_what_neither_side_would_write_is_refused(body: object, why: str) -> None:
    reader = JobReader()
    with pytest.raises(WorkerProtocolError, match=why):
        reader.feed(_frame(body))
    with pytest.raises(WorkerProtocolError, match="already failed"):
        reader.feed(encode(Drop(1)))  # nothing more is believed from that channel


def test_an_oversized_or_undecodable_frame_is_refused_before_it_is_buffered() -> None:
    with pytest.raises(WorkerProtocolError, match="at most"):
        JobReader().feed(PREFIX.pack(MAX_FRAME + 1))
    with pytest.raises(WorkerProtocolError, match="undecodable"):
        decode(b"\xc1")
    with pytest.raises(WorkerProtocolError, match="frame of"):
        encode(Send(1, 1, tuple(SendChunk("r" * 1000, 0, 0, 1, 0, None) for _ in range(600)), None))
