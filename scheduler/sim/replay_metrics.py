"""Turning a replay's per-request timeline into the figures `xdc replay` reports.

Kept apart from the engine so the definitions are in one place and can be read next to the
numbers they produce:

* **TTFT**: arrival until the request's KV is complete on its decode instance (queueing,
  prefill, and any transfer time not hidden behind prefill). Percentiles are over requests
  that got that far; rejected and stuck requests are counted separately, never dropped.
* **throughput**: completions per second in the steady part of the run, from 20% of the
  arrival span to the last arrival. An overloaded system completes at its capacity there
  while its queues grow, so this saturates exactly where the throughput model says it should.
* **offload fraction**: accepted requests prefilled on PrfaaS; **cache hit rate**: prefix
  tokens reused over input tokens of accepted requests.
* **egress**: PrfaaS -> PD bits over the arrival span (mean) and the busiest monitor interval
  (peak).
* **phases**: the same figures for arrivals in each segment of the link schedule, which is how
  a mid-run link change shows up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from xdc.scheduler.sim.workload import LinkSchedule

STEADY_FROM = 0.2  # throughput window starts at this fraction of the arrival span


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's timeline (nan = never happened)."""

    arrival: float
    input_tokens: int
    cached_tokens: int
    target: str  # "pd", a PrfaaS cluster's name, or "" when rejected
    rejected: bool
    queued_at: float
    prefill_start: float
    prefill_end: float
    ready: float
    decode_start: float
    done: float
    predicted_ttft: float
    effective_t: float


@dataclass(frozen=True, slots=True)
class TickSample:
    """What the link monitor saw at one sampling instant, plus queue lengths."""

    t: float
    egress_bytes: float
    egress_gbps: float
    utilisation: float
    backlog_s: float
    prfaas_waiting: int
    pd_prefill_waiting: int
    decode_waiting: int
    t_effective: float
    t_base: float


@dataclass(frozen=True)
class PhaseStats:
    """Requests that *arrived* while the link ran at ``link_gbps``."""

    start_s: float
    end_s: float
    link_gbps: float
    arrivals: int
    rejected: int
    ttft_mean_s: float
    ttft_p90_s: float
    offload_fraction: float
    egress_gbps_mean: float


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    n_prfaas: int
    n_p: int
    n_d: int
    requests: int
    completed: int
    rejected: int
    unfinished: int
    arrival_rate_rps: float
    throughput_rps: float
    makespan_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_max_s: float
    offload_fraction: float
    cache_hit_rate: float
    egress_gbps_mean: float
    egress_gbps_peak: float
    link_util_mean: float
    reverse_gb: float
    prfaas_wait_mean_s: float
    pd_prefill_wait_mean_s: float
    decode_wait_mean_s: float
    prfaas_waiting_max: int
    pd_prefill_waiting_max: int
    decode_waiting_max: int
    base_t: float
    final_t: float
    t_min: float
    t_mean: float
    t_max: float
    ttft_prediction_mae_s: float
    phases: tuple[PhaseStats, ...] = field(default=())
    offload_split: dict[str, int] = field(default_factory=dict)
    events: int = 0
    wall_s: float = 0.0
    note: str = ""

    def to_json(self) -> dict[str, object]:
        """JSON-safe (inf and nan become null)."""
        out = _clean(asdict(self))
        assert isinstance(out, dict)
        return out

    def deterministic(self) -> dict[str, object]:
        """Everything except wall-clock time: equal for equal inputs."""
        d = self.to_json()
        d.pop("wall_s", None)
        return d


def _clean(x: object) -> object:
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else math.nan


