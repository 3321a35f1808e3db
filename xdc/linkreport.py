"""The link report: one sender's view of its share of one cross-cluster link.

One type for everyone who touches it: the congestion monitor builds it from a link snapshot
(``monitor.linkstate.LinkSnapshot.report``), the sender daemon posts it to the router
(``transport.linkmon``), and the router validates it against the JSON schema below (which is
also what its OpenAPI document publishes) and aggregates the reports of every sender on the
link (``scheduler.linkstate``). Before this module the field list was written out four times.

A link is named by the clusters at its two ends (``from_cluster -> to_cluster``, e.g.
``prfaas-a -> pd``). Many senders share one link, and each sees only its own share of it, so a
report also names its ``reporter`` (the sender's node id); the router keeps the latest report
per reporter and combines them.

The bounds are what the router accepts: numbers finite and >= 0, rates up to 1 Pbit/s, RTT up to
an hour; ``updated_at`` (sender clock, seconds) only orders one reporter's reports.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple


class LinkHealth(enum.StrEnum):
    """The monitor's verdict on a link, by loss and queueing (hysteresis in the monitor). The
    one type for a link's state everywhere: the monitor's snapshot, the report on the wire,
    the router's combined view (a StrEnum: its JSON is the value)."""

    OK = "ok"
    WARN = "warn"
    CONGESTED = "congested"

    @property
    def rank(self) -> int:
        return _RANK[self.value]


class LinkCause(enum.StrEnum):
    """Why the monitor says what it says: the router shifts traffic only for congestion.

    Random loss is not congestion: sending less does not reduce it, so a link that loses
    packets without a queue building is reported ``ok`` with cause ``random_loss``.
    """

    CLEAR = "clear"  # nothing to report
    QUEUE = "queue"  # RTT over its floor: a standing queue at the bottleneck (loss or not)
    ECN = "ecn"  # the bottleneck marks packets Congestion Experienced
    RANDOM_LOSS = "random_loss"  # loss without a queue: not congestion
    STALL = "stall"  # sockets in RTO recovery and nothing gets through


LINK_STATES: Final = tuple(h.value for h in LinkHealth)
LINK_CAUSES: Final = tuple(c.value for c in LinkCause)
_RANK: Final = {"ok": 0, "warn": 1, "congested": 2}

CLUSTER_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_REPORTER: Final = 128
MAX_BPS: Final = 1e15
MAX_RTT_MS: Final = 3.6e6
MAX_UTILISATION: Final = 1e3  # goodput over an estimated capacity can exceed 1
MAX_TIME_S: Final = 1e11


def health_rank(state: str) -> int:
    """0 ok, 1 warn, 2 congested: "worst" is the largest."""
    return _RANK[state]


def health_of_rank(rank: int) -> LinkHealth:
    """The state of a rank (``health_rank``'s inverse)."""
    return (LinkHealth.OK, LinkHealth.WARN, LinkHealth.CONGESTED)[rank]


class LinkId(NamedTuple):
    """A directed link between two clusters; ``str()`` is ``src->dst`` (metrics, logs)."""

    src: str
    dst: str

    def __str__(self) -> str:
        return f"{self.src}->{self.dst}"

    @staticmethod
    def parse(text: str) -> LinkId:
        src, sep, dst = text.partition("->")
        if not sep or not CLUSTER_NAME.match(src) or not CLUSTER_NAME.match(dst):
            raise ValueError(f"link id {text[:80]!r}: expected CLUSTER->CLUSTER")
        return LinkId(src, dst)


_NAME_SCHEMA: Final = {"type": "string", "pattern": CLUSTER_NAME.pattern, "maxLength": 64}
_NUMBERS: Final[dict[str, float]] = {
    "utilisation": MAX_UTILISATION,
    "goodput_bps": MAX_BPS,
    "capacity_bps": MAX_BPS,
    "retrans_ratio": 1.0,
    "rtt_ms": MAX_RTT_MS,
    "updated_at": MAX_TIME_S,
}

SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "description": (
        "One sender's sample of its share of the link from_cluster -> to_cluster. The router "
        "keeps the latest report per (link, reporter), drops reporters silent for longer than "
        "router.link_stale_s, and routes on the combination: total goodput, worst loss and "
        "RTT, worst state, and a capacity estimate for the whole link. updated_at (sender "
        "clock, seconds) only orders one reporter's reports: an older one arriving late is "
        "ignored; staleness uses the router's receive time."
    ),
    "additionalProperties": False,
    "required": ["from_cluster", "to_cluster", "reporter", "state", *_NUMBERS],
    "properties": {
        "from_cluster": {**_NAME_SCHEMA, "description": "sending cluster, e.g. a PrfaaS one"},
        "to_cluster": {**_NAME_SCHEMA, "description": "receiving cluster (the PD cluster)"},
        "reporter": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_REPORTER,
            "description": "the sender's node id; one share of the link per reporter",
        },
        "state": {"type": "string", "enum": list(LINK_STATES)},
        "cause": {
            "type": "string",
            "enum": list(LINK_CAUSES),
            "description": (
                "why the state is what it is (optional, default clear): queue / ecn / stall "
                "are congestion; random_loss is loss without queueing, reported with state ok"
            ),
        },
        **{name: {"type": "number", "minimum": 0, "maximum": hi} for name, hi in _NUMBERS.items()},
    },
}


