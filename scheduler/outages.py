"""Where offloading must stop: PrfaaS links gone dark and decode nodes that can not take KV.

The link monitor says how *well* a link carries bytes; it can not say that nobody carries
them any more. Two signals do, and this module turns them into "do not offload there" with a
reason the decision shows:

* **silence**: a link that was reported on and has had no report for ``dark_after_s`` is
  dark. Its senders publish every second, so a killed sender or a cut link shows here within
  ``dark_after_s`` plus a second, long before ``reporter_ttl_s`` drops the stale reports;
* **what the gateway saw**: a remote plan whose KV did not come (``POST /v1/outcomes``), by
  reason. A reason that names the culprit (``sender_down``: the prefill's sender is gone;
  ``receiver_gone`` / ``peer_unreachable``: the decode node's receiver) takes it out at once;
  an ambiguous one (``never_arrived``, ``timeout``, ``send_failed``) only when it repeats
  within ``window_s``. Either holds for ``hold_s``; a link held for its sender being down is
  back as soon as a report newer than the failure arrives (the sender is up again).

Pure state over an explicit clock, no I/O: the router service drives it, tests drive it with
numbers.
"""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

# what a reason blames, and whether one report of it is enough
Blame = Literal["link", "intake", "none"]
_LINK_SURE: Final = frozenset({"sender_down", "draining"})
_LINK_MAYBE: Final = frozenset({"never_arrived", "timeout", "send_failed", "begin_refused"})
_INTAKE_SURE: Final = frozenset({"receiver_gone", "peer_unreachable", "peer_refused"})
_INTAKE_MAYBE: Final = frozenset({"shutdown", "layout_mismatch"})
MAX_KEYS: Final = 4096  # bounded memory under a flood of made-up names


def blame(reason: str, stage: str = "decode") -> tuple[Blame, bool]:
    """What a failure reason blames (the link, the decode node's intake, or neither: the
    request itself, e.g. ``token_count``, or a slow or failing prefill engine, which the
    node reports judge) and whether one report is proof."""
    if stage == "prefill" and reason in ("timeout", "error", "mismatch"):
        return "none", False
    if reason in _LINK_SURE:
        return "link", True
    if reason in _LINK_MAYBE:
        return "link", False
    if reason in _INTAKE_SURE:
        return "intake", True
    if reason in _INTAKE_MAYBE:
        return "intake", False
    return "none", False


@dataclass(frozen=True, slots=True)
class Failure:
    """One remote plan whose KV did not reach its decode node, as the gateway reports it."""

    cluster: str  # the PrfaaS cluster that prefilled (its link)
    decode_node: str
    reason: str  # the connector's or the gateway's word
    stage: Literal["prefill", "decode"]


_NAME: Final = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_REASON: Final = re.compile(r"[a-z_]{1,32}")


def failure_of(cluster: Any, decode_node: Any, reason: Any, stage: Any) -> Failure:
    """A failure report from untrusted fields; ValueError naming the bad one."""
    for what, v in (("cluster", cluster), ("decode_node", decode_node)):
        if not isinstance(v, str) or not _NAME.fullmatch(v):
            raise ValueError(f"{what}: expected a node or cluster name, got {v!r:.60}")
    if not isinstance(reason, str) or not _REASON.fullmatch(reason):
        raise ValueError(f"reason: expected a lowercase word of 1..32 letters, got {reason!r:.60}")
    if stage not in ("prefill", "decode"):
        raise ValueError(f"stage: expected 'prefill' or 'decode', got {stage!r:.60}")
    return Failure(cluster, decode_node, reason, stage)


@dataclass(slots=True)
class _Mark:
    until: float
    why: str
    since: float
    sender_down: bool = False


@dataclass(slots=True)
class Outages:
    """Links and decode intakes out of use, and the counts behind them."""

    dark_after_s: float = 2.0
    hold_s: float = 10.0
    window_s: float = 10.0
    repeats: int = 2  # ambiguous failures within window_s that take a link or node out
    _links: dict[str, _Mark] = field(default_factory=dict)
    _intakes: dict[str, _Mark] = field(default_factory=dict)
    _recent: dict[tuple[str, str], deque[float]] = field(default_factory=dict)
    counts: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if not (self.dark_after_s > 0 and self.hold_s > 0 and self.window_s > 0):
            raise ValueError("dark_after_s, hold_s and window_s must be > 0")
        if self.repeats < 1:
            raise ValueError("repeats must be >= 1")

    def record(self, f: Failure, now: float) -> Blame:
        """Count a failure, and take its link or decode intake out of use when it proves
        (or, repeated, suggests) that one is broken. What was blamed."""
        key = (f.cluster, f.decode_node, f.reason)
        if key in self.counts or len(self.counts) < MAX_KEYS:
            self.counts[key] += 1
        what, sure = blame(f.reason, f.stage)
        if what == "none":
            return what
        name = f.cluster if what == "link" else f.decode_node
        marks = self._links if what == "link" else self._intakes
        if not sure:
            seen = self._recent.get((what, name))
            if seen is None:
                if len(self._recent) >= MAX_KEYS:
                    self._recent.clear()
                seen = self._recent[(what, name)] = deque(maxlen=self.repeats)
            seen.append(now)
            if len(seen) < self.repeats or now - seen[0] > self.window_s:
                return what
        if name not in marks and len(marks) >= MAX_KEYS:
            return what
        target = f"link {name}->pd" if what == "link" else f"decode node {name}'s KV intake"
        why = f"{target}: {f.reason} reported at {f.stage}"
        old = marks.get(name)
        marks[name] = _Mark(
            now + self.hold_s,
            why,
            old.since if old is not None and old.until > now else now,
            sender_down=f.reason in _LINK_SURE,
        )
        return what

    def heard(self, cluster: str, received_at: float) -> None:
        """A link report arrived: a link held only because its sender was down is back."""
        m = self._links.get(cluster)
        if m is not None and m.sender_down and received_at > m.since:
            del self._links[cluster]

    def links_down(self, now: float, last_heard: Mapping[str, float | None]) -> dict[str, str]:
        """PrfaaS cluster -> why its link must not be offloaded over now. ``last_heard``:
        when each cluster's link was last reported on (None: never, which is unknown, not
        dark: a router that just started has heard nothing yet)."""
        out: dict[str, str] = {}
        for c, at in last_heard.items():
            if at is not None and now - at > self.dark_after_s:
                out[c] = f"link {c}->pd dark: no report for {now - at:.1f}s"
        for c, m in list(self._links.items()):
            if m.until <= now:
                del self._links[c]
            elif c not in out:
                out[c] = m.why
        return out

    def intakes_down(self, now: float) -> dict[str, str]:
        """Decode node -> why no KV may be shipped to it now (it still decodes locally)."""
        out: dict[str, str] = {}
        for n, m in list(self._intakes.items()):
            if m.until <= now:
                del self._intakes[n]
            else:
                out[n] = m.why
        return out

    def to_json(self, now: float, last_heard: Mapping[str, float | None]) -> dict[str, object]:
        return {
            "links_down": self.links_down(now, last_heard),
            "intakes_down": self.intakes_down(now),
            "failures": [
                {"cluster": c, "decode_node": d, "reason": r, "count": n}
                for (c, d, r), n in sorted(self.counts.items())
            ][:200],
            "dark_after_s": self.dark_after_s,
            "hold_s": self.hold_s,
        }


__all__ = ["MAX_KEYS", "Blame", "Failure", "Outages", "blame", "failure_of"]
