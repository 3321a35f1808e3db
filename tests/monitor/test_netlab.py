"""The network-namespace lab on the real kernel: clean teardown, rate limit, loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest

from xdc.lab.netlab import BottleneckLab, NetLab, cleanup_stale, list_namespaces

if TYPE_CHECKING:
    from tests.netlab_fixtures import Blaster

pytestmark = pytest.mark.netns


def _host_state() -> tuple[list[str], str, str]:
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = sorted(line.split(":")[1].strip() for line in links.splitlines())
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    rules = "\n".join(ln for ln in rules.splitlines() if not ln.startswith("#"))
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    return names, rules, addrs


def test_lab_up_down_leaves_nothing_behind(netlab: NetLab) -> None:
    # ``netlab`` only proves the fixture works; this test drives its own labs.
    before = _host_state()
    lab = NetLab()
    with lab:
        assert {lab.ns_a, lab.ns_b} <= set(list_namespaces())
        assert lab.addr_a not in _host_state()[2]  # addresses live only in the lab
        lab.set_rate(1.0)
        lab.set_loss(0.05)
        assert "tbf" in lab.describe() and "DROP" in lab.describe()
        sleeper = lab.popen("b", ["sleep", "60"])
        # a process the lab did not start (daemonised): found via ``ip netns pids``
        res = lab.run("a", ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], check=True)
        orphan = int(res.stdout)
        assert _running(orphan)
    assert sleeper.poll() is not None
    assert not _running(orphan)
    assert not {lab.ns_a, lab.ns_b} & set(list_namespaces())
    assert _host_state() == before
    lab.close()  # idempotent

    # and when the body raises
    with pytest.raises(RuntimeError), NetLab() as lab2:
        lab2.set_loss(0.5, chain="OUTPUT")
        raise RuntimeError("test body failed")
    assert not {lab2.ns_a, lab2.ns_b} & set(list_namespaces())
    assert _host_state() == before


def test_bottleneck_lab_forwards_through_m_and_leaves_nothing_behind(
    bottleneck_lab: BottleneckLab,
) -> None:
    # ``bottleneck_lab`` only proves the lab can run here; this test drives its own.
    before = _host_state()
    with pytest.raises(RuntimeError), BottleneckLab() as lab:
        assert {lab.ns_a, lab.ns_m, lab.ns_b} <= set(list_namespaces())
        # a reaches b only through m (no direct link, no default route anywhere)
        route = lab.run("a", ["ip", "route", "get", lab.addr_b], check=True).stdout
        assert f"via {lab.addr_ma}" in route, route
        ok = lab.run("a", [sys.executable, "-c", PROBE_CONNECT, lab.addr_b])
        assert ok.returncode == 1  # refused by b itself: the SYN got through m and back
        lab.set_bottleneck(0.5, queue_ms=50)
        lab.enable_ecn()
        lab.set_ce_marking(0.5)
        text = lab.describe()
        assert "tbf 1: dev xdc-veth-mb" in text, text
        mangle = lab.run("m", ["iptables", "-t", "mangle", "-S"], check=True).stdout
        assert mangle.count("TOS set 0x03/0x03") + mangle.count("--set-tos 0x03/0x03") == 2
        lab.set_ce_marking(None)
        mangle = lab.run("m", ["iptables", "-t", "mangle", "-S"], check=True).stdout
        assert "0x03/0x03" not in mangle
        with pytest.raises(ValueError, match="queue"):
            lab.set_bottleneck(1.0, queue_ms=0)
        raise RuntimeError("test body failed")
    assert not {lab.ns_a, lab.ns_m, lab.ns_b} & set(list_namespaces())
    assert _host_state() == before


PROBE_CONNECT = (
    "import socket,sys\n"
    "try:\n"
    "  socket.create_connection((sys.argv[1], 9), timeout=3)\n"
    "except ConnectionRefusedError:\n"
    "  sys.exit(1)\n"
    "except OSError:\n"
    "  sys.exit(2)\n"
)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan may wait a moment for its reaper)."""
    deadline = time.monotonic() + 2.0
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state != "Z" or time.monotonic() > deadline:
            return state != "Z"
        time.sleep(0.02)


def test_cleanup_stale_removes_only_dead_creators(netlab: NetLab) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"xdc-a-{dead.pid}-999"
    live = f"xdc-b-{os.getpid()}-998"  # our own pid: must survive
    for ns in (stale, live):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        removed = cleanup_stale()
        assert stale in removed and live not in removed
        names = list_namespaces()
        assert stale not in names and live in names
        assert netlab.ns_a in names  # the running lab is untouched
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_namespaces_are_connected_only_to_each_other(netlab: NetLab) -> None:
    routes = netlab.run("a", ["ip", "route", "show"]).stdout
    assert "default" not in routes
    assert routes.strip().startswith(netlab.addr_a.rsplit(".", 1)[0])
    # TEST-NET-1 (RFC 5737): no route, so connect fails locally and no packet is sent
    out = netlab.run(
        "a",
        [sys.executable, "-c", "import socket; socket.create_connection(('192.0.2.1', 80), 1)"],
    )
    assert out.returncode != 0 and "unreachable" in out.stderr.lower()


