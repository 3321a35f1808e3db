"""QP-info and slot-grant messages: round trips, strict rejection, fuzzing."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.transport.rdma.qpinfo import (
    MTUS,
    QpInfo,
    QpInfoError,
    SlotGrant,
    decode_grant,
    decode_qpinfo,
    encode_grant,
    encode_qpinfo,
)

INFO = QpInfo(
    qp_num=0x1234,
    psn=0xABCDEF,
    gid=bytes(range(16)),
    lid=7,
    mtu=4096,
    rkey=0xDEADBEEF,
    addr=0x7F00_0000_0000,
    length=1 << 30,
    pool="xdc-rx-42-abcd",
)


def _raw(info: QpInfo) -> dict[str, Any]:
    msg: dict[str, Any] = msgpack.unpackb(encode_qpinfo(info), raw=False)
    return msg


def test_round_trip() -> None:
    assert decode_qpinfo(encode_qpinfo(INFO)) == INFO


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("v", 2),
        ("qp_num", True),  # bool is not an int on the wire
        ("qp_num", 0),
        ("qp_num", 1 << 24),
        ("psn", -1),
        ("gid", bytes(15)),
        ("gid", "00" * 16),
        ("mtu", 1500),
        ("rkey", 1 << 32),
        ("pool", "../etc"),
        ("pool", ""),
        ("length", 1.5),
    ],
)
def test_rejects_bad_field(key: str, value: object) -> None:
    msg = _raw(INFO)
    msg[key] = value
    with pytest.raises(QpInfoError):
        decode_qpinfo(msgpack.packb(msg, use_bin_type=True))


def test_rejects_extra_missing_and_wrapping() -> None:
    msg = _raw(INFO)
    msg["extra"] = 1
    with pytest.raises(QpInfoError, match="unexpected"):
        decode_qpinfo(msgpack.packb(msg, use_bin_type=True))
    msg = _raw(INFO)
    del msg["rkey"]
    with pytest.raises(QpInfoError, match="missing"):
        decode_qpinfo(msgpack.packb(msg, use_bin_type=True))
    msg = _raw(INFO)
    msg["addr"], msg["length"] = (1 << 64) - 10, 11
    with pytest.raises(QpInfoError, match="wraps"):
        decode_qpinfo(msgpack.packb(msg, use_bin_type=True))
    with pytest.raises(QpInfoError, match="over"):
        decode_qpinfo(b"\x90" * 2000)


def test_encode_refuses_what_decode_would_refuse() -> None:
    with pytest.raises(QpInfoError):
        encode_qpinfo(QpInfo(**{**_fields(INFO), "gid": b"short"}))
    with pytest.raises(QpInfoError):
        encode_qpinfo(QpInfo(**{**_fields(INFO), "addr": 1 << 70}))


def _fields(info: QpInfo) -> dict[str, Any]:
    return {name: getattr(info, name) for name in QpInfo.__slots__}


def test_grant_round_trip_and_rules() -> None:
    grant = SlotGrant("r1", 3, 4096, 100_000, 200_000, 16, 5)
    assert decode_grant(encode_grant(grant)) == grant
    with pytest.raises(QpInfoError, match="phase"):
        encode_grant(SlotGrant("r1", 3, 4096, 10, 200_000, 16, 16))
    with pytest.raises(QpInfoError, match="table"):
        encode_grant(SlotGrant("r1", 3, 4096, 10, 0, 16, 0))
    assert decode_grant(encode_grant(SlotGrant("r1", 0, 0, 0, 0, 0, 0))).verify_every == 0


qpinfos = st.builds(
    QpInfo,
    qp_num=st.integers(1, (1 << 24) - 1),
    psn=st.integers(0, (1 << 24) - 1),
    gid=st.binary(min_size=16, max_size=16),
    lid=st.integers(0, 65535),
    mtu=st.sampled_from(MTUS),
    rkey=st.integers(0, (1 << 32) - 1),
    addr=st.integers(0, 1 << 48),
    length=st.integers(0, 1 << 40),
    pool=st.text(min_size=1, max_size=64).filter(lambda s: "/" not in s),
)


@settings(max_examples=200, deadline=None)
@given(qpinfos)
def test_valid_infos_round_trip(info: QpInfo) -> None:
    assert decode_qpinfo(encode_qpinfo(info)) == info


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_raise_qpinfoerror(data: bytes) -> None:
    """Garbage never escapes as another exception type, and whatever is accepted is canonical."""
    try:
        info = decode_qpinfo(data)
    except QpInfoError:
        pass
    else:
        assert decode_qpinfo(encode_qpinfo(info)) == info
    try:
        grant = decode_grant(data)
    except QpInfoError:
        pass
    else:
        assert decode_grant(encode_grant(grant)) == grant


@settings(max_examples=300, deadline=None)
@given(
    qpinfos,
    st.sampled_from(["qp_num", "psn", "gid", "lid", "mtu", "rkey", "addr", "length", "pool", "v"]),
    st.one_of(
        st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.binary(), st.text()
    ),
)
def test_mutated_field_is_accepted_only_if_valid(info: QpInfo, key: str, value: object) -> None:
    msg = _raw(info)
    msg[key] = value
    try:
        out = decode_qpinfo(msgpack.packb(msg, use_bin_type=True))
    except QpInfoError:
        return
    # accepted: then it must be exactly a valid message, and re-encode identically
    assert type(value) is not bool
    assert decode_qpinfo(encode_qpinfo(out)) == out
