"""A buggy or hostile engine on a daemon's control socket: whatever it sends, the daemon
answers that connection alone (or closes it when the framing is lost), never exits, and keeps
serving a correct transfer to everyone else."""

from __future__ import annotations

import math
import os
import socket
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from xdc.transport.engine_socket import (
    PASS_FD,
    TrioChannel,
    recv_blocking,
    recv_fd_blocking,
    send_blocking,
    serve_engine,
)

from tests.transport_fixtures import PairFactory, transfer_and_verify
from xdc.errors import ResultCode, TransferError
from xdc.protocol.engine_control import (
    RECEIVER_OPS,
    ErrorEvent,
    Release,
    Reply,
    decode_daemon_message,
    encode_request,
)

HOSTILE_BODIES: list[tuple[str, bytes]] = [
    ("not msgpack", b"\xc1\xc1\xc1"),
    ("empty", b""),
    ("trailing bytes", msgpack.packb({"op": "status", "id": 1}) + b"\x01\x02"),
    ("not a map", msgpack.packb([1, 2, 3])),
    ("non-string key", msgpack.packb({1: "status", "id": 1})),
    ("unknown op", msgpack.packb({"op": "format_disk", "id": 1})),
    ("op wrong type", msgpack.packb({"op": 5, "id": 1})),
    ("id wrong type", msgpack.packb({"op": "status", "id": "one"})),
    ("id negative", msgpack.packb({"op": "status", "id": -4})),
    ("timeout NaN", msgpack.packb({"op": "await", "id": 1, "timeout_s": math.nan})),
    ("timeout negative", msgpack.packb({"op": "await", "id": 1, "timeout_s": -1})),
    ("timeout huge", msgpack.packb({"op": "await", "id": 1, "timeout_s": 1e308})),
    ("layer as str", msgpack.packb({"op": "ready", "rid": "r", "layer": "0"})),
    ("upto negative", msgpack.packb({"op": "ready", "rid": "r", "layer": 0, "upto": -1})),
    ("sizes NaN", msgpack.packb({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [math.nan]})),
    ("sizes negative", msgpack.packb({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [-8]})),
    ("sizes huge", msgpack.packb({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [2**63]})),
    (
        "deadline inf",
        msgpack.packb(
            {"op": "begin", "id": 1, "rid": "r", "layer_sizes": [1], "deadline_s": math.inf}
        ),
    ),
    (
        "rid with newline",
        msgpack.packb({"op": "begin", "id": 1, "rid": "a\nb", "layer_sizes": [1]}),
    ),
    ("rid binary", msgpack.packb({"op": "release", "id": 1, "rid": b"\x00\xff"})),
    ("nested junk", msgpack.packb({"op": "begin", "id": 1, "rid": "r", "layer_sizes": [[[]]]})),
    (
        "alloc unknown request",
        msgpack.packb({"op": "alloc", "id": 1, "rid": "nope", "layers": [0]}),
    ),
    ("release unknown request", msgpack.packb({"op": "release", "id": 1, "rid": "nope"})),
]


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _send_body(s: socket.socket, body: bytes) -> None:
    s.sendall(struct.pack("!I", len(body)) + body)


def _answers(s: socket.socket) -> list[Any]:
    """Everything the daemon has said on this connection until a status round trip."""
    _send_body(s, msgpack.packb({"op": "status", "id": 999}))
    out = []
    while True:
        msg = decode_daemon_message(recv_blocking(s))
        out.append(msg)
        if isinstance(msg, Reply) and msg.id == 999:
            return out


def _transfer_still_works(tx_sock: str, rx_sock: str, rid: str) -> None:
    transfer_and_verify(tx_sock, rx_sock, rid, [70_000, 3 * 65536])


@pytest.mark.parametrize("daemon", ["sender", "receiver"])
def test_hostile_messages_are_answered_and_the_daemon_keeps_serving(
    pair_factory: PairFactory, daemon: str
) -> None:
    p = pair_factory(chunk_bytes=65536).start()
    path = p.tx_sock if daemon == "sender" else p.rx_sock
    with _raw(path) as s:
        for name, body in HOSTILE_BODIES:
            _send_body(s, body)
            said = _answers(s)[:-1]
            refusals = [
                m for m in said if (isinstance(m, Reply) and not m.ok) or isinstance(m, ErrorEvent)
            ]
            assert refusals, f"{name}: no refusal, got {said}"
            assert all(
                m.code
                in (
                    ResultCode.BAD_REQUEST,
                    ResultCode.BAD_OP,
                    ResultCode.UNKNOWN_REQUEST,
                )
                for m in refusals
            ), (name, refusals)
    for d in (p.tx, p.rx):
        assert d is not None and d.proc.poll() is None, d.log() if d else ""
    _transfer_still_works(p.tx_sock, p.rx_sock, f"after-hostile-{daemon}")
    logs = p.logs()
    assert "internal error" not in logs and "Traceback" not in logs, logs


@pytest.mark.parametrize("daemon", ["sender", "receiver"])
def test_a_frame_longer_than_the_limit_closes_only_that_connection(
    pair_factory: PairFactory, daemon: str
) -> None:
    p = pair_factory().start()
    path = p.tx_sock if daemon == "sender" else p.rx_sock
    with _raw(path) as bystander, _raw(path) as s:
        s.sendall(struct.pack("!I", 0xFFFFFFFF) + b"x" * 100)
        assert s.recv(1) == b""  # closed by the daemon
        _send_body(bystander, msgpack.packb({"op": "status", "id": 1}))
        answer = decode_daemon_message(recv_blocking(bystander))
        assert isinstance(answer, Reply) and answer.ok
    _transfer_still_works(p.tx_sock, p.rx_sock, f"after-frame-{daemon}")


