"""Hypothesis fuzz of the receive path: garbage never escapes as anything but ProtocolError,
and a damaged stream never completes a request with bytes the sender did not send."""

from __future__ import annotations

import random
import struct
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.protocol_fixtures import (
    LIMITS,
    RECEIVER_HELLO,
    SENDER_HELLO,
    Driver,
    make_stream,
)
from xdc.protocol import (
    CLOSED,
    NEED_DATA,
    PAYLOAD,
    Connection,
    ProtocolError,
    encode,
)

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _pieces(data: bytes, rng: random.Random) -> list[bytes]:
    """Random read sizes: byte-at-a-time stretches, small reads and large ones."""
    out = []
    pos = 0
    while pos < len(data):
        mode = rng.random()
        n = 1 if mode < 0.2 else rng.randint(1, 64) if mode < 0.6 else rng.randint(1, 20_000)
        out.append(data[pos : pos + n])
        pos += n
    return out


def _run(driver: Driver, data: bytes, rng: random.Random, *, eof: bool) -> None:
    for piece in _pieces(data, rng):
        driver.feed(piece, direct=rng.random() < 0.5)
    if eof:
        driver.feed(b"")
    if driver.error is not None:  # sticky: the same code on every later call
        for _ in range(2):
            try:
                driver.conn.next_event()
            except ProtocolError as exc:
                assert exc.code == driver.error.code
            else:
                raise AssertionError("an event after a ProtocolError")


# ---- (1) arbitrary bytes ----------------------------------------------------------------------


@FUZZ
@given(
    garbage=st.binary(max_size=2000),
    after_hello=st.booleans(),
    seed=st.integers(0, 2**32),
    eof=st.booleans(),
)
def test_arbitrary_bytes(garbage: bytes, after_hello: bool, seed: int, eof: bool) -> None:
    prefix = encode(SENDER_HELLO) if after_hello else b""
    driver = Driver()
    _run(driver, prefix + garbage, random.Random(seed), eof=eof)
    assert not driver.completed
    sender = Connection("sender", LIMITS)
    sender.send(SENDER_HELLO)
    try:
        sender.receive_data((encode(RECEIVER_HELLO) if after_hello else b"") + garbage)
        if eof:
            sender.receive_data(b"")
        while (ev := sender.next_event()) not in (NEED_DATA, CLOSED, PAYLOAD):
            pass
        if ev is PAYLOAD:  # a receiver may not send CHUNK
            raise AssertionError("a sender-role connection accepted a CHUNK")
    except ProtocolError:
        pass


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=140)
    | st.binary(max_size=20)
    | st.sampled_from(["r", "req-1", "sender", "receiver", ""]),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=8,
)


@FUZZ
@given(
    frames=st.lists(
        st.tuples(
            st.integers(0, 15),
            st.lists(_values, max_size=7),
            st.integers(0, 300),
            st.booleans(),
        ),
        max_size=12,
    ),
    seed=st.integers(0, 2**32),
)
def test_well_framed_random_headers(
    frames: list[tuple[int, list[Any], int, bool]], seed: int
) -> None:
    """Valid prefixes around random msgpack headers exercise every field check."""
    parts = [encode(SENDER_HELLO)]
    for ftype, fields, payload_len, with_payload in frames:
        header = msgpack.packb(fields, use_bin_type=True)
        plen = payload_len if with_payload else 0
        parts.append(struct.pack("!2sBBHHI", b"XD", ftype, 0, len(header), 0, plen) + header)
        parts.append(bytes(plen))
    driver = Driver()
    _run(driver, b"".join(parts), random.Random(seed), eof=True)
    assert not driver.completed


# ---- (2) valid streams, damaged --------------------------------------------------------------

_layers = st.lists(st.integers(0, 3 * 4096 + 17), min_size=1, max_size=4).filter(
    lambda sizes: sum(sizes) > 0
)
_mutation = st.tuples(
    st.floats(0, 1, exclude_max=True),
    st.sampled_from(["flip", "insert", "delete"]),
    st.integers(1, 255),
)


@FUZZ
@given(
    first=_layers,
    second=st.none() | _layers,
    mutations=st.lists(_mutation, max_size=4),
    truncate=st.none() | st.floats(0, 1),
    seed=st.integers(0, 2**32),
)
def test_damaged_streams_never_complete_with_wrong_bytes(
    first: list[int],
    second: list[int] | None,
    mutations: list[tuple[float, str, int]],
    truncate: float | None,
    seed: int,
) -> None:
    rng = random.Random(seed)
    requests = [("req-a", first)] + ([("request-bb", second)] if second is not None else [])
    stream = make_stream(rng, requests)
    data = bytearray(stream.data)
    for where, kind, value in mutations:
        pos = int(where * len(data))
        if kind == "flip":
            data[pos] ^= value
        elif kind == "insert":
            data[pos:pos] = bytes([value])
        else:
            del data[pos]
    if truncate is not None:
        del data[int(truncate * len(data)) :]
    driver = Driver()
    _run(driver, bytes(data), rng, eof=True)
    for rid in driver.completed:
        assert driver.landed_correctly(stream, rid), rid
    if not mutations and truncate is None:
        # the undamaged stream is the positive control: everything arrives and verifies
        assert driver.error is None
        assert driver.completed == set(stream.begins)
        for rid in stream.begins:
            assert driver.trackers[rid].verified_bytes == stream.begins[rid].total_bytes
