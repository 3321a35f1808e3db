"""Link state from periodic tcp_info samples: a pure estimator and a hysteresis state machine.

Everything here is arithmetic over explicit inputs (sample timestamps included), so the
behaviour that matters in production (how fast we flag loss, how long we wait before calling
the link clean again) is tested without sockets or clocks.

Signals per interval, summed over the peer's sockets:
- goodput from newly acked bytes; retransmit ratio = delta bytes_retrans / delta bytes_sent;
- RTT inflation = srtt / max(min_rtt, rtt_floor): on a short path (a LAN, a veth lab, same
  region VPC peering) min_rtt is microseconds and a millisecond of harmless queue would read
  as 100x inflation, so the base RTT is floored; on a real WAN (min_rtt >= the floor) it is
  the plain srtt / min_rtt ratio;
- receive-window / send-buffer limited share of the sockets' busy time;
- delivery rate: the kernel's latest per-socket estimate, summed over active sockets whose
  sample was not app-limited. Reported, but not used for capacity: on a short path a
  *paced* socket (SO_MAX_PACING_RATE at 40 Mbit/s) read ~10 Gbit/s, unflagged;
- capacity: configured, else a windowed high percentile of the goodput, which follows a
  drop within a second once the senders are backlogged below it;
- ECN: the share of delivered packets whose CE mark the receiver echoed (tcpi_delivered_ce
  over tcpi_delivered), when the bottleneck marks instead of dropping;
- sockets in RTO recovery (CA_Loss) while almost nothing is acked: a stalled link sends too
  little for a meaningful retransmit ratio.

Loss alone is not congestion. Random loss on a path (a flaky optic, a policer upstream, the
lab's iptables drops) does not fall when we send less, and answering it by pacing down cost
19% of goodput at 1% loss; the router shifting work away from such a link gains nothing.
What marks congestion is a queue: RTT over its floor, ECN marks, or loss that comes with a
rising RTT. ``classify`` says which (a ``LinkCause``), and loss without a queue is reported
as ``ok`` with cause ``random_loss``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from xdc.monitor.procnet import HostCounters
from xdc.monitor.tcpinfo import TCP_CA_LOSS, TcpInfo

from xdc.config import MonitorConfig
from xdc.linkreport import LinkCause, LinkHealth, LinkId, LinkReport

_BY_RANK = {h.rank: h for h in LinkHealth}


class LinkStateMachine:
    """ok / warn / congested with hysteresis.

    Going up needs ``enter_m`` of the last ``enter_n`` per-sample levels at or above the new
    state, so one noisy interval never flips it; going down needs ``clear_s`` seconds without
    any sample at the current level, so a link that is bad every other second stays flagged.
    """

    def __init__(self, enter_m: int = 3, enter_n: int = 5, clear_s: float = 2.0) -> None:
        if not 1 <= enter_m <= enter_n:
            raise ValueError(f"need 1 <= enter_m <= enter_n, got {enter_m}, {enter_n}")
        if clear_s < 0:
            raise ValueError(f"clear_s must be >= 0, got {clear_s}")
        self.enter_m = enter_m
        self.clear_s = clear_s
        self.state = LinkHealth.OK
        self.transitions = 0
        self._hist: deque[int] = deque(maxlen=enter_n)
        self._last_at: dict[int, float] = {}

    def update(self, level: LinkHealth, t: float) -> LinkHealth:
        """Feed one interval's level observed at time ``t``; return the (new) state."""
        r = level.rank
        self._hist.append(r)
        for k in range(1, r + 1):
            self._last_at[k] = t
        cur = self.state.rank
        new = cur
        for k in (2, 1):
            if k > cur and sum(1 for h in self._hist if h >= k) >= self.enter_m:
                new = k
                break
        if new == cur:
            while new > 0 and t - self._last_at.get(new, float("-inf")) >= self.clear_s:
                new -= 1
            if new < cur:
                # Old bad samples must not re-trigger the state we just left.
                self._hist.clear()
        if new != cur:
            self.state = _BY_RANK[new]
            self.transitions += 1
        return self.state