@dataclass(frozen=True, slots=True)
class LinkReport:
    """One reporter's sample of one link. Rates in bits/s, RTT in ms, times in seconds."""

    from_cluster: str
    to_cluster: str
    reporter: str
    utilisation: float
    goodput_bps: float
    capacity_bps: float
    state: LinkHealth
    retrans_ratio: float
    rtt_ms: float
    updated_at: float
    cause: LinkCause = LinkCause.CLEAR

    def __post_init__(self) -> None:
        # built from plain strings too (tests, old callers): held as the enums, or refused
        object.__setattr__(self, "state", LinkHealth(self.state))
        object.__setattr__(self, "cause", LinkCause(self.cause))

    @property
    def link(self) -> LinkId:
        return LinkId(self.from_cluster, self.to_cluster)

    def to_json(self) -> dict[str, Any]:
        return {
            "from_cluster": self.from_cluster,
            "to_cluster": self.to_cluster,
            "reporter": self.reporter,
            "utilisation": self.utilisation,
            "goodput_bps": self.goodput_bps,
            "capacity_bps": self.capacity_bps,
            "state": self.state.value,
            "retrans_ratio": self.retrans_ratio,
            "rtt_ms": self.rtt_ms,
            "updated_at": self.updated_at,
            "cause": self.cause.value,
        }

    @staticmethod
    def from_json(obj: object) -> LinkReport:
        """Check a decoded JSON object against ``SCHEMA``; ValueError lists every problem."""
        problems = report_problems(obj)
        if problems:
            raise ValueError("; ".join(problems))
        assert isinstance(obj, Mapping)
        return LinkReport.from_checked(obj)

    @staticmethod
    def from_checked(obj: Mapping[str, Any]) -> LinkReport:
        """Build from an object already checked against ``SCHEMA`` (the router's validator)."""
        return LinkReport(
            from_cluster=obj["from_cluster"],
            to_cluster=obj["to_cluster"],
            reporter=obj["reporter"],
            utilisation=float(obj["utilisation"]),
            goodput_bps=float(obj["goodput_bps"]),
            capacity_bps=float(obj["capacity_bps"]),
            state=LinkHealth(obj["state"]),
            retrans_ratio=float(obj["retrans_ratio"]),
            rtt_ms=float(obj["rtt_ms"]),
            updated_at=float(obj["updated_at"]),
            cause=LinkCause(obj.get("cause", LinkCause.CLEAR.value)),
        )

    @staticmethod
    def clamped(
        link: LinkId,
        reporter: str,
        *,
        utilisation: float,
        goodput_bps: float,
        capacity_bps: float,
        state: LinkHealth | str,
        retrans_ratio: float,
        rtt_ms: float | None,
        updated_at: float,
        cause: LinkCause | str = LinkCause.CLEAR,
    ) -> LinkReport:
        """A report whose numbers are forced into the accepted ranges (the monitor's side:
        an estimator glitch must not turn into a report the router rejects)."""

        def c(x: float | None, hi: float) -> float:
            v = 0.0 if x is None or not math.isfinite(x) else float(x)
            return min(max(v, 0.0), hi)

        return LinkReport(
            from_cluster=link.src,
            to_cluster=link.dst,
            reporter=reporter[:MAX_REPORTER] or "unnamed",
            utilisation=c(utilisation, MAX_UTILISATION),
            goodput_bps=c(goodput_bps, MAX_BPS),
            capacity_bps=c(capacity_bps, MAX_BPS),
            state=LinkHealth(state),
            retrans_ratio=c(retrans_ratio, 1.0),
            rtt_ms=c(rtt_ms, MAX_RTT_MS),
            updated_at=c(updated_at, MAX_TIME_S),
            cause=LinkCause(cause),
        )


def report_problems(obj: object) -> list[str]:
    """Every way ``obj`` departs from ``SCHEMA``, one line each (empty = acceptable).

    Written against the schema table itself so the two cannot disagree; the router uses its
    general schema validator instead, which reads the same table.
    """
    if not isinstance(obj, Mapping):
        return ["link report: expected a JSON object"]
    props: Mapping[str, Any] = SCHEMA["properties"]
    out: list[str] = []
    unknown = sorted(str(k) for k in obj if k not in props)
    if unknown:
        out.append(f"unknown field(s): {', '.join(unknown)}")
    missing = [k for k in SCHEMA["required"] if k not in obj]
    if missing:
        out.append(f"missing field(s): {', '.join(missing)}")
    for name in ("from_cluster", "to_cluster"):
        v = obj.get(name)
        if name in obj and not (isinstance(v, str) and CLUSTER_NAME.match(v)):
            out.append(f"{name}: expected a cluster name ({CLUSTER_NAME.pattern})")
    v = obj.get("reporter")
    if "reporter" in obj and not (isinstance(v, str) and 1 <= len(v) <= MAX_REPORTER):
        out.append(f"reporter: expected a string of 1..{MAX_REPORTER} characters")
    if "state" in obj and obj.get("state") not in LINK_STATES:
        out.append(f"state: expected one of {', '.join(LINK_STATES)}")
    if "cause" in obj and obj.get("cause") not in LINK_CAUSES:
        out.append(f"cause: expected one of {', '.join(LINK_CAUSES)}")
    for name, hi in _NUMBERS.items():
        if name not in obj:
            continue
        x = obj[name]
        if isinstance(x, bool) or not isinstance(x, int | float):
            out.append(f"{name}: expected a number, got {type(x).__name__}")
        elif not (math.isfinite(x) and 0 <= x <= hi):
            out.append(f"{name}: must be a finite number in [0, {hi:g}]")
    return out


__all__ = [
    "CLUSTER_NAME",
    "LINK_CAUSES",
    "LINK_STATES",
    "SCHEMA",
    "LinkCause",
    "LinkHealth",
    "LinkId",
    "LinkReport",
    "health_of_rank",
    "health_rank",
    "report_problems",
]
