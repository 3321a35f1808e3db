"""tcp_info decoding, checked against the kernel's own tool (``ss -ti``) rather than against a
second copy of our offsets.

Recorded structs in tests/data/tcp_info_*.bin come from this file's ``record`` mode
(``python tests/monitor/test_monitor_tcpinfo.py record``, as root): each ``.bin`` has a ``.json``
sidecar with the ``ss -tin`` line printed for the same idle socket at the same moment and the
exact payload byte count written. The ``_<len>.bin`` files are the same bytes truncated to
the struct sizes of older kernels (104: up to 3.14, 168: 4.9, 192: 4.10-4.17, 216: 4.19).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from xdc.monitor.tcpinfo import (
    TCP_ESTABLISHED,
    TcpInfo,
    decode_tcp_info,
    field_end,
    read_tcp_info,
)

DATA = Path(__file__).resolve().parents[1] / "data"  # run as a script too: no tests import
RECORDED = ("tcp_info_loopback_1mib", "tcp_info_lab_loss")
TRUNCATED = (104, 168, 192, 216)
FIELDS = [f for f in TcpInfo.__dataclass_fields__ if f != "length"]


def parse_ss(line: str) -> dict[str, str]:
    """``key:value`` and ``key value`` tokens of one ``ss -tin`` info line."""
    out: dict[str, str] = {}
    toks = line.split()
    for i, tok in enumerate(toks):
        if ":" in tok and not tok.startswith("("):
            k, _, v = tok.partition(":")
            out.setdefault(k, v)
        elif tok in ("pacing_rate", "delivery_rate", "send") and i + 1 < len(toks):
            out[tok] = toks[i + 1]
        elif tok == "app_limited":
            out[tok] = ""
    return out


def _ms_to_us(v: str) -> int:
    return round(float(v) * 1000)


def assert_matches_ss(info: TcpInfo, ss: dict[str, str]) -> None:
    """Every field ss prints exactly must equal ours (ss omits zero counters)."""
    assert info.state == TCP_ESTABLISHED
    assert info.bytes_sent == int(ss["bytes_sent"])
    assert info.bytes_acked == int(ss["bytes_acked"])
    assert info.bytes_retrans == int(ss.get("bytes_retrans", 0))
    assert info.snd_cwnd == int(ss["cwnd"])
    assert info.snd_mss == int(ss["mss"])
    assert info.rto == _ms_to_us(ss["rto"])
    rtt, rttvar = ss["rtt"].split("/")
    assert info.rtt == _ms_to_us(rtt)
    assert info.rttvar == _ms_to_us(rttvar)
    assert info.min_rtt == _ms_to_us(ss["minrtt"])
    assert info.delivered == int(ss["delivered"])
    assert info.total_retrans == int(ss.get("retrans", "0/0").split("/")[1])
    assert info.lost == int(ss.get("lost", 0))
    assert info.notsent_bytes == int(ss.get("notsent", 0))
    assert info.busy_time is not None
    assert info.busy_time // 1000 == int(ss.get("busy", "0ms").removesuffix("ms"))
    assert info.pacing_rate is not None and info.delivery_rate is not None
    assert info.delivery_rate_app_limited == (1 if "app_limited" in ss else 0)
    assert info.pacing_rate * 8 == int(ss["pacing_rate"].removesuffix("bps"))
    assert info.delivery_rate * 8 == int(ss["delivery_rate"].removesuffix("bps"))


# ---- recorded structs ------------------------------------------------------------------


@pytest.mark.parametrize("name", RECORDED)
def test_recorded_struct_decodes_like_ss(name: str) -> None:
    raw = (DATA / f"{name}.bin").read_bytes()
    meta = json.loads((DATA / f"{name}.json").read_text())
    info = decode_tcp_info(raw)
    assert info.length == len(raw) == meta["length"]
    assert_matches_ss(info, parse_ss(meta["ss"]))
    # bytes_acked counts the SYN as well; everything written was sent and acknowledged.
    assert info.bytes_acked == meta["payload_bytes"] + 1
    assert info.bytes_sent == meta["payload_bytes"] + (info.bytes_retrans or 0)


def test_lossy_recording_has_retransmits() -> None:
    info = decode_tcp_info((DATA / "tcp_info_lab_loss.bin").read_bytes())
    assert info.total_retrans is not None and info.total_retrans > 0
    assert info.bytes_retrans is not None and info.bytes_retrans > 0


@pytest.mark.parametrize("name", RECORDED)
@pytest.mark.parametrize("size", TRUNCATED)
def test_truncated_struct_keeps_head_and_drops_tail(name: str, size: int) -> None:
    full = decode_tcp_info((DATA / f"{name}.bin").read_bytes())
    short_raw = (DATA / f"{name}_{size}.bin").read_bytes()
    assert len(short_raw) == size
    short = decode_tcp_info(short_raw)
    assert short.length == size
    for f in FIELDS:
        if field_end(f) <= size:
            assert getattr(short, f) == getattr(full, f), f
        else:
            assert getattr(short, f) is None, f


def test_kernel_release_boundaries() -> None:
    """The struct sizes older kernels return cut exactly where their fields end."""
    assert field_end("total_retrans") == 104
    assert field_end("delivery_rate") == 168
    assert field_end("sndbuf_limited") == 192
    assert field_end("bytes_retrans") == 216
    assert decode_tcp_info(bytes(103)).total_retrans is None
    assert decode_tcp_info(bytes(104)).total_retrans == 0


@given(st.binary(min_size=0, max_size=320))
def test_decode_any_prefix_never_raises(raw: bytes) -> None:
    info = decode_tcp_info(raw)
    assert info.length == len(raw)
    for f in FIELDS:
        assert (getattr(info, f) is None) == (field_end(f) > len(raw))


# ---- live sockets ----------------------------------------------------------------------


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    acc, _ = srv.accept()
    return srv, cli, acc


def _transfer(cli: socket.socket, acc: socket.socket, n: int) -> None:
    """Send exactly ``n`` bytes (from a thread: more than the socket buffers hold) and wait
    until the receiver has read them and the sender has seen every ACK."""
    sender = threading.Thread(target=cli.sendall, args=(b"\x5a" * n,))
    sender.start()
    got = 0
    while got < n:
        got += len(acc.recv(1 << 20))
    sender.join()
    deadline = time.monotonic() + 5
    while (read_tcp_info(cli) or TcpInfo(0)).unacked and time.monotonic() < deadline:
        time.sleep(0.01)


def _ss_line(port: int, netns: str | None = None) -> str:
    argv = ["ss", "-tinH", "state", "established", f"( sport = :{port} )"]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2, out
    return lines[1]


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) not installed")
def test_live_socket_matches_ss() -> None:
    srv, cli, acc = _pair()
    with srv, cli, acc:
        _transfer(cli, acc, 3 * 1024 * 1024 + 17)
        time.sleep(0.05)
        ss = parse_ss(_ss_line(cli.getsockname()[1]))
        info = read_tcp_info(cli)
        assert info is not None
        assert_matches_ss(info, ss)


def test_live_byte_counters_are_exact() -> None:
    n = 5 * 1024 * 1024 + 3
    srv, cli, acc = _pair()
    with srv, cli, acc:
        before = read_tcp_info(cli)
        _transfer(cli, acc, n)
        after = read_tcp_info(cli)
        recv = read_tcp_info(acc)
    assert before is not None and after is not None and recv is not None
    assert before.bytes_sent == 0
    # bytes_sent counts resent bytes too (a tail-loss probe can fire even on loopback).
    assert after.bytes_retrans is not None
    assert after.bytes_sent == n + after.bytes_retrans
    assert after.bytes_acked == n + 1
    assert recv.bytes_received == n
    assert after.delivered is not None and after.delivered >= n // (after.snd_mss or 1)


def test_read_by_fd_does_not_take_ownership() -> None:
    srv, cli, acc = _pair()
    with srv, cli, acc:
        info = read_tcp_info(cli.fileno())
        assert info is not None and info.state == TCP_ESTABLISHED
        os.fstat(cli.fileno())  # still open
        cli.sendall(b"still usable")
        assert acc.recv(64) == b"still usable"


def test_read_dead_or_foreign_handles_returns_none(tmp_path: Path) -> None:
    srv, cli, acc = _pair()
    fd = os.dup(cli.fileno())
    for s in (srv, cli, acc):
        s.close()
    assert read_tcp_info(cli) is None  # closed socket object
    os.close(fd)
    assert read_tcp_info(fd) is None  # closed fd
    assert read_tcp_info(-1) is None
    with open(tmp_path / "f", "wb") as f:
        assert read_tcp_info(f.fileno()) is None  # not a socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert read_tcp_info(udp) is None  # not TCP


def test_read_peer_closed_socket_still_decodes() -> None:
    srv, cli, acc = _pair()
    with srv, cli:
        acc.close()
        deadline = time.monotonic() + 5
        info = read_tcp_info(cli)
        while info is not None and info.state == TCP_ESTABLISHED and time.monotonic() < deadline:
            time.sleep(0.01)  # the peer's FIN is on its way over loopback
            info = read_tcp_info(cli)
    assert info is not None and info.state != TCP_ESTABLISHED  # CLOSE_WAIT


def test_read_trio_socket() -> None:
    async def main() -> TcpInfo | None:
        srv = socket.create_server(("127.0.0.1", 0))
        with srv:
            s = trio.socket.socket()
            with s:
                await s.connect(srv.getsockname())
                acc, _ = srv.accept()
                with acc:
                    return read_tcp_info(s)

    info = trio.run(main)
    assert info is not None and info.state == TCP_ESTABLISHED


# ---- recording (not a test) -------------------------------------------------------------


def _record_client(host: str, port: int, n: int, out: str) -> None:
    """Inside the sending namespace: send ``n`` bytes, wait until acked, save struct + ss."""
    cli = socket.create_connection((host, port))
    cli.sendall(b"\x5a" * n)
    deadline = time.monotonic() + 30
    while (read_tcp_info(cli) or TcpInfo(0)).unacked and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    ss = _ss_line(cli.getsockname()[1])
    raw = cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 512)
    _save(out, raw, ss, n)
    cli.close()


def _save(stem: str, raw: bytes, ss: str, n: int) -> None:
    meta: dict[str, Any] = {
        "kernel": os.uname().release,
        "length": len(raw),
        "payload_bytes": n,
        "ss": ss.strip(),
    }
    Path(stem + ".bin").write_bytes(raw)
    Path(stem + ".json").write_text(json.dumps(meta, indent=1) + "\n")
    for size in TRUNCATED:
        Path(f"{stem}_{size}.bin").write_bytes(raw[:size])


def _record() -> None:
    from xdc.lab.netlab import NetLab

    DATA.mkdir(exist_ok=True)
    srv, cli, acc = _pair()
    with srv, cli, acc:
        n = 1024 * 1024
        _transfer(cli, acc, n)
        time.sleep(0.2)
        ss = _ss_line(cli.getsockname()[1])
        raw = cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 512)
        _save(str(DATA / "tcp_info_loopback_1mib"), raw, ss, n)
    with NetLab() as lab:
        lab.set_rate(0.5)
        lab.set_loss(0.02)
        sink = lab.popen(
            "b",
            [
                sys.executable,
                "-m",
                "xdc.lab.link_load",
                "sink",
                "--host",
                lab.addr_b,
                "--port",
                "5301",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sink.stdout is not None and "ready" in sink.stdout.readline()
        argv = [sys.executable, __file__, "record-client", lab.addr_b, "5301", str(32 << 20)]
        lab.run("a", [*argv, str(DATA / "tcp_info_lab_loss")], check=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        _record()
    elif sys.argv[1:2] == ["record-client"]:
        _record_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
