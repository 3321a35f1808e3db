"""The real daemons across a real (emulated) WAN: sender in namespace a, receiver in namespace
b, a veth between them, ``tc tbf`` for rate and ``iptables -m statistic`` for loss. The
kernel's own TCP sees real drops and does real retransmits; the monitor must see them."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from xdc.transport.launcher import DaemonProcess, local_pair_config

from xdc.lab.netlab import NetLab
from xdc.lab.transfer_load import Streamer

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.serial]
MIB = 1 << 20
LabPair = tuple[NetLab, str, str, list[DaemonProcess]]
"""The lab, the sender's and the receiver's engine sockets, and both daemon processes."""


@pytest.fixture
def lab_pair(netlab: NetLab) -> Iterator[LabPair]:
    wd = Path(tempfile.mkdtemp(prefix="xdc-wan-"))
    tx, rx, _ = local_pair_config(wd, connections=4, send_pool=128 * MIB, recv_pool=256 * MIB)
    rx.receiver.listen_host = netlab.addr_b
    tx.sender.peer_host = netlab.addr_b
    tx.monitor.sample_hz = 10
    procs: list[DaemonProcess] = []
    try:
        r = DaemonProcess("receiver", rx, wd, netns=netlab.ns_b)
        procs.append(r)
        r.wait_ready()
        t = DaemonProcess("sender", tx, wd, netns=netlab.ns_a)
        procs.append(t)
        t.wait_ready()
        yield netlab, tx.sender.control_socket, rx.receiver.control_socket, procs
    finally:
        for p in procs:
            p.stop()
        for p in procs:
            if p.proc.returncode not in (0, None):
                print(p.log())
        shutil.rmtree(wd, ignore_errors=True)


def _first(
    states: list[tuple[float, str, dict[str, Any]]],
    since: float,
    pred: Callable[[str, dict[str, Any]], bool],
) -> float | None:
    for t, state, link in states:
        if t >= since and pred(state, link):
            return t
    return None


def test_random_loss_seen_by_monitor_as_random_loss_and_requests_survive(lab_pair: LabPair) -> None:
    lab, tx_sock, rx_sock, _procs = lab_pair
    lab.set_rate(1.0)
    with Streamer(tx_sock, rx_sock, [MIB] * 8) as s:
        time.sleep(2.5)  # clean start
        t_loss = time.time()
        lab.set_loss(0.01)
        time.sleep(3.0)
        t_clear = time.time()
        lab.set_loss(None)
        time.sleep(4.0)
        stats = s.stop()
    assert stats.delivered >= 10 and not stats.failed and not stats.corrupt, stats.failed
    flagged = _first(stats.states, t_loss, lambda _st, link: link.get("cause") == "random_loss")
    assert flagged is not None, "monitor never reported the 1% loss"
    assert flagged - t_loss <= 1.0 + 0.2, f"loss reported {flagged - t_loss:.2f}s after it began"
    saw_retrans = _first(stats.states, t_loss, lambda _s, link: link.get("retrans_ratio", 0) > 0)
    assert saw_retrans is not None
    # random loss with no queue is not congestion: the link stays ok, the sender is not paced
    after = [(round(t - t_loss, 2), st, link) for t, st, link in stats.states if t >= t_loss]
    why = [
        (dt, st, link.get("cause"), link.get("queue_ms"), link.get("pacing_bps"))
        for dt, st, link in after
        if st != "ok" or link.get("pacing_bps")
    ]
    assert not why, why
    clear = _first(stats.states, t_clear, lambda _s, link: link.get("cause") == "clear")
    assert clear is not None and clear - t_clear <= 3.0, "loss report did not end with the loss"
    print(
        f"goodput {stats.bytes * 8 / 9.5 / 1e9:.2f} Gbit/s, loss reported after "
        f"{flagged - t_loss:.2f}s, cleared after {clear - t_clear:.2f}s"
    )


def test_rate_cut_mid_run_no_failures_capacity_tracked(lab_pair: LabPair) -> None:
    lab, tx_sock, rx_sock, _procs = lab_pair
    lab.set_rate(10.0)
    with Streamer(tx_sock, rx_sock, [2 * MIB] * 8, fill=False) as s:
        time.sleep(3.0)
        t_cut = time.time()
        lab.set_rate(1.0)
        time.sleep(4.0)
        stats = s.stop()
    assert not stats.failed and not stats.corrupt, stats.failed
    est = _first(
        stats.states,
        t_cut,
        lambda _s, link: (
            0.8e9 <= link.get("capacity_bps", 0) <= 1.2e9 and link.get("utilisation", 0) >= 0.8
        ),
    )
    assert est is not None, [s[2].get("capacity_bps") for s in stats.states[-10:]]
    assert est - t_cut <= 2.0, f"capacity estimate took {est - t_cut:.2f}s"


def test_clean_link_stays_ok(lab_pair: LabPair) -> None:
    lab, tx_sock, rx_sock, _procs = lab_pair
    lab.set_rate(1.0)
    with Streamer(tx_sock, rx_sock, [MIB] * 8, fill=False) as s:
        time.sleep(10.0)
        stats = s.stop()
    seen = {state for _t, state, _l in stats.states}
    assert not stats.failed
    assert seen <= {"ok", "None", "unknown"}, f"states on a clean link: {seen}"
    assert "ok" in seen