def summarise(
    *,
    policy: str,
    layout: tuple[int, int, int],
    base_t: float,
    records: Sequence[RequestRecord],
    ticks: Sequence[TickSample],
    schedule: LinkSchedule,
    egress_bytes: float,
    reverse_bytes: float,
    end_time: float,
    events: int,
    wall_s: float,
    note: str,
    final_t: float,
) -> ReplayResult:
    arrival = np.array([r.arrival for r in records])
    ready = np.array([r.ready for r in records])
    done = np.array([r.done for r in records])
    rejected = np.array([r.rejected for r in records])
    accepted = ~rejected
    offloaded = np.array([r.target not in ("pd", "") for r in records])
    split: dict[str, int] = {}
    for r in records:
        if r.target not in ("pd", ""):
            split[r.target] = split.get(r.target, 0) + 1
    ttft_all = ready - arrival
    got_ttft = ~np.isnan(ttft_all)
    ttft = ttft_all[got_ttft]
    first, last = float(arrival.min()), float(arrival.max())
    span = last - first
    completed = int((~np.isnan(done)).sum())
    if span > 0:
        lo = first + STEADY_FROM * span
        in_window = (done >= lo) & (done <= last)
        throughput = float(in_window.sum()) / (last - lo)
    else:
        finish = float(np.nanmax(done)) if completed else math.nan
        throughput = completed / (finish - first) if completed and finish > first else math.nan
    inputs = np.array([r.input_tokens for r in records], dtype=np.float64)
    cached = np.array([r.cached_tokens for r in records], dtype=np.float64)
    n_acc = int(accepted.sum())
    tick_t = np.array([k.t for k in ticks]) if ticks else np.zeros(0)
    tick_bytes = np.array([k.egress_bytes for k in ticks]) if ticks else np.zeros(0)
    in_span = (tick_t > first) & (tick_t <= last) if span > 0 else tick_t >= 0
    egress_mean = (
        _bytes_at(tick_t, tick_bytes, last) * 8.0 / span / 1e9
        if span > 0
        else egress_bytes * 8.0 / max(end_time - first, 1e-9) / 1e9
    )
    t_eff = np.array([k.t_effective for k in ticks]) if ticks else np.zeros(0)
    t_fin = t_eff[np.isfinite(t_eff)]
    pred = np.array([r.predicted_ttft for r in records])
    has_pred = got_ttft & np.isfinite(pred)

    def wait(a: str, b: str, mask: np.ndarray) -> float:
        x = np.array([getattr(r, b) - getattr(r, a) for r in records])[mask]
        return _mean(x[~np.isnan(x)])

    decode_wait = np.array([r.decode_start - r.ready for r in records])
    return ReplayResult(
        policy=policy,
        n_prfaas=layout[0],
        n_p=layout[1],
        n_d=layout[2],
        requests=len(records),
        completed=completed,
        rejected=int(rejected.sum()),
        unfinished=len(records) - completed - int(rejected.sum()),
        arrival_rate_rps=(len(records) - 1) / span if span > 0 else math.nan,
        throughput_rps=throughput,
        makespan_s=(float(np.nanmax(done)) if completed else end_time) - first,
        ttft_mean_s=_mean(ttft),
        ttft_p50_s=_pct(ttft, 50),
        ttft_p90_s=_pct(ttft, 90),
        ttft_p99_s=_pct(ttft, 99),
        ttft_max_s=float(ttft.max()) if ttft.size else math.nan,
        offload_fraction=float(offloaded.sum()) / n_acc if n_acc else math.nan,
        cache_hit_rate=float(cached[accepted].sum() / inputs[accepted].sum()) if n_acc else 0.0,
        egress_gbps_mean=egress_mean,
        egress_gbps_peak=max((k.egress_gbps for k in ticks), default=0.0),
        link_util_mean=_mean(np.array([k.utilisation for k in ticks])[in_span]),
        reverse_gb=reverse_bytes / 1e9,
        prfaas_wait_mean_s=wait("queued_at", "prefill_start", offloaded),
        pd_prefill_wait_mean_s=wait("queued_at", "prefill_start", accepted & ~offloaded),
        decode_wait_mean_s=_mean(decode_wait[~np.isnan(decode_wait)]),
        prfaas_waiting_max=max((k.prfaas_waiting for k in ticks), default=0),
        pd_prefill_waiting_max=max((k.pd_prefill_waiting for k in ticks), default=0),
        decode_waiting_max=max((k.decode_waiting for k in ticks), default=0),
        base_t=base_t,
        final_t=final_t,
        t_min=float(t_fin.min()) if t_fin.size else base_t,
        t_mean=float(t_fin.mean()) if t_fin.size else base_t,
        t_max=float(t_fin.max()) if t_fin.size else base_t,
        ttft_prediction_mae_s=_mean(np.abs(pred[has_pred] - ttft_all[has_pred])),
        phases=_phases(arrival, ttft_all, offloaded, rejected, schedule, tick_t, tick_bytes),
        offload_split=dict(sorted(split.items())),
        events=events,
        wall_s=wall_s,
        note=note,
    )


def _bytes_at(tick_t: np.ndarray, tick_bytes: np.ndarray, t: float) -> float:
    """Cumulative egress bytes at ``t``, interpolated between monitor samples."""
    if tick_t.size == 0:
        return 0.0
    return float(np.interp(t, tick_t, tick_bytes))