@dataclass(frozen=True)
class Sample:
    """One sampling instant for one peer.

    ``t`` is a monotonic time in seconds (rates are computed from its differences); ``wall``
    is the Unix time reported as ``updated_at`` (defaults to ``t``). ``keys`` identify sockets
    across samples (fd, id(); defaults to list position) so sockets that open or close
    between two samples never turn into bogus deltas.
    """

    t: float
    infos: Sequence[TcpInfo]
    keys: Sequence[Hashable] | None = None
    host: HostCounters | None = None
    wall: float | None = None


@dataclass(frozen=True)
class LinkSnapshot:
    """Derived link signals for one interval. Rates in bits/s, times in milliseconds."""

    t: float
    updated_at: float
    interval_s: float
    sockets: int
    active_sockets: int
    goodput_bps: float
    delivery_rate_bps: float
    capacity_bps: float
    capacity_source: str
    utilisation: float
    sent_bytes: int
    acked_bytes: int
    retrans_bytes: int
    retrans_ratio: float
    rtt_ms: float | None
    min_rtt_ms: float | None
    rttvar_ms: float | None
    rtt_inflation: float | None
    rwnd_limited_frac: float
    sndbuf_limited_frac: float
    lost_packets: int
    rto_sockets: int
    cwnd_packets: int
    pacing_rate_bps: float
    notsent_bytes: int
    host_retrans_ratio: float | None
    host_timeouts: int
    sample_state: LinkHealth
    state: LinkHealth
    cause: LinkCause = LinkCause.CLEAR
    queue_ms: float | None = None  # srtt over min_rtt: the delay the bottleneck queue adds
    ce_ratio: float | None = None  # share of delivered packets echoed CE (None: none)

    def report(self, link: LinkId, reporter: str) -> LinkReport:
        """What the router is told about this interval (``POST /v1/links``): this sender's
        share of ``link``, numbers clamped into the ranges the router accepts."""
        return LinkReport.clamped(
            link,
            reporter,
            utilisation=self.utilisation,
            goodput_bps=self.goodput_bps,
            capacity_bps=self.capacity_bps,
            state=self.state.value,
            retrans_ratio=self.retrans_ratio,
            rtt_ms=self.rtt_ms,
            updated_at=self.updated_at,
            cause=self.cause.value,
        )

    def to_json(self) -> dict[str, Any]:
        """Every derived signal in plain JSON types (the daemon's /status; the router gets
        the smaller ``report``)."""
        out = asdict(self)
        out["state"] = self.state.value
        out["sample_state"] = self.sample_state.value
        out["cause"] = self.cause.value
        return out


# tcpi_max_pacing_rate when SO_MAX_PACING_RATE was never set (~0UL; ~0U on old kernels)
_NO_PACING_LIMIT = frozenset({(1 << 64) - 1, (1 << 32) - 1})


def _delta(cur: int | None, prev: int | None) -> int | None:
    if cur is None or prev is None or cur < prev:
        return None
    return cur - prev


@dataclass
class _Sums:
    """Per-interval sums over a peer's sockets (deltas) and current totals (gauges)."""

    sent: int = 0
    acked: int = 0
    retrans: int = 0
    busy: int = 0
    rwnd: int = 0
    sndbuf: int = 0
    delivery: int = 0
    rtt_w: float = 0.0
    rttvar_w: float = 0.0
    weight: float = 0.0
    active: int = 0
    min_rtt: int = 0
    lost: int = 0
    cwnd: int = 0
    pacing: int = 0
    notsent: int = 0
    rto: int = 0
    delivered: int = 0
    delivered_ce: int = 0
    backlogged: bool = False  # active sockets had unsent data and no pacing limit of ours
    paced_backlog: bool = False  # active sockets had unsent data under a pacing limit of ours


