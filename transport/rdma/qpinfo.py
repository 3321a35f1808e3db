"""The two small messages RDMA adds to the authenticated TCP control connection.

``QpInfo`` is what a peer must know to connect a reliable-connected queue pair to ours and to
write into our registered pool; ``SlotGrant`` tells the sender where one accepted request's
buffer (and its sampled-checksum table) lives. Both are versioned msgpack maps decoded
strictly: a peer that sends a bool where an int belongs, a 15-byte GID or an extra key is
buggy or hostile, and an RDMA peer gets to write into our memory, so we refuse rather than
guess. Nothing here trusts the peer with more than the ranges the verbs API itself accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgpack

from xdc.errors import RemoteConnectionError

QPINFO_VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 1024
MAX_POOL_NAME: Final = 255
MAX_RID_CHARS: Final = 128  # same bound as the TCP protocol's rids
MTUS: Final = (256, 512, 1024, 2048, 4096)
U16: Final = (1 << 16) - 1
U24: Final = (1 << 24) - 1
U32: Final = (1 << 32) - 1
U64: Final = (1 << 64) - 1


class QpInfoError(RemoteConnectionError, ValueError):
    """A QP-info or grant message that must not be used; the peer stays on TCP."""


@dataclass(frozen=True, slots=True)
class QpInfo:
    qp_num: int  # 24-bit queue pair number
    psn: int  # 24-bit initial packet sequence number
    gid: bytes  # 16-byte GID (RoCE needs it; IB may use the LID alone)
    lid: int
    mtu: int  # path MTU in bytes
    rkey: int  # remote key of the registered pool (0 on a pure writer)
    addr: int  # virtual address of the pool's first byte
    length: int  # bytes registered from addr
    pool: str  # the shared-memory pool's name, so a mismatch is caught early


@dataclass(frozen=True, slots=True)
class SlotGrant:
    rid: str
    slot: int  # request slot, carried in every WRITE_WITH_IMM's immediate data
    addr: int  # remote address of the request's first byte
    length: int  # the request's total bytes
    sums_addr: int  # remote address of the u64 table for sampled checksums (0 = none)
    verify_every: int  # checksum chunk i when i % verify_every == phase (0 = never)
    phase: int


_QP_KEYS: Final = ("v", "qp_num", "psn", "gid", "lid", "mtu", "rkey", "addr", "length", "pool")
_GRANT_KEYS: Final = ("v", "rid", "slot", "addr", "length", "sums_addr", "every", "phase")


def _pack(msg: dict[str, Any]) -> bytes:
    try:
        data: bytes = msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise QpInfoError(f"cannot encode: {exc}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise QpInfoError(f"message of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    return data


def _unpack(data: bytes, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise QpInfoError(f"{what} of {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise QpInfoError(f"{what} is not valid msgpack: {exc}") from None
    if not isinstance(msg, dict):
        raise QpInfoError(f"{what} is not a map")
    version = msg.get("v")
    if type(version) is not int or version != QPINFO_VERSION:
        raise QpInfoError(f"{what} version {version!r} is not {QPINFO_VERSION}")
    if set(msg) != set(keys):
        missing = sorted(set(keys) - set(msg))
        extra = sorted(map(str, set(msg) - set(keys)))
        raise QpInfoError(f"{what} keys wrong: missing {missing}, unexpected {extra}")
    return msg


def _int(msg: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = msg[key]
    if type(value) is not int or not lo <= value <= hi:  # bool is not an int here
        raise QpInfoError(f"{key} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _check_span(addr: int, length: int) -> None:
    if addr + length > U64 + 1:
        raise QpInfoError(f"region {addr:#x}+{length} wraps the address space")


def encode_qpinfo(info: QpInfo) -> bytes:
    """Encode after validating, so we never send what our own decoder would refuse."""
    data = _pack(
        {
            "v": QPINFO_VERSION,
            "qp_num": info.qp_num,
            "psn": info.psn,
            "gid": bytes(info.gid),
            "lid": info.lid,
            "mtu": info.mtu,
            "rkey": info.rkey,
            "addr": info.addr,
            "length": info.length,
            "pool": info.pool,
        }
    )
    decode_qpinfo(data)
    return data


def decode_qpinfo(data: bytes) -> QpInfo:
    msg = _unpack(data, _QP_KEYS, "qp info")
    gid = msg["gid"]
    if type(gid) is not bytes or len(gid) != 16:
        raise QpInfoError(f"gid must be 16 bytes, got {gid!r}")
    mtu = msg["mtu"]
    if type(mtu) is not int or mtu not in MTUS:
        raise QpInfoError(f"mtu must be one of {MTUS}, got {mtu!r}")
    pool = msg["pool"]
    if type(pool) is not str or not 0 < len(pool) <= MAX_POOL_NAME or "/" in pool:
        raise QpInfoError(f"pool must be a name of 1..{MAX_POOL_NAME} chars without '/'")
    info = QpInfo(
        qp_num=_int(msg, "qp_num", 1, U24),  # QP 0 and 1 are the special management QPs
        psn=_int(msg, "psn", 0, U24),
        gid=gid,
        lid=_int(msg, "lid", 0, U16),
        mtu=mtu,
        rkey=_int(msg, "rkey", 0, U32),
        addr=_int(msg, "addr", 0, U64),
        length=_int(msg, "length", 0, U64),
        pool=pool,
    )
    _check_span(info.addr, info.length)
    return info


def encode_grant(grant: SlotGrant) -> bytes:
    data = _pack(
        {
            "v": QPINFO_VERSION,
            "rid": grant.rid,
            "slot": grant.slot,
            "addr": grant.addr,
            "length": grant.length,
            "sums_addr": grant.sums_addr,
            "every": grant.verify_every,
            "phase": grant.phase,
        }
    )
    decode_grant(data)
    return data


def decode_grant(data: bytes) -> SlotGrant:
    msg = _unpack(data, _GRANT_KEYS, "slot grant")
    rid = msg["rid"]
    if type(rid) is not str or not 0 < len(rid) <= MAX_RID_CHARS:
        raise QpInfoError(f"rid must be a string of 1..{MAX_RID_CHARS} chars")
    every = _int(msg, "every", 0, U32)
    grant = SlotGrant(
        rid=rid,
        slot=_int(msg, "slot", 0, U32),
        addr=_int(msg, "addr", 0, U64),
        length=_int(msg, "length", 0, U64),
        sums_addr=_int(msg, "sums_addr", 0, U64),
        verify_every=every,
        phase=_int(msg, "phase", 0, max(every - 1, 0)),
    )
    _check_span(grant.addr, grant.length)
    if every and grant.sums_addr == 0:
        raise QpInfoError("a grant that samples checksums needs a checksum table address")
    return grant