def _phases(
    arrival: np.ndarray,
    ttft_all: np.ndarray,
    offloaded: np.ndarray,
    rejected: np.ndarray,
    schedule: LinkSchedule,
    tick_t: np.ndarray,
    tick_bytes: np.ndarray,
) -> tuple[PhaseStats, ...]:
    if len(schedule.times) < 2:
        return ()
    last = float(arrival.max())
    out: list[PhaseStats] = []
    bounds = [*schedule.times, math.inf]
    for i, g in enumerate(schedule.gbps):
        lo, hi = bounds[i], bounds[i + 1]
        if lo > last:
            break
        m = (arrival >= lo) & (arrival < hi)
        x = ttft_all[m]
        x = x[~np.isnan(x)]
        acc = int((m & ~rejected).sum())
        end = min(hi, last)
        egress = (
            (_bytes_at(tick_t, tick_bytes, end) - _bytes_at(tick_t, tick_bytes, lo))
            * 8.0
            / (end - lo)
            / 1e9
            if end > lo
            else math.nan
        )
        out.append(
            PhaseStats(
                start_s=lo,
                end_s=hi,
                link_gbps=g,
                arrivals=int(m.sum()),
                rejected=int((m & rejected).sum()),
                ttft_mean_s=_mean(x),
                ttft_p90_s=_pct(x, 90),
                offload_fraction=float((m & offloaded).sum()) / acc if acc else math.nan,
                egress_gbps_mean=egress,
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------- rendering


def _f(x: float, fmt: str = ".2f") -> str:
    return "-" if not math.isfinite(x) else format(x, fmt)


def _tok(x: float) -> str:
    if math.isinf(x):
        return "none"
    if math.isnan(x):
        return "-"
    return f"{x / 1000:.1f}K" if x >= 1000 else f"{x:.0f}"


def render(results: Sequence[ReplayResult]) -> str:
    """A side-by-side table, one column per policy."""
    rows: list[tuple[str, list[str]]] = [
        ("N_prfaas / N_p / N_d", [f"{r.n_prfaas} / {r.n_p} / {r.n_d}" for r in results]),
        ("requests", [str(r.requests) for r in results]),
        (
            "completed / rejected / unfinished",
            [f"{r.completed} / {r.rejected} / {r.unfinished}" for r in results],
        ),
        ("arrival rate (req/s)", [_f(r.arrival_rate_rps, ".3f") for r in results]),
        ("throughput (req/s)", [_f(r.throughput_rps, ".3f") for r in results]),
        ("TTFT mean / P50 (s)", [f"{_f(r.ttft_mean_s)} / {_f(r.ttft_p50_s)}" for r in results]),
        ("TTFT P90 / P99 (s)", [f"{_f(r.ttft_p90_s)} / {_f(r.ttft_p99_s)}" for r in results]),
        ("offload fraction", [_f(100 * r.offload_fraction, ".1f") + "%" for r in results]),
        *(
            [
                (
                    "offloads per PrfaaS cluster",
                    [" / ".join(f"{k} {v}" for k, v in r.offload_split.items()) for r in results],
                )
            ]
            if any(len(r.offload_split) > 1 for r in results)
            else []
        ),
        ("cache hit rate (tokens)", [_f(100 * r.cache_hit_rate, ".1f") + "%" for r in results]),
        (
            "egress mean / peak (Gbps)",
            [f"{_f(r.egress_gbps_mean, '.1f')} / {_f(r.egress_gbps_peak, '.1f')}" for r in results],
        ),
        ("link utilisation (mean)", [_f(100 * r.link_util_mean, ".1f") + "%" for r in results]),
        (
            "threshold t base / mean / max",
            [f"{_tok(r.base_t)} / {_tok(r.t_mean)} / {_tok(r.t_max)}" for r in results],
        ),
        (
            "wait PrfaaS / PD-P / decode (s)",
            [
                f"{_f(r.prfaas_wait_mean_s)} / {_f(r.pd_prefill_wait_mean_s)} / "
                f"{_f(r.decode_wait_mean_s)}"
                for r in results
            ],
        ),
        (
            "max queued PrfaaS / PD-P / decode",
            [
                f"{r.prfaas_waiting_max} / {r.pd_prefill_waiting_max} / {r.decode_waiting_max}"
                for r in results
            ],
        ),
        ("TTFT prediction MAE (s)", [_f(r.ttft_prediction_mae_s) for r in results]),
    ]
    phase_count = max((len(r.phases) for r in results), default=0)
    for i in range(phase_count):
        label = ""
        for r in results:
            if i < len(r.phases):
                p = r.phases[i]
                label = f"from {p.start_s:g}s @ {p.link_gbps:g} Gbps"
        rows.append(
            (
                f"{label}: TTFT mean / P90 (s)",
                [
                    f"{_f(r.phases[i].ttft_mean_s)} / {_f(r.phases[i].ttft_p90_s)}"
                    if i < len(r.phases)
                    else "-"
                    for r in results
                ],
            )
        )
        rows.append(
            (
                f"{label}: offload / egress",
                [
                    f"{_f(100 * r.phases[i].offload_fraction, '.1f')}% / "
                    f"{_f(r.phases[i].egress_gbps_mean, '.1f')} Gbps"
                    if i < len(r.phases)
                    else "-"
                    for r in results
                ],
            )
        )
    head = [""] + [r.policy for r in results]
    width0 = max(len(k) for k, _ in rows)
    widths = [max(len(head[j + 1]), *(len(v[j]) for _, v in rows)) for j in range(len(results))]
    lines = [" " * width0 + "".join(f"  {h:>{w}}" for h, w in zip(head[1:], widths, strict=True))]
    for k, vals in rows:
        lines.append(
            f"{k:<{width0}}" + "".join(f"  {v:>{w}}" for v, w in zip(vals, widths, strict=True))
        )
    notes = [f"{r.policy}: {r.note}" for r in results if r.note]
    return "\n".join(lines + notes)


__all__ = ["PhaseStats", "ReplayResult", "RequestRecord", "TickSample", "render", "summarise"]
