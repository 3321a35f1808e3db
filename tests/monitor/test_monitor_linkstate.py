"""The pure link-state core: hysteresis rules and the estimator's arithmetic on scripted
tcp_info streams (cumulative counters, the way the kernel reports them)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.monitor.link_estimator import (
    LinkEstimator,
    LinkSnapshot,
    LinkStateMachine,
    Sample,
)
from xdc.monitor.procnet import HostCounters
from xdc.monitor.tcpinfo import TCP_CA_LOSS, TcpInfo

from xdc.config import MonitorConfig
from xdc.linkreport import LinkCause, LinkHealth, LinkId

OK, WARN, CONG = LinkHealth.OK, LinkHealth.WARN, LinkHealth.CONGESTED


# ---- state machine ---------------------------------------------------------------------


def feed(
    m: LinkStateMachine, levels: list[LinkHealth], t0: float = 0.0, dt: float = 0.1
) -> list[LinkHealth]:
    return [m.update(lv, t0 + i * dt) for i, lv in enumerate(levels)]


def test_single_noisy_sample_does_not_flip() -> None:
    m = LinkStateMachine(enter_m=3, enter_n=5, clear_s=2.0)
    out = feed(m, [OK, CONG, OK, OK, OK, WARN, OK, OK, CONG, OK])
    assert set(out) == {OK}
    assert m.transitions == 0


def test_m_of_n_enters_highest_level_reached() -> None:
    m = LinkStateMachine(enter_m=3, enter_n=5, clear_s=2.0)
    assert feed(m, [CONG, OK, CONG]) == [OK, OK, OK]
    assert m.update(CONG, 0.3) is CONG  # 3 of the last 4 (<= 5)
    m2 = LinkStateMachine(enter_m=3, enter_n=5, clear_s=2.0)
    assert feed(m2, [WARN, CONG, OK, WARN])[-1] is WARN  # 3 >= warn, only 1 congested


def test_m_of_n_window_forgets_old_samples() -> None:
    m = LinkStateMachine(enter_m=3, enter_n=5, clear_s=2.0)
    # bad samples 5 apart never have 3 inside one window of 5
    out = feed(m, [CONG, OK, OK, CONG, OK, OK, CONG, OK, OK, CONG])
    assert set(out) == {OK}


def test_warn_escalates_to_congested() -> None:
    m = LinkStateMachine(enter_m=2, enter_n=3, clear_s=1.0)
    out = feed(m, [WARN, WARN, CONG, CONG])
    assert out == [OK, WARN, WARN, CONG]


def test_leaves_only_after_sustained_clean_period() -> None:
    m = LinkStateMachine(enter_m=3, enter_n=5, clear_s=2.0)
    feed(m, [CONG] * 3)
    assert m.state is CONG
    last_bad = 0.2
    # one bad sample in the middle of the clean stretch restarts the clock
    t = last_bad
    for i in range(1, 15):
        t = last_bad + i * 0.1
        assert m.update(OK, t) is CONG
    t += 0.1
    assert m.update(CONG, t) is CONG
    last_bad = t
    states = [(m.update(OK, last_bad + i * 0.1), last_bad + i * 0.1) for i in range(1, 25)]
    first_ok = next(tt for s, tt in states if s is OK)
    assert first_ok - last_bad == pytest.approx(2.0)


def test_congested_steps_down_through_warn_when_warn_persists() -> None:
    m = LinkStateMachine(enter_m=3, enter_n=5, clear_s=1.0)
    feed(m, [CONG] * 3)
    out = feed(m, [WARN] * 12, t0=0.3)
    # congested until 1 s after the last congested sample (t=0.2), then warn persists
    assert out[:8] == [CONG] * 8
    assert set(out[9:]) == {WARN}
    out2 = feed(m, [OK] * 12, t0=1.5)
    assert out2[-1] is OK


def test_reentry_needs_fresh_evidence() -> None:
    m = LinkStateMachine(enter_m=3, enter_n=5, clear_s=0.5)
    feed(m, [CONG] * 3)
    out = feed(m, [OK] * 6, t0=0.3)
    assert out[-1] is OK
    # one new bad sample must not combine with the pre-recovery ones
    assert m.update(CONG, 1.0) is OK
    assert m.update(CONG, 1.1) is OK
    assert m.update(CONG, 1.2) is CONG


def test_state_machine_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        LinkStateMachine(enter_m=4, enter_n=3)
    with pytest.raises(ValueError):
        LinkStateMachine(enter_m=0, enter_n=3)
    with pytest.raises(ValueError):
        LinkStateMachine(clear_s=-1)


# ---- estimator -------------------------------------------------------------------------


@dataclass
class Flow:
    """Cumulative kernel counters of one socket, advanced by scripted intervals."""

    sent: int = 0
    acked: int = 1  # the SYN
    retrans: int = 0
    busy: int = 0
    rwnd: int = 0
    sndbuf: int = 0
    rtt: int = 20_000
    min_rtt: int = 20_000
    delivery: int = 0
    ca_state: int = 0
    total_retrans: int = 0
    mss: int = 1448
    delivered: int = 0
    delivered_ce: int = 0
    ce_frac: float = 0.0

    def step(
        self, dt: float, rate_Bps: float, retrans_frac: float = 0.0, rwnd_frac: float = 0.0
    ) -> None:
        new = int(rate_Bps * dt)
        re = int(new * retrans_frac)
        self.sent += new + re
        self.retrans += re
        self.total_retrans += re // self.mss
        self.acked += new
        self.busy += int(dt * 1e6)
        self.rwnd += int(dt * 1e6 * rwnd_frac)
        self.delivery = int(rate_Bps)
        pkts = new // self.mss
        self.delivered += pkts
        self.delivered_ce += int(pkts * self.ce_frac)

    def info(self) -> TcpInfo:
        return TcpInfo(
            280,
            state=1,
            ca_state=self.ca_state,
            snd_mss=self.mss,
            rtt=self.rtt,
            rttvar=self.rtt // 10,
            min_rtt=self.min_rtt,
            snd_cwnd=100,
            total_retrans=self.total_retrans,
            pacing_rate=2 * self.delivery,
            bytes_acked=self.acked,
            notsent_bytes=1000,
            delivery_rate=self.delivery,
            busy_time=self.busy,
            rwnd_limited=self.rwnd,
            sndbuf_limited=self.sndbuf,
            bytes_sent=self.sent,
            bytes_retrans=self.retrans,
            lost=0,
            delivered=self.delivered,
            delivered_ce=self.delivered_ce,
        )


def cfg(**kw: float) -> MonitorConfig:
    return MonitorConfig(**kw)  # type: ignore[arg-type]


def run(
    est: LinkEstimator,
    flows: list[Flow],
    steps: int,
    *,
    t0: float = 0.0,
    dt: float = 0.1,
    rate_Bps: float = 10e6,
    retrans_frac: float = 0.0,
) -> list[LinkSnapshot]:
    snaps = []
    for i in range(steps):
        t = t0 + i * dt
        if i or t0:
            for f in flows:
                f.step(dt, rate_Bps, retrans_frac)
        snaps.append(
            est.update(
                Sample(t, [f.info() for f in flows], keys=list(range(len(flows))), wall=1000 + t)
            )
        )
    return snaps


def test_goodput_retrans_and_rates_from_counter_deltas() -> None:
    est = LinkEstimator(cfg(link_capacity_bps=400e6))
    flows = [Flow(), Flow()]
    est.update(Sample(0.0, [f.info() for f in flows]))
    for f in flows:
        f.step(0.1, 12.5e6, retrans_frac=0.005)  # 100 Mbit/s each
    s = est.update(Sample(0.1, [f.info() for f in flows], wall=5.0))
    assert s.interval_s == pytest.approx(0.1)
    assert s.goodput_bps == pytest.approx(200e6, rel=1e-6)
    assert s.delivery_rate_bps == pytest.approx(200e6)
    assert s.capacity_bps == 400e6 and s.capacity_source == "configured"
    assert s.utilisation == pytest.approx(0.5, rel=1e-6)
    assert s.retrans_ratio == pytest.approx(0.005 / 1.005, rel=1e-3)
    assert s.sent_bytes == sum(f.sent for f in flows)
    assert (s.sockets, s.active_sockets) == (2, 2)
    assert s.rtt_ms == pytest.approx(20.0) and s.min_rtt_ms == pytest.approx(20.0)
    assert s.rtt_inflation == pytest.approx(1.0)
    assert s.updated_at == 5.0
    # 0.5% >= retrans_warn 0.2%, but the RTT sits at its floor: loss without a queue
    assert s.sample_state is OK and s.cause is LinkCause.RANDOM_LOSS
    assert s.queue_ms == pytest.approx(0.0)


def test_first_sample_is_a_baseline() -> None:
    est = LinkEstimator(cfg())
    f = Flow(sent=10**9, acked=10**9, retrans=10**8)
    s = est.update(Sample(0.0, [f.info()]))
    assert s.goodput_bps == 0 and s.retrans_ratio == 0 and s.interval_s == 0
    assert s.state is OK


def test_loss_with_a_queue_enters_congested_after_m_samples_and_clears_after_clean_period() -> None:
    est = LinkEstimator(cfg(), enter_m=3, enter_n=5, clear_s=2.0)
    flows = [Flow() for _ in range(4)]
    clean = run(est, flows, 10)
    for f in flows:
        f.rtt = 40_000  # 2x the floor: a queue (warn level), made congested by the loss
    lossy = run(est, flows, 10, t0=1.0, retrans_frac=0.03)
    for f in flows:
        f.rtt = f.min_rtt
    after = run(est, flows, 30, t0=2.0)
    assert {s.state for s in clean} == {OK}
    states = [s.state for s in lossy]
    assert states[:2] == [OK, OK] and states[2] is CONG
    assert {s.cause for s in lossy[2:]} == {LinkCause.QUEUE}
    assert lossy[-1].queue_ms == pytest.approx(20.0)
    rec = [s.state for s in after]
    first_ok = rec.index(OK)
    # the last lossy sample is at t=1.9: ok again clear_s (2.0 s) later, within one sample
    assert after[first_ok].t - lossy[-1].t == pytest.approx(2.0, abs=0.1)
    assert set(rec[first_ok:]) == {OK}
    assert after[-1].cause is LinkCause.CLEAR


def test_loss_without_a_queue_is_random_loss_and_never_congestion() -> None:
    est = LinkEstimator(cfg())
    flows = [Flow() for _ in range(4)]
    run(est, flows, 5)
    lossy = run(est, flows, 20, t0=1.0, retrans_frac=0.05)
    assert {s.state for s in lossy} == {OK}
    assert {s.cause for s in lossy[1:]} == {LinkCause.RANDOM_LOSS}
    assert lossy[-1].report(LinkId("a", "b"), "s").cause == "random_loss"
    clean = run(est, flows, 3, t0=3.0)
    assert clean[-1].cause is LinkCause.CLEAR


def test_a_queue_alone_is_congestion_and_the_cause_outlives_a_quiet_sample() -> None:
    est = LinkEstimator(cfg(), enter_m=3, enter_n=5, clear_s=2.0)
    flows = [Flow() for _ in range(2)]
    run(est, flows, 5)
    for f in flows:
        f.rtt = 100_000  # 5x the floor, no loss at all
    q = run(est, flows, 5, t0=1.0)
    assert q[-1].state is CONG and q[-1].cause is LinkCause.QUEUE
    for f in flows:
        f.rtt = f.min_rtt
    quiet = run(est, flows, 1, t0=1.5)[0]
    # hysteresis holds congested for clear_s: its cause is still the queue, not "clear"
    assert quiet.state is CONG and quiet.cause is LinkCause.QUEUE


def test_ecn_marks_are_congestion_without_loss_or_rtt() -> None:
    est = LinkEstimator(cfg(ecn_warn=0.001, ecn_congested=0.01))
    flows = [Flow() for _ in range(2)]
    run(est, flows, 5)
    for f in flows:
        f.ce_frac = 0.02
    snaps = run(est, flows, 5, t0=1.0)
    assert snaps[-1].ce_ratio == pytest.approx(0.02, rel=0.1)  # whole packets
    assert snaps[-1].state is CONG and snaps[-1].cause is LinkCause.ECN


def test_sockets_opening_and_closing_do_not_make_bogus_deltas() -> None:
    est = LinkEstimator(cfg())
    a, b = Flow(), Flow(sent=5 * 10**9, acked=5 * 10**9)
    est.update(Sample(0.0, [a.info()], keys=["a"]))
    a.step(0.1, 1e6)
    # b appears with a huge cumulative history: it must only become a baseline
    s = est.update(Sample(0.1, [a.info(), b.info()], keys=["a", "b"]))
    assert s.goodput_bps == pytest.approx(8e6, rel=1e-6)
    a.step(0.1, 1e6)
    b.step(0.1, 1e6)
    s = est.update(Sample(0.2, [a.info(), b.info()], keys=["a", "b"]))
    assert s.goodput_bps == pytest.approx(16e6, rel=1e-6)
    # a closes; b keeps going
    b.step(0.1, 1e6)
    s = est.update(Sample(0.3, [b.info()], keys=["b"]))
    assert s.goodput_bps == pytest.approx(8e6, rel=1e-6) and s.sockets == 1


def test_reused_key_with_smaller_counters_is_rebaselined() -> None:
    est = LinkEstimator(cfg())
    old = Flow(sent=10**8, acked=10**8)
    est.update(Sample(0.0, [old.info()], keys=[7]))
    new = Flow()  # fd 7 now names a fresh socket
    new.step(0.1, 1e6, retrans_frac=0.5)
    s = est.update(Sample(0.1, [new.info()], keys=[7]))
    assert s.sent_bytes == 0 and s.goodput_bps == 0 and s.retrans_ratio == 0


def test_measured_capacity_follows_recent_peak_rates() -> None:
    est = LinkEstimator(cfg(), capacity_window_s=1.0)
    f = Flow()
    est.update(Sample(0.0, [f.info()]))
    caps = []
    for i, rate in enumerate([50e6, 100e6, 60e6, 60e6, 60e6]):
        f.step(0.1, rate)
        caps.append(est.update(Sample(0.1 * (i + 1), [f.info()])).capacity_bps)
    assert caps == [400e6, 800e6, 800e6, 800e6, 800e6]
    t = 0.5
    for _ in range(11):  # the 100 MB/s sample (t=0.2) ages out of the 1 s window
        t += 0.1
        f.step(0.1, 60e6)
        s = est.update(Sample(t, [f.info()]))
    assert s.capacity_source == "measured"
    assert s.capacity_bps == pytest.approx(480e6)
    assert s.utilisation == pytest.approx(1.0, rel=1e-3)


def test_measured_capacity_ignores_a_rare_delivery_rate_spike() -> None:
    est = LinkEstimator(cfg(), capacity_window_s=10.0)
    f = Flow()
    est.update(Sample(0.0, [f.info()]))
    caps = []
    for i in range(1, 40):
        f.step(0.1, 60e6)
        info = f.info()
        if i == 20:  # one ACK-compressed sample: 30x the real rate
            info = dataclasses.replace(info, delivery_rate=int(1.8e9))
        caps.append(est.update(Sample(0.1 * i, [info])).capacity_bps)
    assert max(caps) == pytest.approx(480e6)


def _cut(flow_info: dict[str, int | None]) -> list[LinkSnapshot]:
    """10 MB/s for 5 s, then 1 MB/s for 3 s; tcp_info fields overridden by ``flow_info``."""
    est = LinkEstimator(cfg())
    f = Flow()
    est.update(Sample(0.0, [f.info()]))
    snaps = []
    for i in range(1, 81):
        f.step(0.1, 10e6 if i <= 50 else 1e6)
        info = dataclasses.replace(f.info(), **flow_info)  # type: ignore[arg-type]
        snaps.append(est.update(Sample(0.1 * i, [info])))
    return snaps


def test_capacity_follows_a_drop_within_a_second_when_backlogged() -> None:
    snaps = _cut({"notsent_bytes": 1 << 20, "max_pacing_rate": (1 << 64) - 1})
    assert snaps[49].capacity_bps == pytest.approx(80e6)
    after = [s for s in snaps if s.t > 5.0]
    tracked = next(s for s in after if s.capacity_bps == pytest.approx(8e6))
    assert tracked.t - 5.0 <= 1.05
    assert tracked.utilisation == pytest.approx(1.0)
    assert all(s.capacity_bps == pytest.approx(8e6) for s in after if s.t >= tracked.t)


def test_capacity_holds_when_the_drop_is_app_limited_or_self_paced() -> None:
    idle = _cut({"notsent_bytes": 0})  # the application had nothing more to send
    paced = _cut({"notsent_bytes": 1 << 20, "max_pacing_rate": 125_000})  # our own limit
    for snaps in (idle, paced):
        assert all(s.capacity_bps == pytest.approx(80e6) for s in snaps[50:])
        assert snaps[-1].utilisation == pytest.approx(0.1)


def test_capacity_unknown_without_traffic() -> None:
    est = LinkEstimator(cfg())
    f = Flow()
    est.update(Sample(0.0, [f.info()]))
    s = est.update(Sample(0.1, [f.info()]))
    assert s.capacity_bps == 0 and s.capacity_source == "unknown" and s.utilisation == 0
    assert s.active_sockets == 0 and s.rtt_ms is None and s.rtt_inflation is None


def test_rtt_inflation_is_floored_on_short_paths() -> None:
    c = cfg()
    # WAN path: 20 ms base, 70 ms srtt -> 3.5x, congested on RTT alone
    wan = LinkEstimator(c, rtt_floor_ms=10.0)
    f = Flow(rtt=70_000, min_rtt=20_000)
    run(wan, [f], 5)
    s = run(wan, [f], 1, t0=0.5)[0]
    assert s.rtt_inflation == pytest.approx(3.5)
    assert s.sample_state is CONG
    # veth-like path: 10 us base, 5 ms srtt -> 500x raw, 0.5x against the 10 ms floor
    lab = LinkEstimator(c, rtt_floor_ms=10.0)
    g = Flow(rtt=5_000, min_rtt=10)
    snaps = run(lab, [g], 6)
    assert snaps[-1].rtt_inflation == pytest.approx(0.5)
    assert {s.state for s in snaps} == {OK}


def test_rtt_weighted_by_acked_bytes() -> None:
    est = LinkEstimator(cfg())
    fast, slow = Flow(rtt=10_000), Flow(rtt=40_000)
    est.update(Sample(0.0, [fast.info(), slow.info()]))
    fast.step(0.1, 3e6)
    slow.step(0.1, 1e6)
    s = est.update(Sample(0.1, [fast.info(), slow.info()]))
    assert s.rtt_ms == pytest.approx((3 * 10 + 1 * 40) / 4, rel=1e-3)


def test_app_limited_delivery_samples_are_left_out() -> None:
    est = LinkEstimator(cfg())
    a, b = Flow(), Flow()
    est.update(Sample(0.0, [a.info(), b.info()]))
    a.step(0.1, 1e6)
    b.step(0.1, 1e6)
    limited = dataclasses.replace(b.info(), delivery_rate_app_limited=1, delivery_rate=10**9)
    s = est.update(Sample(0.1, [a.info(), limited]))
    assert s.delivery_rate_bps == pytest.approx(8e6)
    assert s.goodput_bps == pytest.approx(16e6, rel=1e-6)  # its data still counts


def test_rwnd_limited_share_of_busy_time() -> None:
    est = LinkEstimator(cfg())
    f = Flow()
    est.update(Sample(0.0, [f.info()]))
    f.step(0.1, 1e6, rwnd_frac=0.25)
    s = est.update(Sample(0.1, [f.info()]))
    assert s.rwnd_limited_frac == pytest.approx(0.25) and s.sndbuf_limited_frac == 0


def test_rto_recovery_is_congested_when_almost_nothing_gets_through() -> None:
    est = LinkEstimator(cfg())
    f = Flow()
    run(est, [f], 2)
    f.ca_state = TCP_CA_LOSS
    snaps = run(est, [f], 3, t0=1.0, rate_Bps=1000.0)
    assert all(s.sample_state is CONG for s in snaps)
    assert snaps[-1].state is CONG and snaps[-1].rto_sockets == 1
    assert snaps[-1].cause is LinkCause.STALL


def test_one_socket_in_rto_while_the_others_carry_on_is_not_a_stall() -> None:
    est = LinkEstimator(cfg())
    flows = [Flow() for _ in range(4)]
    run(est, flows, 2)
    flows[0].ca_state = TCP_CA_LOSS  # a tail drop ended in an RTO under random loss
    snaps = run(est, flows, 5, t0=1.0, retrans_frac=0.01)
    assert {s.state for s in snaps} == {OK}
    assert snaps[-1].cause is LinkCause.RANDOM_LOSS


def test_tiny_intervals_are_not_retransmit_evidence() -> None:
    est = LinkEstimator(cfg(), min_interval_bytes=64 * 1024)
    f = Flow()
    # 10 kB per interval with 10% resent: ratio reported but not acted on
    snaps = run(est, [f], 10, rate_Bps=100e3, retrans_frac=0.1)
    assert snaps[-1].retrans_ratio > 0.05
    assert {s.sample_state for s in snaps} == {OK}


def test_old_kernel_without_byte_counters_falls_back_to_segments() -> None:
    est = LinkEstimator(cfg())
    f = Flow()

    def old(info: TcpInfo) -> TcpInfo:  # a 4.9 kernel: struct ends at delivery_rate
        return dataclasses.replace(
            info,
            length=168,
            busy_time=None,
            rwnd_limited=None,
            sndbuf_limited=None,
            delivered=None,
            bytes_sent=None,
            bytes_retrans=None,
        )

    est.update(Sample(0.0, [old(f.info())]))
    f.step(0.1, 10e6, retrans_frac=0.02)
    s = est.update(Sample(0.1, [old(f.info())]))
    assert s.goodput_bps == pytest.approx(80e6, rel=1e-6)
    resent = (20_000 // 1448) * 1448  # whole segments x MSS: the old kernel's granularity
    assert s.retrans_bytes == resent
    assert s.retrans_ratio == pytest.approx(resent / (1_000_000 + resent))


def test_very_short_struct_gives_a_harmless_snapshot() -> None:
    est = LinkEstimator(cfg())
    est.update(Sample(0.0, [TcpInfo(8, state=1)]))
    s = est.update(Sample(0.1, [TcpInfo(8, state=1)]))
    assert s.goodput_bps == 0 and s.state is OK and s.rtt_ms is None


def test_host_counter_deltas() -> None:
    est = LinkEstimator(cfg())
    h0 = HostCounters({"Tcp": {"OutSegs": 1000, "RetransSegs": 5}, "TcpExt": {"TCPTimeouts": 1}})
    h1 = HostCounters({"Tcp": {"OutSegs": 3000, "RetransSegs": 25}, "TcpExt": {"TCPTimeouts": 3}})
    assert est.update(Sample(0.0, [], host=h0)).host_retrans_ratio is None
    s = est.update(Sample(0.1, [], host=h1))
    assert s.host_retrans_ratio == pytest.approx(0.01) and s.host_timeouts == 2


def test_to_json_has_router_keys_and_plain_types() -> None:
    est = LinkEstimator(cfg())
    f = Flow()
    s = run(est, [f], 3)[-1]
    j = s.to_json()
    for key in (
        "utilisation",
        "goodput_bps",
        "capacity_bps",
        "state",
        "retrans_ratio",
        "rtt_ms",
        "updated_at",
    ):
        assert key in j
    assert j["state"] == "ok" and j["sample_state"] == "ok"
    assert all(v is None or isinstance(v, int | float | str) for v in j.values())


def test_mismatched_keys_rejected() -> None:
    with pytest.raises(ValueError):
        LinkEstimator(cfg()).update(Sample(0.0, [TcpInfo(280)], keys=[1, 2]))


_counter = st.integers(min_value=0, max_value=2**40)
_info = st.builds(
    TcpInfo,
    length=st.sampled_from([8, 104, 168, 192, 216, 280]),
    ca_state=st.integers(0, 4),
    rtt=st.none() | st.integers(0, 10**7),
    min_rtt=st.none() | st.integers(0, 10**7),
    bytes_sent=st.none() | _counter,
    bytes_acked=st.none() | _counter,
    bytes_retrans=st.none() | _counter,
    busy_time=st.none() | _counter,
    rwnd_limited=st.none() | _counter,
    delivery_rate=st.none() | _counter,
    snd_mss=st.none() | st.integers(0, 65535),
    total_retrans=st.none() | st.integers(0, 2**32 - 1),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_info, max_size=4), min_size=1, max_size=8), st.floats(0.01, 1.0))
def test_arbitrary_streams_never_raise(samples: list[list[TcpInfo]], dt: float) -> None:
    est = LinkEstimator(cfg())
    for i, infos in enumerate(samples):
        s = est.update(Sample(i * dt, infos))
        assert s.goodput_bps >= 0 and s.retrans_ratio >= 0 and s.utilisation >= 0
        assert math.isfinite(s.goodput_bps)
        assert s.state in LinkHealth
