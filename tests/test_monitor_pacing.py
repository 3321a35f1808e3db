"""AIMD decisions on scripted snapshots, and SO_MAX_PACING_RATE on real loopback sockets."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
from xdc.monitor.linkstate import LinkSnapshot
from xdc.monitor.pacing import (
    PacingController,
    apply_aggregate_pacing,
    apply_pacing,
    per_socket_rate,
)
from xdc.monitor.tcpinfo import read_tcp_info

from xdc.linkreport import LinkHealth

OK, WARN, CONG = LinkHealth.OK, LinkHealth.WARN, LinkHealth.CONGESTED
UNLIMITED = (1 << 64) - 1

BASE = LinkSnapshot(
    t=0.0,
    updated_at=0.0,
    interval_s=0.1,
    sockets=4,
    active_sockets=4,
    goodput_bps=800e6,
    delivery_rate_bps=800e6,
    capacity_bps=1e9,
    capacity_source="configured",
    utilisation=0.8,
    sent_bytes=0,
    acked_bytes=0,
    retrans_bytes=0,
    retrans_ratio=0.0,
    rtt_ms=1.0,
    min_rtt_ms=1.0,
    rttvar_ms=0.1,
    rtt_inflation=1.0,
    rwnd_limited_frac=0.0,
    sndbuf_limited_frac=0.0,
    lost_packets=0,
    rto_sockets=0,
    cwnd_packets=40,
    pacing_rate_bps=0.0,
    notsent_bytes=0,
    host_retrans_ratio=None,
    host_timeouts=0,
    sample_state=OK,
    state=OK,
)


def snap(t: float, state: LinkHealth, **kw: float) -> LinkSnapshot:
    return dataclasses.replace(BASE, t=t, state=state, **kw)  # type: ignore[arg-type]


def test_unlimited_until_congestion_then_decrease_from_goodput() -> None:
    c = PacingController(decrease_factor=0.5)
    assert c.update(snap(0.0, OK)) is None
    assert c.update(snap(0.1, WARN)) is None
    assert c.update(snap(0.2, CONG, goodput_bps=600e6)) == 300_000_000
    assert c.decreases == 1


def test_one_decrease_per_hold_period_while_congested() -> None:
    c = PacingController(decrease_factor=0.5, hold_s=1.0)
    rates = [c.update(snap(0.1 * i, CONG)) for i in range(25)]
    assert rates[0] == 400_000_000
    assert rates[9] == 400_000_000  # t=0.9: still holding
    assert rates[10] == 200_000_000  # t=1.0
    assert rates[20] == 100_000_000  # t=2.0
    assert c.decreases == 3


def test_loss_that_does_not_respond_to_a_cut_is_undone() -> None:
    """Random path loss: 1% whatever we send. The probing cut on entering does not reduce
    loss and no queue stands, so it is undone after hold_s and not repeated while quiet."""
    c = PacingController(decrease_factor=0.5, hold_s=1.0, quiet_s=10.0)
    rates = [
        c.update(snap(0.1 * i, CONG, sent_bytes=1_000_000, retrans_bytes=10_000)) for i in range(50)
    ]
    assert 400_000_000 in rates  # the probe cut happened
    assert rates[-1] is None  # ... and was reverted to unlimited
    assert c.decreases == 1 and c.reverts == 1


def test_queue_building_cuts_even_when_loss_was_found_random() -> None:
    """RTT inflation means our own flows are building a queue: cut regardless of quiet."""
    c = PacingController(decrease_factor=0.5, hold_s=1.0, quiet_s=10.0)
    for i in range(20):  # random loss, flat RTT: probe, revert, quiet
        c.update(snap(0.1 * i, CONG, sent_bytes=1_000_000, retrans_bytes=10_000))
    assert c.reverts == 1 and c.rate_bps is None
    rate = c.update(snap(2.5, CONG, sent_bytes=1_000_000, retrans_bytes=10_000, rtt_inflation=3.0))
    assert rate == 400_000_000 and c.decreases == 2


def test_loss_that_falls_after_a_cut_allows_the_next_cut() -> None:
    """Congestive loss: every cut halves the loss, so cutting continues while congested."""
    c = PacingController(decrease_factor=0.5, hold_s=1.0)
    rates = []
    for i in range(35):
        resent = 20_000 // 2**c.decreases  # 2% before any cut, halved by each cut
        rates.append(c.update(snap(0.1 * i, CONG, sent_bytes=1_000_000, retrans_bytes=resent)))
    assert c.decreases == 4 and c.skipped == 0
    assert rates[-1] == 50_000_000


def test_no_further_cut_once_loss_has_stopped() -> None:
    """The state machine stays congested for its clear period after loss ends: no new cut."""
    c = PacingController(decrease_factor=0.5, hold_s=1.0)
    c.update(snap(0.0, CONG, sent_bytes=1_000_000, retrans_bytes=20_000))
    rates = [c.update(snap(0.1 * i, CONG, sent_bytes=1_000_000)) for i in range(1, 25)]
    assert set(rates) == {400_000_000}
    assert c.decreases == 1 and c.skipped == 2


def test_floor_is_never_crossed() -> None:
    c = PacingController(decrease_factor=0.1, floor_bps=50_000_000, hold_s=0.0)
    for i in range(10):
        rate = c.update(snap(float(i), CONG))
    assert rate == 50_000_000


def test_warn_holds_and_ok_increases_additively_with_time() -> None:
    c = PacingController(
        decrease_factor=0.5, increase_fraction_per_s=0.1, min_increase_bps_per_s=0.0
    )
    assert c.update(snap(0.0, CONG)) == 400_000_000
    assert c.update(snap(0.5, WARN)) == 400_000_000
    # ok: +10% of the 1 Gbit/s capacity per second, i.e. +10 Mbit/s per 0.1 s sample
    assert c.update(snap(0.6, OK)) == 410_000_000
    assert c.update(snap(0.7, OK)) == 420_000_000
    # a long gap between snapshots is not a license for a big jump (dt capped at 1 s)
    assert c.update(snap(60.0, OK)) == 520_000_000


def test_released_when_back_at_capacity() -> None:
    c = PacingController(decrease_factor=0.5, increase_fraction_per_s=0.5)
    c.update(snap(0.0, CONG))  # 400 Mbit/s
    rates = [c.update(snap(0.1 * i, OK)) for i in range(1, 20)]
    assert rates[0] == 450_000_000
    assert None in rates
    first_none = rates.index(None)
    assert all(r is None for r in rates[first_none:])
    assert all(r is not None and r < 1e9 for r in rates[:first_none])


def test_re_entering_congested_decreases_immediately() -> None:
    c = PacingController(decrease_factor=0.5, hold_s=10.0)
    c.update(snap(0.0, CONG))
    assert c.update(snap(0.1, OK)) == 405_000_000  # +5% of capacity per s for 0.1 s
    assert c.update(snap(0.2, CONG)) == 202_500_000


def test_unknown_capacity_and_no_goodput_falls_back_to_floor() -> None:
    c = PacingController(floor_bps=10_000_000)
    rate = c.update(snap(0.0, CONG, goodput_bps=0.0, capacity_bps=0.0))
    assert rate == 10_000_000


def test_per_socket_split() -> None:
    assert per_socket_rate(None, 4) is None
    assert per_socket_rate(800_000_000, 4) == 25_000_000
    assert per_socket_rate(100, 3) == 5  # rounded up, never 0
    assert per_socket_rate(100, 0) is None


def test_controller_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        PacingController(decrease_factor=1.0)
    with pytest.raises(ValueError):
        PacingController(floor_bps=0)


# ---- real sockets ----------------------------------------------------------------------


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    acc, _ = srv.accept()
    return srv, cli, acc


def test_apply_pacing_sets_kernel_limit_and_unlimited() -> None:
    srv, cli, acc = _pair()
    with srv, cli, acc:
        assert apply_pacing(cli, 12_345_678)
        info = read_tcp_info(cli)
        assert info is not None and info.max_pacing_rate == 12_345_678
        assert apply_pacing(cli, None)
        info = read_tcp_info(cli)
        assert info is not None and info.max_pacing_rate == UNLIMITED
    assert not apply_pacing(cli, 1000)  # closed: reported, not raised


def test_pacing_limits_real_throughput() -> None:
    rate = 5_000_000  # bytes/s, ~1% of what loopback does unpaced
    srv, cli, acc = _pair()
    with srv, cli, acc:
        assert apply_pacing(cli, rate)
        stop = threading.Event()

        def send() -> None:
            buf = b"\0" * 65536
            try:
                while not stop.is_set():
                    cli.sendall(buf)
            except OSError:
                pass

        th = threading.Thread(target=send, daemon=True)
        th.start()
        acc.settimeout(2.0)
        t_end = time.monotonic() + 0.3  # let the first burst (initial window) pass
        while time.monotonic() < t_end:
            acc.recv(1 << 20)
        got, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 1.0:
            got += len(acc.recv(1 << 20))
        elapsed = time.monotonic() - t0
        stop.set()
        cli.shutdown(socket.SHUT_WR)
        th.join(timeout=5)
    measured = got / elapsed
    assert 0.75 * rate < measured < 1.25 * rate, measured


def test_aggregate_split_over_sockets() -> None:
    pairs = [_pair() for _ in range(4)]
    try:
        clis = [c for _, c, _ in pairs]
        assert apply_aggregate_pacing(clis, 100_000_000) == 4
        for c in clis:
            info = read_tcp_info(c)
            assert info is not None and info.max_pacing_rate == 3_125_000
        clis[0].close()
        assert apply_aggregate_pacing(clis, None) == 3
        info = read_tcp_info(clis[1])
        assert info is not None and info.max_pacing_rate == UNLIMITED
    finally:
        for trio_ in pairs:
            for s in trio_:
                s.close()
