"""Cross-cluster links as the router sees them: many senders' reports, one state per link.

Every sender daemon on a link reports its own share of it (``xdc.linkreport.LinkReport``); no
single report describes the link. ``LinkTable`` keeps the latest report per (link, reporter)
and combines them into one ``LinkView`` per link:

* goodput is the **sum** of the reporters' goodput (the link carries all of it);
* loss and queueing are the **worst** reporter's (``retrans_ratio``, ``rtt_ms``, ``state``):
  one sender seeing loss means the shared bottleneck is dropping;
* capacity is ``max(max_i capacity_i, sum_i goodput_i)``. A sender's own estimate is a high
  percentile of *its* goodput, so it is the whole link only while that sender had the link to
  itself; when several are backlogged at once each estimates its share, and their summed
  goodput is the link. The larger of the two is right in both cases, and follows a drop as
  fast as the senders' estimates do (each falls to its share of the new capacity within about
  a second, and the sum falls with the goodput). A configured capacity (every sender sends the
  same number) passes through unchanged;
* a reporter silent for longer than ``reporter_ttl_s`` (router clock) is dropped, so a dead
  sender neither props up the goodput nor pins a stale "congested". A link whose reporters
  are all gone is unknown (``None``), which the policy treats as scarce bandwidth.

Pure state over an explicit clock, no I/O: the service and the replay simulator drive it, and
the Redis backend replicates its inputs (the reports) rather than its outputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from xdc.errors import RemoteRequestError
from xdc.linkreport import (
    LinkCause,
    LinkHealth,
    LinkId,
    LinkReport,
    health_of_rank,
    health_rank,
)

MAX_REPORTERS_PER_LINK: Final = 1024


@dataclass(frozen=True, slots=True)
class LinkView:
    """One link's combined state; ``updated_at`` is the router-clock time of the newest
    report in it (what staleness is measured from)."""

    utilisation: float
    goodput_bps: float
    capacity_bps: float
    state: LinkHealth
    retrans_ratio: float
    rtt_ms: float
    updated_at: float
    reporters: int = 1
    cause: LinkCause = LinkCause.CLEAR  # the worst reporter's

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", LinkHealth(self.state))
        object.__setattr__(self, "cause", LinkCause(self.cause))

    def to_json(self) -> dict[str, object]:
        return {
            "utilisation": round(self.utilisation, 6),
            "goodput_bps": round(self.goodput_bps, 3),
            "capacity_bps": round(self.capacity_bps, 3),
            "state": self.state,
            "retrans_ratio": round(self.retrans_ratio, 6),
            "rtt_ms": round(self.rtt_ms, 6),
            "updated_at": self.updated_at,
            "reporters": self.reporters,
            "cause": self.cause,
        }

    def age_s(self, now: float) -> float:
        return now - self.updated_at

    def is_stale(self, now: float, max_age_s: float) -> bool:
        return self.age_s(now) > max_age_s


@dataclass(frozen=True, slots=True)
class Held:
    """A reporter's latest report and when the router received it (router clock)."""

    report: LinkReport
    received_at: float


def combine(held: Iterable[Held]) -> LinkView | None:
    """The link state from its live reporters' latest reports; None when there are none."""
    goodput = cap = retrans = rtt = 0.0
    rank = 0
    cause = LinkCause.CLEAR
    newest = -math.inf
    n = 0
    for h in held:
        r = h.report
        n += 1
        goodput += r.goodput_bps
        cap = max(cap, r.capacity_bps)
        retrans = max(retrans, r.retrans_ratio)
        rtt = max(rtt, r.rtt_ms)
        r_rank = health_rank(r.state)
        if r_rank > rank or (r_rank == rank and cause == LinkCause.CLEAR):
            cause = r.cause
        rank = max(rank, r_rank)
        newest = max(newest, h.received_at)
    if n == 0:
        return None
    cap = max(cap, goodput)
    return LinkView(
        utilisation=goodput / cap if cap > 0 else 0.0,
        goodput_bps=goodput,
        capacity_bps=cap,
        state=health_of_rank(rank),
        retrans_ratio=retrans,
        rtt_ms=rtt,
        updated_at=newest,
        reporters=n,
        cause=cause,
    )


class UnknownLink(RemoteRequestError, ValueError):
    """A report for a link the router's profile does not have."""


