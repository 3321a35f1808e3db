"""Host counters: parsing of the real /proc files and of awkward variants, and deltas that
follow real traffic."""

from __future__ import annotations

import socket
from pathlib import Path

from xdc.monitor.procnet import HostCounters, HostDelta, parse_counters

SNMP = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 100
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens OutSegs RetransSegs
Tcp: 1 200 120000 -1 7 1000 10
Udp: InDatagrams NoPorts
Udp: 5 0
"""
NETSTAT = """\
TcpExt: SyncookiesSent TCPLostRetransmit TCPTimeouts TCPSackRecovery
TcpExt: 0 3 2 4
IpExt: InNoRoutes
IpExt: 0
"""


def test_parse_real_proc_files() -> None:
    snmp = parse_counters(Path("/proc/net/snmp").read_text())
    netstat = parse_counters(Path("/proc/net/netstat").read_text())
    assert {"OutSegs", "RetransSegs", "InSegs"} <= snmp["Tcp"].keys()
    assert {"TCPTimeouts", "TCPLostRetransmit", "TCPSackRecovery"} <= netstat["TcpExt"].keys()
    assert snmp["Tcp"]["MaxConn"] == -1  # the one signed field parses as such


def test_parse_pairs_and_negative_values() -> None:
    c = parse_counters(SNMP)
    assert c["Tcp"] == {
        "RtoAlgorithm": 1,
        "RtoMin": 200,
        "RtoMax": 120000,
        "MaxConn": -1,
        "ActiveOpens": 7,
        "OutSegs": 1000,
        "RetransSegs": 10,
    }
    assert c["Ip"]["DefaultTTL"] == 64 and c["Udp"]["InDatagrams"] == 5


def test_parse_tolerates_garbage_and_missing_value_lines() -> None:
    text = (
        "garbage line without pair\n"
        "Tcp: A B C\n"  # header without its value line: skipped, not misaligned
        "Udp: X Y\n"
        "Udp: 1 notanumber\n"
        "TcpExt: P Q R\n"
        "TcpExt: 1 2\n"  # fewer values than names: the present ones still count
    )
    c = parse_counters(text)
    assert "Tcp" not in c
    assert c["Udp"] == {"X": 1}
    assert c["TcpExt"] == {"P": 1, "Q": 2}
    assert parse_counters("") == {}


def _fake_proc(root: Path, snmp: str, netstat: str) -> str:
    (root / "net").mkdir(parents=True, exist_ok=True)
    (root / "net" / "snmp").write_text(snmp)
    (root / "net" / "netstat").write_text(netstat)
    return str(root)


def test_read_merges_snmp_and_netstat(tmp_path: Path) -> None:
    hc = HostCounters.read(_fake_proc(tmp_path, SNMP, NETSTAT))
    assert hc.get("Tcp", "OutSegs") == 1000
    assert hc.get("TcpExt", "TCPTimeouts") == 2
    assert hc.get("TcpExt", "Nope") is None


def test_read_missing_files_gives_empty_counters(tmp_path: Path) -> None:
    hc = HostCounters.read(str(tmp_path))
    assert hc.counters == {}
    assert hc.delta(hc).retrans_ratio is None


def test_delta_and_named_signals(tmp_path: Path) -> None:
    before = HostCounters.read(_fake_proc(tmp_path / "1", SNMP, NETSTAT))
    snmp2 = SNMP.replace("1 200 120000 -1 7 1000 10", "1 200 120000 -1 9 3000 60")
    netstat2 = NETSTAT.replace("0 3 2 4", "0 5 7 4")
    after = HostCounters.read(_fake_proc(tmp_path / "2", snmp2, netstat2))
    d = after.delta(before)
    assert (d.out_segs, d.retrans_segs) == (2000, 50)
    assert d.retrans_ratio == 50 / 2000
    assert (d.lost_retransmit, d.timeouts, d.sack_recovery) == (2, 5, 0)
    assert d.get("Tcp", "ActiveOpens") == 2


def test_delta_of_counter_that_went_backwards_is_zero() -> None:
    before = HostCounters({"Tcp": {"OutSegs": 500, "RetransSegs": 9}})
    after = HostCounters({"Tcp": {"OutSegs": 100, "RetransSegs": 12}, "New": {"X": 1}})
    d = after.delta(before)
    assert d.out_segs == 0 and d.retrans_segs == 3
    assert d.get("New", "X") == 0  # absent before: no delta yet
    assert HostDelta().retrans_ratio is None


def test_delta_follows_real_loopback_traffic() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    acc, _ = srv.accept()
    with srv, cli, acc:
        cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        before = HostCounters.read()
        for _ in range(200):
            cli.sendall(b"x")
            acc.recv(16)  # one byte at a time: every send is its own segment
        after = HostCounters.read()
    d = after.delta(before)
    assert d.out_segs >= 200