def test_an_engine_that_vanishes_mid_message_leaves_nothing_behind(
    pair_factory: PairFactory,
) -> None:
    p = pair_factory().start()
    _transfer_still_works(p.tx_sock, p.rx_sock, "warm-up")  # every data connection is up
    baseline = p.fds()
    for _ in range(20):
        with _raw(p.tx_sock) as s:
            s.sendall(struct.pack("!I", 1000) + b"\x85")  # a promise of 1000 bytes, then gone
        with _raw(p.rx_sock) as s:
            s.sendall(b"\x00\x00")  # half a length
    _transfer_still_works(p.tx_sock, p.rx_sock, "after-vanish")
    p.assert_clean(baseline)


class _StopsTheDaemon:
    """An engine session whose call is carried out, then the daemon stops (its drain saw
    the call's effect and cancels everything) before the reply went out."""

    def __init__(self, daemon: trio.CancelScope, refuse: bool) -> None:
        self.daemon = daemon
        self.refuse = refuse
        self.released: list[str] = []
        self.ended = False

    async def handle(self, request: Any) -> dict[str, Any]:
        self.released.append(request.rid)
        self.daemon.cancel()
        if self.refuse:
            raise TransferError(ResultCode.UNKNOWN_REQUEST, "no such request", request.rid)
        return {"rid": request.rid}

    def closed(self) -> None:
        self.ended = True


@pytest.mark.parametrize("refuse", [False, True], ids=["carried-out", "refused"])
def test_a_call_is_answered_even_when_the_daemon_stops_meanwhile(refuse: bool) -> None:
    """A receiver draining for SIGTERM saw a decode engine's RELEASE done and ended before
    the engine's connection task sent the reply: the engine read a reset connection for a
    call that succeeded (the CI failure of test_receiver_stops_accepting_and_drains). The
    reply now goes out first, and so does a refusal with its reason; the connection then
    ends."""
    engine, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    engine.settimeout(5)
    send_blocking(engine, encode_request(Release("r1"), 7))

    async def daemon() -> _StopsTheDaemon:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(daemon_end))
        with trio.CancelScope() as scope:
            session = _StopsTheDaemon(scope, refuse)
            await serve_engine(TrioChannel(stream), RECEIVER_OPS, session, "decode")
        return session

    session = trio.run(daemon)
    assert session.released == ["r1"] and session.ended
    answer = decode_daemon_message(recv_blocking(engine))
    assert isinstance(answer, Reply) and answer.id == 7, answer
    if refuse:
        assert not answer.ok and answer.code == ResultCode.UNKNOWN_REQUEST, answer
        assert "no such request" in answer.error, answer
    else:
        assert answer.ok, answer
    assert engine.recv(1) == b""  # then the daemon's end is closed
    engine.close()


class _Answers:
    """An engine session that answers every call at once, passing a descriptor with each
    answer when given a file to open (as a daemon passes its pool with a hello's reply)."""

    def __init__(self, passes: str | None = None) -> None:
        self.ended = False
        self.passes = passes

    async def handle(self, request: Any) -> dict[str, Any]:
        fields: dict[str, Any] = {"rid": request.rid}
        if self.passes is not None:
            fields[PASS_FD] = os.open(self.passes, os.O_RDONLY)
        return fields

    def closed(self) -> None:
        self.ended = True


@pytest.mark.parametrize("passes_fd", [False, True], ids=["reply", "reply+descriptor"])
def test_a_reply_is_not_cut_by_time_the_daemon_spent_paused(
    passes_fd: bool, tmp_path: Path
) -> None:
    """The CI failure of test_a_receiver_paused_under_traffic_loses_no_request: a reply's
    grace was a deadline taken before the write, so a pause of the daemon's process
    (SIGSTOP for 8 s there) ran it out and the daemon closed a connection whose engine was
    reading ("no room for a reply in 2.0s"). Here the reply waits behind another send while
    the clock jumps 10 s (trio's MockClock): it still goes out, with the descriptor it
    passes right behind it, and the connection stays."""
    passed = tmp_path / "pool"
    passed.write_bytes(b"the pool")
    engine, daemon_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    engine.settimeout(5)
    send_blocking(engine, encode_request(Release("r1"), 7))
    clock = trio.testing.MockClock(rate=1)  # real time passes, and jumps when told

    async def daemon() -> _Answers:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(daemon_end))
        chan = TrioChannel(stream)
        session = _Answers(str(passed) if passes_fd else None)
        async with trio.open_nursery() as nursery:
            await chan._send_lock.acquire()  # another send under way (a push)
            nursery.start_soon(serve_engine, chan, RECEIVER_OPS, session, "decode")
            await trio.sleep(0.1)  # the reply is ready and waits for the lock
            clock.jump(10)  # the process was paused meanwhile
            chan._send_lock.release()
            await trio.sleep(0.1)
            nursery.cancel_scope.cancel()
        return session

    session = trio.run(daemon, clock=clock)
    answer = decode_daemon_message(recv_blocking(engine))
    assert isinstance(answer, Reply) and answer.id == 7 and answer.ok, answer
    if passes_fd:
        fd = recv_fd_blocking(engine)
        try:
            assert os.pread(fd, 64, 0) == b"the pool"
        finally:
            os.close(fd)
    assert session.ended
    engine.close()