@pytest.mark.slow
def test_set_rate_1gbit_measured_with_iperf3(netlab: NetLab, iperf3: str) -> None:
    netlab.set_rate(1.0)
    netlab.popen("b", [iperf3, "-s", "-1", "-B", netlab.addr_b], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while True:
        res = netlab.run("a", [iperf3, "-c", netlab.addr_b, "-t", "3", "-J"])
        report: dict[str, Any] = (
            json.loads(res.stdout) if res.stdout.strip() else {"error": res.stderr}
        )
        if (res.returncode == 0 and "error" not in report) or time.monotonic() > deadline:
            break
        time.sleep(0.1)  # the server was not listening yet
    assert "error" not in report, report["error"]
    gbit = report["end"]["sum_received"]["bits_per_second"] / 1e9
    assert 0.85 <= gbit <= 1.15, gbit
    netlab.set_rate(None)
    assert "tbf" not in netlab.describe()


def _retrans(blaster: Blaster, lab: NetLab, port: int) -> tuple[int, int]:
    sent = resent = 0
    with blaster(lab, 1.5, port) as out:
        for line in out:
            link = json.loads(line)["link"]
            sent += link["sent_bytes"]
            resent += link["retrans_bytes"]
    return sent, resent


@pytest.mark.slow
def test_set_loss_shows_retransmits_in_tcp_info(netlab: NetLab, blaster: Blaster) -> None:
    netlab.set_rate(1.0)
    sent, resent = _retrans(blaster, netlab, 5401)
    assert sent > 50_000_000 and resent / sent < 0.001  # clean: (almost) nothing resent
    netlab.set_loss(0.01)
    sent, resent = _retrans(blaster, netlab, 5402)
    assert 0.003 < resent / sent < 0.05, (sent, resent)
    netlab.set_loss(None)
    assert "DROP" not in netlab.describe()


def _rx_bytes_per_packet(lab: NetLab, blaster: Blaster, port: int) -> float:
    def counters() -> tuple[int, int]:
        out = lab.run("b", ["ip", "-s", "-j", "link", "show", "dev", lab.dev_b]).stdout
        rx = json.loads(out)[0]["stats64"]["rx"]
        return int(rx["bytes"]), int(rx["packets"])

    b0, p0 = counters()
    with blaster(lab, 1.0, port) as out:
        for _ in out:
            pass
    b1, p1 = counters()
    assert b1 - b0 > 10_000_000, (b0, b1)
    print(f"{(b1 - b0) / (p1 - p0):.0f} bytes per packet")
    return (b1 - b0) / (p1 - p0)


def _gso_max_segs(lab: NetLab) -> int:
    out = lab.run("a", ["ip", "-d", "-j", "link", "show", "dev", lab.dev_a]).stdout
    return int(json.loads(out)[0]["gso_max_segs"])


@pytest.mark.slow
def test_wire_sized_packets_make_each_packet_one_segment_and_undo_restores_gso(
    netlab: NetLab, blaster: Blaster
) -> None:
    netlab.set_rate(1.0)
    assert _rx_bytes_per_packet(netlab, blaster, 5403) > 3000  # GSO super-packets
    netlab.set_wire_sized_packets()
    assert _gso_max_segs(netlab) == 1
    assert _rx_bytes_per_packet(netlab, blaster, 5404) < 1600  # one MTU frame each
    netlab.set_wire_sized_packets(False)
    assert _gso_max_segs(netlab) == 65535


def test_shaped_links_shapes_one_lab_per_rate_and_tears_it_down_even_on_break(
    netlab: NetLab,
) -> None:
    from xdc.lab.netlab import shaped_links

    assert list(shaped_links([])) == []
    seen: list[tuple[float, str, str]] = []
    for rate, lab in shaped_links([1.0, 2.5]):
        seen.append((rate, lab.ns_a, lab.describe()))
    assert [r for r, _, _ in seen] == [1.0, 2.5]
    assert seen[0][1] == seen[1][1]  # the same lab, reshaped
    assert "1Gbit" in seen[0][2] and "2500Mbit" in seen[1][2], seen
    assert seen[0][1] not in list_namespaces()
    links = shaped_links([1.0, 2.0])
    for _, lab in links:
        ns = lab.ns_a
        break
    links.close()  # what a for loop left by break or by an exception does to it
    assert ns not in list_namespaces()
