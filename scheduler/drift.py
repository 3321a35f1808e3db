"""The profile kept honest on the long timescale: how fast the engines really prefill, from
what they report, against what the profile says they should.

A profile is a measurement of one day (``xdc profile measure``, or a declaration); engines
drift (another model build, a noisy neighbour, thermal limits, a new batch mix). vLLM's
``/metrics`` (scraped by the router) tells, per interval, how many prefills finished, their
total time, their total prompt tokens and how those lengths fall in its histogram buckets.
For each instance type (PrfaaS, PD) the estimator compares that time with the profile's
prediction for the same requests (the curve at each bucket's length, ``predicted_seconds``)
and keeps a smoothed ratio. The router re-solves t with the profile's prefill curves scaled
by it, and says so.

Pure: windows in, factors and a scaled profile out; the poller and the service drive it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from xdc.scheduler.profile import InstanceProfile, Profile

Kind = Literal["prfaas", "pd"]
KINDS: tuple[Kind, ...] = ("prfaas", "pd")


@dataclass(frozen=True)
class PrefillWindow:
    """What one engine finished between two scrapes: ``n`` prefills, ``seconds`` of prefill
    in total, ``tokens`` prompt tokens in total; ``lengths``, where the engine exports its
    prompt-length histogram, how many of them fell in each bucket ``(lo, hi]``."""

    n: int
    seconds: float
    tokens: float
    lengths: tuple[tuple[float, float, int], ...] = ()


def predicted_seconds(w: PrefillWindow, inst: InstanceProfile) -> float:
    """The profile's prefill time for a window's requests.

    A prefill curve is convex, so ``n`` times the curve at the mean length under-predicts a
    mix of short and long prompts (the gateway's trace slice, 32 to 3,524 tokens: by 1.27x),
    and an engine exactly as profiled would read as slower. With the engine's prompt-length
    histogram each bucket is priced at its own length: the bucket's middle, all of them
    scaled so the window's known token total is kept, each held inside its bucket."""
    mids = [(lo, hi, k, _middle(lo, hi)) for lo, hi, k in w.lengths if k > 0]
    priced = sum(k * m for _, _, k, m in mids)
    if not priced > 0:  # no buckets, or only ones no length can be read from ((0, 0], (0, inf])
        return w.n * inst.prefill_time(w.tokens / w.n)
    in_buckets = sum(k for _, _, k, _ in mids)
    scale = w.tokens * in_buckets / w.n / priced
    per = sum(k * inst.prefill_time(min(hi, max(lo, m * scale))) for lo, hi, k, m in mids)
    return w.n * per / in_buckets


def _middle(lo: float, hi: float) -> float:
    return lo * 1.5 if math.isinf(hi) else (lo + hi) / 2


@dataclass
class _Track:
    factor: float = 1.0
    samples: int = 0  # windows folded in
    requests: int = 0  # prefills behind the factor
    pending_s: float = 0.0  # measured, not yet folded
    pending_pred_s: float = 0.0  # what the profile predicted for the same requests
    pending_n: int = 0
    last_ratio: float | None = None


@dataclass
class DriftEstimator:
    """Per instance type, the ratio measured / profiled prefill time, smoothed.

    ``min_requests`` prefills are pooled before one ratio is taken (a single short request is
    mostly overhead); each new ratio moves the factor by ``alpha`` (an EWMA); the factor is
    clamped to ``[1/limit, limit]`` (an engine 10x off its profile needs a new profile, not a
    correction)."""

    min_requests: int = 8
    alpha: float = 0.5
    limit: float = 10.0
    tracks: dict[Kind, _Track] = field(default_factory=lambda: {k: _Track() for k in KINDS})

    def observe(self, kind: Kind, w: PrefillWindow, inst: InstanceProfile) -> None:
        """Fold one scrape window of one engine of ``kind`` in (a window with no finished
        prefill, or numbers no engine gives, is ignored)."""
        if w.n <= 0 or not (w.seconds >= 0 and w.tokens > 0) or not math.isfinite(w.seconds):
            return
        predicted = predicted_seconds(w, inst)
        if not predicted > 0:
            return
        tr = self.tracks[kind]
        tr.pending_s += w.seconds
        tr.pending_pred_s += predicted
        tr.pending_n += w.n
        if tr.pending_n < self.min_requests:
            return
        ratio = tr.pending_s / tr.pending_pred_s
        tr.factor = (1 - self.alpha) * tr.factor + self.alpha * ratio if tr.samples else ratio
        tr.factor = min(self.limit, max(1 / self.limit, tr.factor))
        tr.samples += 1
        tr.requests += tr.pending_n
        tr.last_ratio = ratio
        tr.pending_s = tr.pending_pred_s = 0.0
        tr.pending_n = 0

    def factor(self, kind: Kind) -> float:
        return self.tracks[kind].factor

    def factors(self) -> dict[Kind, float]:
        return {k: self.tracks[k].factor for k in KINDS}

    def state(self) -> dict[str, Any]:
        """For ``/v1/state``: the factor applied to each instance type's prefill curve and
        what it rests on."""
        return {
            k: {
                "factor": round(t.factor, 4),
                "windows": t.samples,
                "requests": t.requests,
                "last_ratio": None if t.last_ratio is None else round(t.last_ratio, 4),
            }
            for k, t in self.tracks.items()
        }


def factors_from_json(raw: object, limit: float = 10.0) -> dict[Kind, float] | None:
    """Factors another replica published (``{"prfaas": f, "pd": f}``), or None if they are
    not that: an instance type missing, a number that is not one; each clamped as the
    estimator clamps its own."""
    if not isinstance(raw, Mapping):
        return None
    out: dict[Kind, float] = {}
    for k in KINDS:
        v = raw.get(k)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return None
        out[k] = min(limit, max(1 / limit, float(v)))
    return out


def scaled(profile: Profile, factors: Mapping[Kind, float]) -> Profile:
    """``profile`` with each instance type's prefill curve times its factor (KV sizes and
    decode unchanged: the scrape says nothing about them)."""

    def scale(inst: InstanceProfile, f: float) -> InstanceProfile:
        if f == 1.0:
            return inst
        return dataclasses.replace(inst, prefill_s=tuple(t * f for t in inst.prefill_s))

    return dataclasses.replace(
        profile,
        prfaas=scale(profile.prfaas, factors.get("prfaas", 1.0)),
        pd=scale(profile.pd, factors.get("pd", 1.0)),
    )
