"""What the replay simulator is fed: arrivals (trace or synthetic) and a link schedule.

Arrivals are built once and shared by every policy in a comparison, so the policies see the
same requests at the same instants and differences in the results are the policies' own.
Randomness (Poisson gaps, synthetic lengths) comes from one seed, so a run is reproducible.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from xdc.scheduler.profile import Workload

from xdc.errors import ConfigurationError
from xdc.textfile import UnreadableFile, read_text_file


class ReplayInputError(ConfigurationError, ValueError):
    """A bad trace, schedule or workload; the message names the file/field and what is wrong."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request: arrival time (s from the start), lengths, and its prefix-block keys."""

    rid: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hashes: tuple[int, ...] = ()


def load_trace(
    path: str | Path, *, limit: int | None = None, rate_scale: float = 1.0
) -> list[SimRequest]:
    """Read a Mooncake jsonl trace: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids``.

    Times are shifted so the first request arrives at 0 and divided by ``rate_scale``
    (``rate_scale = 2`` replays the trace twice as fast). ``limit`` keeps the first N lines.
    """
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ReplayInputError(f"rate scale must be > 0, got {rate_scale}")
    try:
        text = read_text_file(path)
    except UnreadableFile as e:
        raise ReplayInputError(f"trace {path}: {e}") from None
    out: list[SimRequest] = []
    first: float | None = None
    last = -math.inf
    for lineno, line in enumerate(text.splitlines(), 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        where = f"trace {path}:{lineno}"
        try:
            rec = json.loads(line)
        except ValueError as e:  # a decode error, or an integer of over 4300 digits
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise ReplayInputError(f"{where}: not valid JSON: {msg}") from None
        if not isinstance(rec, dict):
            raise ReplayInputError(f"{where}: expected a JSON object")
        ts = _number(rec, "timestamp", where)
        n_in = _count(rec, "input_length", where, minimum=1)
        n_out = _count(rec, "output_length", where, minimum=0)
        hashes = rec.get("hash_ids", [])
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in hashes
        ):
            raise ReplayInputError(f"{where}: hash_ids: expected a list of integers in [0, 2**64)")
        if ts < last:
            raise ReplayInputError(f"{where}: timestamp {ts:g} is earlier than the line before")
        last = ts
        first = ts if first is None else first
        out.append(
            SimRequest(
                rid=len(out),
                arrival_s=(ts - first) / 1000.0 / rate_scale,
                input_tokens=n_in,
                output_tokens=n_out,
                hashes=tuple(hashes),
            )
        )
    if not out:
        raise ReplayInputError(f"trace {path}: no requests")
    return out


def _number(rec: dict[str, object], key: str, where: str) -> float:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
        raise ReplayInputError(f"{where}: {key}: expected a number >= 0, got {v!r}")
    return float(v)


def _count(rec: dict[str, object], key: str, where: str, minimum: int) -> int:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ReplayInputError(f"{where}: {key}: expected an integer >= {minimum}, got {v!r}")
    return v


def poisson_times(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival instants of a Poisson process at ``rate`` req/s, the first at 0."""
    if not (math.isfinite(rate) and rate > 0):
        raise ReplayInputError(f"rate must be > 0 req/s, got {rate}")
    rng = np.random.default_rng([seed, 1])
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


def synthetic(workload: Workload, n: int, rate: float, seed: int) -> list[SimRequest]:
    """``n`` requests with lengths drawn from ``workload`` and Poisson arrivals at ``rate``.

    Synthetic prompts share no prefixes (no hash keys), so they never hit a cache.
    """
    if n < 1:
        raise ReplayInputError(f"synthetic: need at least 1 request, got {n}")
    lengths = workload.samples(n, seed)
    times = poisson_times(n, rate, seed)
    out_tokens = max(round(workload.output_tokens), 0)
    return [SimRequest(i, times[i], max(round(float(lengths[i])), 1), out_tokens) for i in range(n)]


def retime(requests: Sequence[SimRequest], rate: float, seed: int) -> list[SimRequest]:
    """The same requests in the same order, re-timed as Poisson arrivals at ``rate``."""
    times = poisson_times(len(requests), rate, seed)
    return [replace(r, arrival_s=times[i]) for i, r in enumerate(requests)]


@dataclass(frozen=True)
class LinkSchedule:
    """Link bandwidth over time: ``gbps[i]`` from ``times[i]`` seconds until the next entry."""

    times: tuple[float, ...]
    gbps: tuple[float, ...]

    def at(self, t: float) -> float:
        value = self.gbps[0]
        for ti, g in zip(self.times, self.gbps, strict=True):
            if ti <= t:
                value = g
        return value

    def describe(self) -> str:
        pairs = zip(self.times, self.gbps, strict=True)
        return ", ".join(f"{g:g} Gbps from {t:g}s" for t, g in pairs)


def parse_link_schedule(text: str, default_gbps: float) -> LinkSchedule:
    """``"0:100,600:25"``: 100 Gbps from t = 0 s, 25 Gbps from t = 600 s.

    A schedule that does not start at 0 runs at ``default_gbps`` (the profile's egress) until
    its first entry; an empty string means ``default_gbps`` throughout.
    """
    times: list[float] = [0.0]
    gbps: list[float] = [default_gbps]
    explicit_start = False
    text = text.strip()
    if not text:
        return LinkSchedule(tuple(times), tuple(gbps))
    for part in text.split(","):
        piece = part.strip()
        bits = piece.split(":")
        if len(bits) != 2:
            raise ReplayInputError(
                f"link schedule: {piece!r} is not SECONDS:GBPS (e.g. '0:100,600:25')"
            )
        try:
            t, g = float(bits[0]), float(bits[1])
        except ValueError:
            raise ReplayInputError(f"link schedule: {piece!r}: not numbers") from None
        if not (math.isfinite(t) and t >= 0):
            raise ReplayInputError(f"link schedule: {piece!r}: time must be >= 0")
        if not (math.isfinite(g) and g >= 0):
            raise ReplayInputError(f"link schedule: {piece!r}: Gbps must be finite and >= 0")
        if t == 0 and not explicit_start and len(times) == 1:
            gbps[0] = g
            explicit_start = True
            continue
        if t <= times[-1]:
            raise ReplayInputError(f"link schedule: times must increase ({piece!r})")
        times.append(t)
        gbps.append(g)
    return LinkSchedule(tuple(times), tuple(gbps))


__all__ = [
    "LinkSchedule",
    "ReplayInputError",
    "SimRequest",
    "load_trace",
    "parse_link_schedule",
    "poisson_times",
    "retime",
    "synthetic",
]