class LinkEstimator:
    """Turns a stream of ``Sample``s for one peer into ``LinkSnapshot``s (pure, no I/O)."""

    def __init__(
        self,
        cfg: MonitorConfig,
        *,
        rtt_floor_ms: float = 10.0,
        min_interval_bytes: int = 64 * 1024,
        capacity_window_s: float = 10.0,
        capacity_quantile: float = 0.9,
        capacity_drop_s: float = 1.0,
        capacity_drop_ratio: float = 0.8,
        capacity_queue_ms: float = 2.0,
        enter_m: int = 3,
        enter_n: int = 5,
        clear_s: float = 2.0,
    ) -> None:
        self.cfg = cfg
        self.rtt_floor_us = rtt_floor_ms * 1000.0
        self.min_interval_bytes = min_interval_bytes
        self.capacity_window_s = capacity_window_s
        self.capacity_quantile = capacity_quantile
        self.capacity_drop_s = capacity_drop_s
        self.capacity_drop_ratio = capacity_drop_ratio
        self.capacity_queue_ms = capacity_queue_ms
        self.machine = LinkStateMachine(enter_m, enter_n, clear_s)
        self._prev: dict[Hashable, TcpInfo] = {}
        self._prev_t: float | None = None
        self._prev_host: HostCounters | None = None
        self._host_ratio: float | None = None
        self._cap_hist: deque[tuple[float, float, bool]] = deque()
        self._cause_at_state = LinkCause.CLEAR

    @property
    def state(self) -> LinkHealth:
        return self.machine.state

    def classify(
        self,
        retrans_ratio: float | None,
        inflation: float | None,
        rto_sockets: int,
        ce_ratio: float | None = None,
        stalled: bool = False,
    ) -> tuple[LinkHealth, LinkCause]:
        """Level and cause of one interval from its signals (``None`` = no evidence).

        A queue (RTT inflation) or ECN marks are congestion on their own; loss is congestion
        only when it comes with a queue (it promotes a warn-level queue to congested); loss
        without one is ``random_loss`` at level ok. RTO recovery counts only when the
        interval also acked almost nothing (``stalled``): with random loss an occasional
        tail drop ends in an RTO while the other sockets carry on.
        """
        c = self.cfg
        if rto_sockets > 0 and stalled:
            return LinkHealth.CONGESTED, LinkCause.STALL
        r = retrans_ratio if retrans_ratio is not None else 0.0
        x = inflation if inflation is not None else 0.0
        ce = ce_ratio if ce_ratio is not None else 0.0
        if x >= c.rtt_inflation_congested:
            return LinkHealth.CONGESTED, LinkCause.QUEUE
        if ce >= c.ecn_congested:
            return LinkHealth.CONGESTED, LinkCause.ECN
        if x >= c.rtt_inflation_warn:
            level = LinkHealth.CONGESTED if r >= c.retrans_congested else LinkHealth.WARN
            return level, LinkCause.QUEUE
        if ce >= c.ecn_warn:
            return LinkHealth.WARN, LinkCause.ECN
        if r >= c.retrans_warn:
            return LinkHealth.OK, LinkCause.RANDOM_LOSS
        return LinkHealth.OK, LinkCause.CLEAR

    def _accumulate(
        self, keys: Sequence[Hashable], infos: Sequence[TcpInfo], with_deltas: bool
    ) -> _Sums:
        """One pass over the sockets (the sampler runs this 10x a second for 64 of them)."""
        s = _Sums()
        min_rtt = 0
        prevs = self._prev
        for key, cur in zip(keys, infos, strict=True):
            if cur.min_rtt and (not min_rtt or cur.min_rtt < min_rtt):
                min_rtt = cur.min_rtt
            s.lost += cur.lost or 0
            s.cwnd += cur.snd_cwnd or 0
            s.pacing += cur.pacing_rate or 0
            s.notsent += cur.notsent_bytes or 0
            if cur.ca_state == TCP_CA_LOSS:
                s.rto += 1
            prev = prevs.get(key) if with_deltas else None
            if prev is None:
                continue
            d_sent = _delta(cur.bytes_sent, prev.bytes_sent)
            d_acked = _delta(cur.bytes_acked, prev.bytes_acked)
            d_retrans = _delta(cur.bytes_retrans, prev.bytes_retrans)
            if d_retrans is None and cur.snd_mss:
                # Kernels before 4.19 lack byte counters for retransmits; segments x MSS.
                d_segs = _delta(cur.total_retrans, prev.total_retrans)
                d_retrans = None if d_segs is None else d_segs * cur.snd_mss
            if d_sent is None and d_acked is not None:
                d_sent = d_acked + (d_retrans or 0)
            if d_acked is None and d_sent is not None:
                d_acked = max(0, d_sent - (d_retrans or 0))
            if d_sent is None:
                continue  # counters went backwards: the key now names another socket
            s.sent += d_sent
            s.acked += d_acked or 0
            s.retrans += d_retrans or 0
            s.busy += _delta(cur.busy_time, prev.busy_time) or 0
            s.rwnd += _delta(cur.rwnd_limited, prev.rwnd_limited) or 0
            s.sndbuf += _delta(cur.sndbuf_limited, prev.sndbuf_limited) or 0
            s.delivered += _delta(cur.delivered, prev.delivered) or 0
            s.delivered_ce += _delta(cur.delivered_ce, prev.delivered_ce) or 0
            if d_sent > 0:
                s.active += 1
                paced = cur.max_pacing_rate not in _NO_PACING_LIMIT
                if cur.notsent_bytes and (cur.max_pacing_rate is None or not paced):
                    s.backlogged = True
                elif cur.notsent_bytes:
                    s.paced_backlog = True
                if not cur.delivery_rate_app_limited:
                    s.delivery += cur.delivery_rate or 0
                if cur.rtt:
                    w = float(max(d_acked or 0, 1))
                    s.rtt_w += cur.rtt * w
                    s.rttvar_w += (cur.rttvar or 0) * w
                    s.weight += w
        s.min_rtt = min_rtt
        return s

    def _capacity(self, t: float, measured: float, backlogged: bool) -> tuple[float, str]:
        """Configured capacity, else a high percentile of recent per-interval goodput.

        Not a plain max filter: a single interval can read high (ACKs for two intervals'
        data landing in one), and a max would hold it for the whole window. The
        nearest-rank ``capacity_quantile`` is the max for a handful of samples and drops
        the top 10% once the window is full (100 samples at 10 Hz).

        A drop is followed within ``capacity_drop_s``: if for that long every interval was
        *backlogged* (the sockets had unsent data and no pacing limit of ours, or a pacing
        limit while a queue of at least ``capacity_queue_ms`` stood at the bottleneck, so
        the path, not the application or our pacing, set the pace) and delivered less than
        ``capacity_drop_ratio`` x the estimate, the older history is discarded. Goodput
        from app-limited or self-paced intervals without a queue never lowers the estimate
        that way, so while we pace below the capacity the estimate only sinks as the window
        ages out.
        """
        if self.cfg.link_capacity_bps > 0:
            return float(self.cfg.link_capacity_bps), "configured"
        hist = self._cap_hist
        if measured > 0:
            hist.append((t, measured, backlogged))
        while hist and hist[0][0] < t - self.capacity_window_s:
            hist.popleft()
        if not hist:
            return 0.0, "unknown"
        est = self._quantile(hist)
        since = t - self.capacity_drop_s
        if hist[0][0] <= since:
            recent = [(v, b) for ts, v, b in hist if ts > since]
            limit = self.capacity_drop_ratio * est
            if len(recent) >= 3 and all(b and v < limit for v, b in recent):
                while hist[0][0] <= since:
                    hist.popleft()
                est = self._quantile(hist)
        return est, "measured"

    def _quantile(self, hist: deque[tuple[float, float, bool]]) -> float:
        values = sorted(v for _, v, _ in hist)
        return values[max(math.ceil(self.capacity_quantile * len(values)), 1) - 1]

    def update(self, sample: Sample) -> LinkSnapshot:
        infos = list(sample.infos)
        keys: list[Hashable] = (
            list(sample.keys) if sample.keys is not None else list(range(len(infos)))
        )
        if len(keys) != len(infos):
            raise ValueError(f"sample has {len(keys)} keys for {len(infos)} tcp_infos")
        t = sample.t
        dt = 0.0 if self._prev_t is None else t - self._prev_t
        s = self._accumulate(keys, infos, with_deltas=dt > 0)

        goodput = s.acked * 8 / dt if dt > 0 else 0.0
        delivery = s.delivery * 8.0
        min_rtt_us = float(s.min_rtt) if s.min_rtt else None
        rtt_us = s.rtt_w / s.weight if s.weight > 0 else None
        queue_ms = None
        if rtt_us is not None and min_rtt_us is not None:
            queue_ms = max(0.0, rtt_us - min_rtt_us) / 1000.0
        path_paced = s.backlogged or (
            s.paced_backlog and queue_ms is not None and queue_ms >= self.capacity_queue_ms
        )
        capacity, source = self._capacity(t, goodput if s.active else 0.0, path_paced)
        rttvar_us = s.rttvar_w / s.weight if s.weight > 0 else None
        inflation = None
        if rtt_us is not None and min_rtt_us is not None:
            inflation = rtt_us / max(min_rtt_us, self.rtt_floor_us)
        ratio = s.retrans / s.sent if s.sent > 0 else 0.0
        rto = s.rto

        # The sampler may read host counters less often than sockets: the ratio of the last
        # two reads is carried forward, timeouts are counted once, on the read that saw them.
        host_timeouts = 0
        if sample.host is not None and self._prev_host is not None:
            hd = sample.host.delta(self._prev_host)
            self._host_ratio, host_timeouts = hd.retrans_ratio, hd.timeouts

        ce_ratio = s.delivered_ce / s.delivered if s.delivered > 0 else None
        if dt > 0:
            evidence = ratio if s.sent >= self.min_interval_bytes else None
            stalled = s.acked < self.min_interval_bytes
            level, cause = self.classify(evidence, inflation, rto, ce_ratio, stalled)
            state = self.machine.update(level, t)
            if level.rank >= state.rank:
                self._cause_at_state = cause
            # below the state (hysteresis holds it): the cause that last reached it stands
            cause = self._cause_at_state if state is not LinkHealth.OK else cause
        else:
            level, state, cause = LinkHealth.OK, self.machine.state, LinkCause.CLEAR

        self._prev = dict(zip(keys, infos, strict=True))
        self._prev_t = t
        if sample.host is not None:
            self._prev_host = sample.host

        ms = 1000.0
        return LinkSnapshot(
            t=t,
            updated_at=sample.wall if sample.wall is not None else t,
            interval_s=dt,
            sockets=len(infos),
            active_sockets=s.active,
            goodput_bps=goodput,
            delivery_rate_bps=delivery,
            capacity_bps=capacity,
            capacity_source=source,
            utilisation=goodput / capacity if capacity > 0 else 0.0,
            sent_bytes=s.sent,
            acked_bytes=s.acked,
            retrans_bytes=s.retrans,
            retrans_ratio=ratio,
            rtt_ms=None if rtt_us is None else rtt_us / ms,
            min_rtt_ms=None if min_rtt_us is None else min_rtt_us / ms,
            rttvar_ms=None if rttvar_us is None else rttvar_us / ms,
            rtt_inflation=inflation,
            queue_ms=queue_ms,
            ce_ratio=ce_ratio,
            rwnd_limited_frac=s.rwnd / s.busy if s.busy > 0 else 0.0,
            sndbuf_limited_frac=s.sndbuf / s.busy if s.busy > 0 else 0.0,
            lost_packets=s.lost,
            rto_sockets=rto,
            cwnd_packets=s.cwnd,
            pacing_rate_bps=s.pacing * 8.0,
            notsent_bytes=s.notsent,
            host_retrans_ratio=self._host_ratio,
            host_timeouts=host_timeouts,
            sample_state=level,
            state=state,
            cause=cause,
        )