class LinkTable:
    """Latest report per (link, reporter) for the links the router knows, combined on read.

    ``views`` is on the routing path: the combined views are cached and rebuilt only when a
    report arrives or the oldest reporter's deadline passes.
    """

    def __init__(self, links: Iterable[LinkId], reporter_ttl_s: float) -> None:
        if not reporter_ttl_s > 0:
            raise ValueError("reporter_ttl_s must be > 0")
        self.ttl = reporter_ttl_s
        self._held: dict[LinkId, dict[str, Held]] = {LinkId(*k): {} for k in links}
        self._views: dict[LinkId, LinkView | None] = dict.fromkeys(self._held)
        self._next_expiry = math.inf
        # when each link was last reported on, kept after its reporters expire: a link
        # that went silent is dark, one never heard of is unknown (see scheduler.outages)
        self.last_heard: dict[LinkId, float] = {}
        self.expired = 0
        self.ignored = 0
        self.version = 0  # bumped whenever a combined view changes

    @property
    def links(self) -> tuple[LinkId, ...]:
        return tuple(self._held)

    def knows(self, link: LinkId) -> bool:
        return link in self._held

    def accept(self, report: LinkReport, received_at: float) -> bool:
        """Keep ``report`` unless this reporter already sent a newer one; False if ignored.

        Raises UnknownLink for a link outside the profile, and ValueError when a link already
        has ``MAX_REPORTERS_PER_LINK`` live reporters (bounded memory under a flood of names).
        """
        per = self._held.get(report.link)
        if per is None:
            known = ", ".join(str(k) for k in self._held) or "none"
            raise UnknownLink(f"link {report.link} is not in the profile (known: {known})")
        cur = per.get(report.reporter)
        if cur is not None and report.updated_at < cur.report.updated_at:
            self.ignored += 1
            return False
        if cur is None and len(per) >= MAX_REPORTERS_PER_LINK:
            self.expire(received_at)
            if len(per) >= MAX_REPORTERS_PER_LINK:
                raise ValueError(
                    f"link {report.link}: already {MAX_REPORTERS_PER_LINK} live reporters"
                )
        per[report.reporter] = Held(report, received_at)
        self.last_heard[report.link] = max(
            self.last_heard.get(report.link, received_at), received_at
        )
        self._views[report.link] = combine(per.values())
        self.version += 1
        self._next_expiry = min(self._next_expiry, received_at + self.ttl)
        return True

    def expire(self, now: float) -> int:
        """Drop reporters silent for longer than the TTL; how many were dropped."""
        if now <= self._next_expiry:
            return 0
        dropped = 0
        nxt = math.inf
        cutoff = now - self.ttl
        for link, per in self._held.items():
            gone = [k for k, h in per.items() if h.received_at < cutoff]
            for k in gone:
                del per[k]
            if gone:
                dropped += len(gone)
                self._views[link] = combine(per.values())
                self.version += 1
            for h in per.values():
                nxt = min(nxt, h.received_at + self.ttl)
        self._next_expiry = nxt
        self.expired += dropped
        return dropped

    def views(self, now: float) -> Mapping[LinkId, LinkView | None]:
        """Combined state of every known link at ``now`` (None = no live reporter)."""
        if now > self._next_expiry:
            self.expire(now)
        return self._views

    def view(self, link: LinkId, now: float) -> LinkView | None:
        return self.views(now).get(link)

    def reporters(self, link: LinkId) -> dict[str, Held]:
        return dict(self._held.get(link, {}))

    def held(self) -> list[Held]:
        """Every live report (the Redis backend's snapshot)."""
        return [h for per in self._held.values() for h in per.values()]


def fresh(link: LinkView | None, now: float, max_age_s: float) -> LinkView | None:
    """The link state if it is recent enough to act on, else None (unknown)."""
    if link is None or link.is_stale(now, max_age_s):
        return None
    return link


def available_bps(link: LinkView | None, fallback_bps: float, min_share: float) -> float:
    """Bandwidth a new transfer can expect, in bits/s.

    A new flow competes with the ones already on the link, so it gets at least a fair-share
    floor (``min_share`` of capacity) even on a busy link, and the unused headroom otherwise.
    When the monitor has not told us the capacity, ``fallback_bps`` (the profile's egress
    bandwidth) stands in, still discounted by utilisation when that is known.
    """
    if link is None:
        return max(fallback_bps * min_share, 1.0)
    cap = link.capacity_bps if link.capacity_bps > 0 else fallback_bps
    if link.state == "congested":
        return max(cap * min_share, 1.0)
    return max(cap * max(1.0 - link.utilisation, min_share), 1.0)


def usable_capacity_bps(link: LinkView, min_share: float) -> float:
    """What a congested link can be counted on to carry: the goodput it delivers now, not
    its capacity. Someone else's flows are filling the queue; our share is what we get.
    The threshold's raise is bounded by the planner's t for this figure, so congestion from
    other traffic lets t rise even when the capacity already planned for is unchanged. Never
    below ``min_share`` of the capacity: an app-limited sender's goodput says nothing about
    its share, and the bound must stay a bound."""
    cap = link.capacity_bps
    if link.state != "congested" or link.goodput_bps <= 0 or cap <= 0:
        return cap
    return max(min(cap, link.goodput_bps), cap * min_share)


def live_capacity_bps(link: LinkView | None, now: float, max_age_s: float) -> float | None:
    """The link's capacity if a fresh report estimated one, else None."""
    live = fresh(link, now, max_age_s)
    return live.capacity_bps if live is not None and live.capacity_bps > 0 else None


__all__ = [
    "MAX_REPORTERS_PER_LINK",
    "Held",
    "LinkTable",
    "LinkView",
    "UnknownLink",
    "available_bps",
    "combine",
    "fresh",
    "live_capacity_bps",
    "usable_capacity_bps",
]
