"""Pacing a peer's connections so that *we* do not build the bottleneck queue.

N parallel loss-based TCP flows fill a deep bottleneck buffer until it overflows: every
other flow through it (a latency-sensitive RPC, another tenant) waits behind a queue of
100 ms or more, and the sender's own chunks too. Capping the *sum* of the flows' rates just
under the bottleneck rate keeps the queue short at almost no cost in goodput. The
controller is a pure function of the link snapshots; ``apply_pacing`` is the only I/O
(SO_MAX_PACING_RATE, which the kernel enforces per socket with TCP internal pacing even
without the fq qdisc).

It acts on the queue, never on loss alone: random loss on the path does not fall when we
send less (the earlier loss-driven AIMD cost 19% of goodput at 1% random loss), and TCP
already answers loss per flow.
"""

from __future__ import annotations

import math
import socket
import struct
from collections.abc import Iterable
from typing import Protocol

from xdc.monitor.link_estimator import LinkSnapshot

from xdc.linkreport import LinkHealth

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
_UNLIMITED = (1 << 64) - 1  # ~0UL: the kernel's "no limit"


class PacingController:
    """Queue-delay target over the aggregate rate.

    Each snapshot carries ``queue_ms``, the smoothed RTT over its minimum: the delay the
    bottleneck queue adds. When it reaches ``queue_high_ms`` (or the link is congested by
    ECN marks or a stall), the rate is set from what the link delivered in that interval
    (the bottleneck rate, while a queue stands) times ``1 - queue_ms / drain_s``: a rate
    that drains the queue within about ``drain_s``, never below ``max_cut`` of it. The
    next cut waits ``settle_s`` for the RTT to show the last one. Below
    ``queue_target_ms`` the rate climbs by ``probe_fraction_per_s`` of the capacity per
    second, so it finds capacity that frees up; at 1.1 x the capacity estimate with no
    queue the limit is released (``None``). In between it holds. The climb doubles every
    ``probe_double_s`` the queue stays below target (at most ``max_probe_multiplier`` x):
    a cut from a lean sample (one 100 ms interval of a host that is slow to send reads as
    a slow link) cost seconds at 2% a second. CI saw a 4-connection transfer into a 1
    Gbit/s bottleneck held at 0.74 Gbit/s, its queue empty, for the whole 4 s measured;
    doubling every 0.5 s, a 25% undercut is climbed back in about 2 s, and a cut from a
    true reading costs one sawtooth (climb past the bottleneck, queue to ``queue_high_ms``,
    cut) every few seconds: measured in the deep-buffer lab, a probe beside the transfer
    waited 2.1 / 17.7 ms more (median / p90) where it waited -0.05 / 12.7 before, at the
    same goodput (bench/README).

    An episode begins only after ``confirm`` snapshots in a row saw the queue at
    ``queue_high_ms`` or above (ECN marks and stalls act at once: the network said so); the
    first cut starts from the most any of those snapshots delivered, not only the last.
    ``srtt`` is a smoothed average, but a host that does not run the stack for a few
    milliseconds (a 2-core machine under load) raises it for one sample with no packet
    queued anywhere: CI saw one 15.4 ms sample at 1 Gbit/s with 1% random loss on a tbf
    whose backlog TCP small queues keep near 1 ms, and its cut held the sender below the
    link for seconds. A real queue stands for more than one 100 ms sample.

    A queue under ``queue_high_ms`` is left alone: a shallow buffer cannot make anyone
    wait long, and pacing has a price when loss keeps some sockets in recovery (each socket
    gets an equal share of the limit and cannot use another's). Measured in the bottleneck
    lab, 1% random loss on a 10 ms buffer: triggering at 8 ms cost 12% of goodput (one
    repeat); at 15 ms nothing (0.946 vs 0.946 Gbit/s, medians of 3).

    A queue we are not building does not shrink when we slow down: a loss-based bulk flow
    of someone else's fills the buffer whatever we send. If ``yield_after_s`` after the
    cuts began the queue has not fallen below ``yield_ratio`` of its peak (a queue of ours
    drains in about ``drain_s``), the limit is released for ``quiet_s`` (counted in
    ``yields``): pacing down then would only hand our share to that flow. Measured with 4
    cubic flows filling a 100 ms buffer, xdc with the response on got 60% of what it got
    with the response off when yielding after 3 s (6 s transfers); after 1 s, 0.62-0.96
    per repeat (median 0.74 of 3; 0.96 in another run of 2): the cuts of the first second
    still cost, see bench/README.
    """

    def __init__(
        self,
        *,
        floor_bps: int = 10_000_000,
        queue_target_ms: float = 5.0,
        queue_high_ms: float = 15.0,
        drain_s: float = 0.5,
        max_cut: float = 0.5,
        settle_s: float = 0.3,
        probe_fraction_per_s: float = 0.02,
        min_probe_bps_per_s: float = 2_000_000.0,
        yield_after_s: float = 1.0,
        yield_ratio: float = 0.7,
        quiet_s: float = 10.0,
        confirm: int = 2,
        probe_double_s: float = 0.5,
        max_probe_multiplier: float = 16.0,
    ) -> None:
        if floor_bps < 1:
            raise ValueError(f"floor_bps must be >= 1, got {floor_bps}")
        if not 0 < queue_target_ms <= queue_high_ms:
            raise ValueError(
                f"need 0 < queue_target_ms <= queue_high_ms, got {queue_target_ms}, {queue_high_ms}"
            )
        if not 0 < max_cut < 1:
            raise ValueError(f"max_cut must be in (0, 1), got {max_cut}")
        if drain_s <= 0 or settle_s < 0 or probe_fraction_per_s < 0:
            raise ValueError("drain_s must be > 0, settle_s and probe_fraction_per_s >= 0")
        if confirm < 1:
            raise ValueError(f"confirm must be >= 1 snapshot, got {confirm}")
        if probe_double_s <= 0 or max_probe_multiplier < 1:
            raise ValueError(
                "need probe_double_s > 0 and max_probe_multiplier >= 1, got "
                f"{probe_double_s}, {max_probe_multiplier}"
            )
        self.floor_bps = floor_bps
        self.queue_target_ms = queue_target_ms
        self.queue_high_ms = queue_high_ms
        self.drain_s = drain_s
        self.max_cut = max_cut
        self.settle_s = settle_s
        self.probe_fraction_per_s = probe_fraction_per_s
        self.min_probe_bps_per_s = min_probe_bps_per_s
        self.yield_after_s = yield_after_s
        self.yield_ratio = yield_ratio
        self.quiet_s = quiet_s
        self.confirm = confirm
        self.probe_double_s = probe_double_s
        self.max_probe_multiplier = max_probe_multiplier
        self.rate_bps: int | None = None
        self.decreases = 0
        self.yields = 0  # episodes given up: the queue was not ours
        self._last_t: float | None = None
        self._last_cut_t = float("-inf")
        self._episode: tuple[float, float] | None = None  # (start, peak queue_ms so far)
        self._episode_goodput = 0.0  # the most the link delivered in an interval of it
        self._quiet_until = float("-inf")
        self._high_run = 0  # snapshots in a row with the queue at queue_high_ms or above
        self._high_goodput = 0.0  # the most the link delivered in a snapshot of that run
        self._clear_since: float | None = None  # first of the samples in a row below target
        self._unknown_since: float | None = None  # first of the samples in a row with no queue

    def update(self, snap: LinkSnapshot) -> int | None:
        """Rate in bits/s to apply to the peer's sockets in total; ``None`` = unlimited."""
        t = snap.t
        dt = 0.0 if self._last_t is None else min(max(t - self._last_t, 0.0), 1.0)
        self._last_t = t
        cap = snap.capacity_bps if snap.capacity_bps > 0 else None
        marked = snap.state is LinkHealth.CONGESTED and snap.cause.value in ("ecn", "stall")
        if snap.queue_ms is None and not marked:
            return self._unknown(t)
        self._unknown_since = None
        q = snap.queue_ms if snap.queue_ms is not None else 0.0
        if q >= self.queue_high_ms:
            self._high_run += 1
            self._high_goodput = max(self._high_goodput, snap.goodput_bps)
        else:
            self._high_run, self._high_goodput = 0, 0.0
        if q >= self.queue_target_ms:
            self._clear_since = None
        if t < self._quiet_until:
            return self.rate_bps
        confirmed = self._episode is not None or self._high_run >= self.confirm
        if (q >= self.queue_high_ms and confirmed) or marked:
            if self._episode is None:
                self._episode = (t, q)
                self._episode_goodput = self._high_goodput
            self._episode_goodput = max(self._episode_goodput, snap.goodput_bps)
            start, peak = self._episode
            peak = max(peak, q)
            self._episode = (start, peak)
            if t - start >= self.yield_after_s and not marked and q >= self.yield_ratio * peak:
                self.yields += 1
                self.rate_bps = None
                self._episode = None
                self._quiet_until = t + self.quiet_s
                return None
            if t - self._last_cut_t >= self.settle_s:
                self._cut(snap, q, cap)
                self._last_cut_t = t
        elif q < self.queue_target_ms:
            self._episode = None
            if self._clear_since is None:
                self._clear_since = t
            if self.rate_bps is not None:
                step = max(self.min_probe_bps_per_s, (cap or 0.0) * self.probe_fraction_per_s)
                clear_s = t - self._clear_since
                step *= min(self.max_probe_multiplier, 2.0 ** (clear_s / self.probe_double_s))
                rate = self.rate_bps + round(step * dt)
                self.rate_bps = None if cap is not None and rate >= 1.1 * cap else rate
        return self.rate_bps

    def _unknown(self, t: float) -> int | None:
        # No socket sent a byte in the interval (idle, or a receiver whose window stayed
        # shut): the queue is unknown, not empty. Read as empty it ended the episode, so a
        # queue that was not ours was never yielded to, and it let the rate climb: CI saw a
        # toxiproxy bandwidth link (a standing queue whatever we send, with silent samples
        # between) cut to the floor in 1.4 s. Hold everything; a silence of quiet_s drops a
        # limit that no longer says anything about the path.
        if self._unknown_since is None:
            self._unknown_since = t
        elif t - self._unknown_since >= self.quiet_s and self.rate_bps is not None:
            self.rate_bps = None
            self._episode = None
            self._high_run, self._high_goodput, self._clear_since = 0, 0.0, None
        return self.rate_bps

    def _cut(self, snap: LinkSnapshot, q: float, cap: float | None) -> None:
        # While a queue stands the bottleneck delivers at its own rate whatever we send, so
        # the goodput (not our last rate) is the base: cuts in a row do not compound. The
        # most it delivered in an interval of this episode, not the last interval's: a
        # bursty bottleneck (toxiproxy's bandwidth toxic, a policer) delivers in lumps, and
        # CI saw 35, 30, 17 then 5 Mbit/s read off one 32 Mbit/s link, each taken for its
        # rate, cut the limit to the floor in 1.2 s, where ACKs came too seldom for the
        # request's 0.6 s no-progress window.
        base = max(snap.goodput_bps, self._episode_goodput)
        if base <= 0 and self.rate_bps is not None:
            base = float(self.rate_bps)
        if base <= 0:
            base = cap if cap is not None else float(self.floor_bps)
        factor = max(self.max_cut, 1.0 - q / 1000.0 / self.drain_s)
        self.rate_bps = max(self.floor_bps, int(base * factor))
        self.decreases += 1


def per_socket_rate(aggregate_bps: int | None, n_sockets: int) -> int | None:
    """Bytes/s for each of ``n_sockets`` so that together they send ``aggregate_bps``."""
    if aggregate_bps is None or n_sockets <= 0:
        return None
    return max(1, math.ceil(aggregate_bps / 8 / n_sockets))


class _HasSetsockopt(Protocol):
    def setsockopt(self, level: int, optname: int, value: bytes, /) -> None: ...


def apply_pacing(sock: _HasSetsockopt, rate_bytes_per_s: int | None) -> bool:
    """Set SO_MAX_PACING_RATE (``None`` = unlimited); False if the socket is gone."""
    value = _UNLIMITED if rate_bytes_per_s is None else max(1, min(rate_bytes_per_s, _UNLIMITED))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, struct.pack("=Q", value))
    except (OSError, ValueError):
        return False
    return True


def apply_aggregate_pacing(socks: Iterable[_HasSetsockopt], aggregate_bps: int | None) -> int:
    """Split ``aggregate_bps`` evenly over ``socks``; returns how many accepted it."""
    live = list(socks)
    per = per_socket_rate(aggregate_bps, len(live))
    return sum(1 for s in live if apply_pacing(s, per))
