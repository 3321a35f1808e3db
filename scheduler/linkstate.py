"""Cross-cluster link state as the router sees it.

The sender's congestion monitor POSTs one of these to ``/v1/links``; the field names are the
contract between the two. The router must not trust a report forever: a monitor that died
leaves the last "ok" behind, so state older than ``max_age_s`` counts as unknown, and the
policy treats unknown as scarce bandwidth (the safe side: no speculative cache transfers).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

LINK_STATES: Final = ("ok", "warn", "congested")
FIELDS: Final = (
    "utilisation",
    "goodput_bps",
    "capacity_bps",
    "state",
    "retrans_ratio",
    "rtt_ms",
    "updated_at",
)


@dataclass(frozen=True, slots=True)
class LinkState:
    """One sample of the PrfaaS egress link; ``updated_at`` is seconds on the router's clock."""

    utilisation: float
    goodput_bps: float
    capacity_bps: float
    state: str
    retrans_ratio: float
    rtt_ms: float
    updated_at: float

    @staticmethod
    def from_json(obj: object) -> LinkState:
        """Validate a decoded JSON object; ValueError lists every problem, each by field."""
        if not isinstance(obj, Mapping):
            raise ValueError("link state: expected a JSON object")
        problems: list[str] = []
        unknown = sorted(str(k) for k in obj if k not in FIELDS)
        if unknown:
            problems.append(f"unknown field(s): {', '.join(unknown)}")
        missing = [f for f in FIELDS if f not in obj]
        if missing:
            problems.append(f"missing field(s): {', '.join(missing)}")
        nums: dict[str, float] = {}
        for name in FIELDS:
            if name == "state" or name not in obj:
                continue
            v = obj[name]
            if isinstance(v, bool) or not isinstance(v, int | float):
                problems.append(f"{name}: expected a number, got {type(v).__name__}")
                continue
            f = float(v)
            if not math.isfinite(f) or f < 0:
                problems.append(f"{name}: must be a finite number >= 0")
                continue
            nums[name] = f
        if "retrans_ratio" in nums and nums["retrans_ratio"] > 1:
            problems.append("retrans_ratio: must be <= 1")
        state = obj.get("state")
        if "state" in obj and state not in LINK_STATES:
            problems.append(f"state: expected one of {', '.join(LINK_STATES)}, got {state!r}")
        if problems:
            raise ValueError("; ".join(problems))
        assert isinstance(state, str)
        return LinkState(
            utilisation=nums["utilisation"],
            goodput_bps=nums["goodput_bps"],
            capacity_bps=nums["capacity_bps"],
            state=state,
            retrans_ratio=nums["retrans_ratio"],
            rtt_ms=nums["rtt_ms"],
            updated_at=nums["updated_at"],
        )

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    def age_s(self, now: float) -> float:
        return now - self.updated_at

    def is_stale(self, now: float, max_age_s: float) -> bool:
        return self.age_s(now) > max_age_s


def fresh(link: LinkState | None, now: float, max_age_s: float) -> LinkState | None:
    """The link state if it is recent enough to act on, else None (unknown)."""
    if link is None or link.is_stale(now, max_age_s):
        return None
    return link


def available_bps(link: LinkState | None, fallback_bps: float, min_share: float) -> float:
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
