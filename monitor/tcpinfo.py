"""Decode Linux ``struct tcp_info`` by field offset.

The kernel only ever *appends* fields to ``struct tcp_info`` and copies
``min(len(user buffer), sizeof(struct tcp_info))`` bytes, so an older kernel simply returns a
shorter struct. Decoding by fixed offset (instead of one ``struct.unpack`` of a fixed layout)
lets one binary read every kernel: a field whose bytes are not there is ``None``, never a
misread neighbour. Offsets are those of include/uapi/linux/tcp.h (checked with ``offsetof``
against the installed header; the kernel release that added each tail field is noted).
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Protocol

TCP_INFO = getattr(socket, "TCP_INFO", 11)

# Larger than any kernel's struct (280 bytes on 6.18); the kernel truncates to its own size.
TCP_INFO_BUFLEN = 512

# name -> (offset, struct code). Field order is the struct's, so truncation is monotone.
_FIELDS: dict[str, tuple[int, str]] = {
    "state": (0, "B"),
    "ca_state": (1, "B"),
    "retransmits": (2, "B"),
    "backoff": (4, "B"),
    "delivery_rate_app_limited": (7, "B"),  # bit 0 of a bitfield byte, masked on decode
    "rto": (8, "I"),
    "snd_mss": (16, "I"),
    "unacked": (24, "I"),
    "lost": (32, "I"),
    "retrans": (36, "I"),
    "rtt": (68, "I"),
    "rttvar": (72, "I"),
    "snd_ssthresh": (76, "I"),
    "snd_cwnd": (80, "I"),
    "total_retrans": (100, "I"),  # struct length 104: the 2.6-era layout ends here
    "pacing_rate": (104, "Q"),  # 3.15
    "max_pacing_rate": (112, "Q"),
    "bytes_acked": (120, "Q"),  # 4.1
    "bytes_received": (128, "Q"),
    "notsent_bytes": (144, "I"),  # 4.6
    "min_rtt": (148, "I"),
    "delivery_rate": (160, "Q"),  # 4.9
    "busy_time": (168, "Q"),  # 4.10
    "rwnd_limited": (176, "Q"),
    "sndbuf_limited": (184, "Q"),
    "delivered": (192, "I"),  # 4.18
    "delivered_ce": (196, "I"),  # packets delivered with a CE mark echoed (ECN)
    "bytes_sent": (200, "Q"),  # 4.19
    "bytes_retrans": (208, "Q"),
}

_SIZES = {"B": 1, "I": 4, "Q": 8}
_ENDS = {name: off + _SIZES[code] for name, (off, code) in _FIELDS.items()}
_STRUCTS = {name: struct.Struct("=" + code) for name, (_, code) in _FIELDS.items()}

# One precompiled layout for the common case (a struct that holds every field): the sampler
# decodes 64 sockets ten times a second, and one unpack is far cheaper than one per field.
_FULL_END = max(_ENDS.values())
_FULL_ORDER = sorted(_FIELDS, key=lambda n: _FIELDS[n][0])


def _full_struct() -> struct.Struct:
    fmt = "="
    pos = 0
    for name in _FULL_ORDER:
        off, code = _FIELDS[name]
        if off > pos:
            fmt += f"{off - pos}x"
        fmt += code
        pos = off + _SIZES[code]
    return struct.Struct(fmt)


_FULL = _full_struct()
assert _FULL.size == _FULL_END
_APP_LIMITED = _FULL_ORDER.index("delivery_rate_app_limited")

TCP_ESTABLISHED = 1
TCP_CA_LOSS = 4  # RTO recovery: the connection timed out and is resending from snd_una


@dataclass(frozen=True, slots=True)
class TcpInfo:
    """One socket's ``tcp_info``; times in microseconds and rates in bytes/s, as the kernel
    reports them. ``None`` means the running kernel's struct is too short to hold the field."""

    length: int
    state: int | None = None
    ca_state: int | None = None
    retransmits: int | None = None
    backoff: int | None = None
    delivery_rate_app_limited: int | None = None  # 1: the rate sample was app-limited
    rto: int | None = None
    snd_mss: int | None = None
    unacked: int | None = None
    lost: int | None = None
    retrans: int | None = None
    rtt: int | None = None
    rttvar: int | None = None
    snd_ssthresh: int | None = None
    snd_cwnd: int | None = None
    total_retrans: int | None = None
    pacing_rate: int | None = None
    max_pacing_rate: int | None = None
    bytes_acked: int | None = None
    bytes_received: int | None = None
    notsent_bytes: int | None = None
    min_rtt: int | None = None
    delivery_rate: int | None = None
    busy_time: int | None = None
    rwnd_limited: int | None = None
    sndbuf_limited: int | None = None
    delivered: int | None = None
    delivered_ce: int | None = None
    bytes_sent: int | None = None
    bytes_retrans: int | None = None


def decode_tcp_info(raw: bytes) -> TcpInfo:
    """Decode whatever prefix of ``struct tcp_info`` the kernel returned."""
    n = len(raw)
    if n >= _FULL_END:
        full = list(_FULL.unpack_from(raw))
        full[_APP_LIMITED] &= 1
        return TcpInfo(n, *full)  # positional: field order == offset order
    values = {
        name: _STRUCTS[name].unpack_from(raw, _FIELDS[name][0])[0]
        for name in _FIELDS
        if _ENDS[name] <= n
    }
    if "delivery_rate_app_limited" in values:
        values["delivery_rate_app_limited"] &= 1
    return TcpInfo(n, **values)


def field_end(name: str) -> int:
    """Struct length a kernel must return for ``name`` to be present (for tests and docs)."""
    return _ENDS[name]


class _HasGetsockopt(Protocol):
    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


def read_tcp_info(sock_or_fd: _HasGetsockopt | int) -> TcpInfo | None:
    """``getsockopt(TCP_INFO)`` on a socket object or a raw fd; ``None`` if that fails.

    Sampling races with the owner closing the socket, so every failure (closed object, stale
    fd, fd reused by a non-TCP file) means "no sample", never an exception.
    """
    try:
        if isinstance(sock_or_fd, int):
            if sock_or_fd < 0:
                return None
            # Wrap the fd without owning it: detach() before the object can close it.
            tmp = socket.socket(fileno=sock_or_fd)
            try:
                raw = tmp.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_BUFLEN)
            finally:
                tmp.detach()
        else:
            raw = sock_or_fd.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_BUFLEN)
    except (OSError, ValueError, TypeError):
        return None
    if not raw:
        return None
    return decode_tcp_info(raw)


# decode_tcp_info's fast path passes values positionally: the dataclass must list the fields
# in offset order, right after ``length``.
assert [f for f in TcpInfo.__dataclass_fields__ if f != "length"] == _FULL_ORDER
