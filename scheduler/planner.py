"""Throughput-optimal configuration (PrfaaS 3.4.2): pick ``t`` and ``N_p / N_d``.

The paper searches a 2-D grid. Here the threshold axis is vectorised: for each threshold the
quantities of eq. (3)-(4) that do not depend on instance counts are computed once, after which
every ``N_p`` split is a few array operations. On a continuous workload the best grid point is
then refined by bisection on eq. (7) (``Theta_prfaas / p = Theta_pd-p / (1 - p)``), whose two
sides move in opposite directions with ``t``, so the reported ``t`` is the balance point rather
than the nearest grid line. Ties in ``Lambda_max`` (e.g. a decode-bound plateau over a range of
``t``) go to the candidate closest to balancing eq. (7) and then eq. (8).

Kept fast (about a millisecond per solve) because the router re-solves on a timer and when the
link degrades (``solve(profile, bandwidth_gbps=live)``), and the short-term loop asks for just
the threshold with the split held (``threshold_for_bandwidth``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from xdc.scheduler.model import (
    ModelResult,
    StageArrays,
    evaluate,
    fleet_shares,
    result_at,
    stage_arrays,
)
from xdc.scheduler.profile import FloatArray, Profile

# Relative tolerance under which two Lambda_max values count as a tie.
_TIE = 1e-9
_BISECT_STEPS = 60
# Splits whose grid optimum is within this fraction of the best are refined before choosing.
_REFINE_WITHIN = 0.02


@dataclass(frozen=True)
class Plan:
    """The optimum plus the two baselines the paper compares it with (Table 6)."""

    best: ModelResult
    n_prfaas: int
    n_p: int
    n_d: int
    bandwidth_gbps: float
    homogeneous: ModelResult
    naive: ModelResult

    @property
    def t(self) -> float:
        return self.best.t

    @property
    def lambda_max(self) -> float:
        return self.best.lambda_max

    @property
    def vs_homogeneous(self) -> float:
        return _ratio(self.best.lambda_max, self.homogeneous.lambda_max)

    @property
    def vs_naive(self) -> float:
        return _ratio(self.best.lambda_max, self.naive.lambda_max)

    def to_dict(self) -> dict[str, object]:
        return {
            "bandwidth_gbps": self.bandwidth_gbps,
            "prfaas_pd": self.best.to_dict(),
            "homogeneous_pd": self.homogeneous.to_dict(),
            "naive_heterogeneous": self.naive.to_dict(),
            "ratio_vs_homogeneous": {
                "prfaas_pd": self.vs_homogeneous,
                "homogeneous_pd": 1.0,
                "naive_heterogeneous": _ratio(self.naive.lambda_max, self.homogeneous.lambda_max),
            },
            "prfaas_pd_vs_naive": self.vs_naive,
        }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def _candidates(profile: Profile, t_grid: Sequence[float] | None) -> StageArrays:
    """Thresholds to try: 0 (offload all), the grid, inf (offload none)."""
    if t_grid is not None:
        t = np.asarray(sorted(float(x) for x in t_grid), dtype=np.float64)
        if t.size and (np.isnan(t).any() or t[0] < 0):
            raise ValueError("t_grid: thresholds must be >= 0")
        return stage_arrays(profile, t)
    g = profile.workload.threshold_grid
    wl = profile.workload
    t = np.concatenate([[0.0], g.t, [math.inf]])
    cdf = np.concatenate([[0.0], g.cdf, [1.0]])
    pmean = np.concatenate([[0.0], g.partial_mean, [wl.mean]])
    return stage_arrays(profile, t, cdf, pmean)


def _prfaas_theta(profile: Profile, s: StageArrays, bw_gbps: float) -> FloatArray:
    """Eq. (3) at every threshold (independent of the PD split), summed over PrfaaS clusters:
    each is limited by its own instances and its own link (``model.prfaas_caps``)."""
    out: FloatArray = np.zeros_like(s.t)
    for n, bps in fleet_shares(profile, profile.n_prfaas, bw_gbps * 1e9):
        if n <= 0:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            compute = np.where(s.prefill_long_s > 0, n / s.prefill_long_s, math.inf)
            egress = np.where(s.kv_long_bytes > 0, bps / (8.0 * s.kv_long_bytes), math.inf)
        out = out + np.minimum(compute, egress)
    return out


def _limits(
    profile: Profile, s: StageArrays, th_prfaas: FloatArray, n_p: int, n_d: int
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Eq. (6) terms at every threshold for one split, and the eq. (7)/(8) imbalance score."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(s.p > 0, th_prfaas / s.p, math.inf)
        th_pdp = (
            np.where(s.prefill_short_s > 0, n_p / s.prefill_short_s, math.inf)
            if n_p > 0
            else np.zeros_like(s.t)
        )
        b = np.where(s.p < 1, th_pdp / (1.0 - s.p), math.inf)
        th_pdd = n_d * profile.pd.decode_rate_rps
        lam = np.minimum(np.minimum(a, b), th_pdd)
        eq7 = np.abs(np.log(a / b))
        eq8 = np.abs(np.log((np.where(s.p > 0, th_prfaas, 0.0) + th_pdp) / th_pdd))
        score = np.nan_to_num(eq7, nan=math.inf, posinf=math.inf) + np.nan_to_num(
            eq8, nan=math.inf, posinf=math.inf
        )
    return lam, score, a - b


def _pick(lam: FloatArray, score: FloatArray) -> int:
    """Index of the best Lambda_max, ties to the most balanced (smallest score)."""
    top = float(lam.max())
    tied = lam >= top - _TIE * max(abs(top), 1e-300)
    masked = np.where(tied, score, math.inf)
    return int(np.argmin(masked)) if np.isfinite(masked).any() else int(np.argmax(tied))


def _refine(
    profile: Profile, s: StageArrays, i: int, n_p: int, n_d: int, bw_gbps: float
) -> StageArrays | None:
    """Bisect eq. (7) between grid neighbours of ``i``; the balance point as 1-entry arrays."""
    if profile.workload.kind != "lognormal" or not (0 < i < len(s.t) - 1):
        return None
    lo, hi = float(s.t[i - 1]), float(s.t[i + 1])
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0:
        return None

    def gap(t: float) -> tuple[float, StageArrays]:
        one = stage_arrays(profile, np.array([t]))
        _, _, diff = _limits(profile, one, _prfaas_theta(profile, one, bw_gbps), n_p, n_d)
        return float(diff[0]), one

    g_lo, _ = gap(lo)
    g_hi, _ = gap(hi)
    if not (math.isfinite(g_lo) and math.isfinite(g_hi)) or (g_lo > 0) == (g_hi > 0):
        return None
    best: StageArrays | None = None
    for _ in range(_BISECT_STEPS):
        mid = math.sqrt(lo * hi)
        g_mid, best = gap(mid)
        if (g_mid > 0) == (g_lo > 0):
            lo, g_lo = mid, g_mid
        else:
            hi = mid
        if hi - lo <= 1e-6 * hi:
            break
    return best


def _best_t(
    profile: Profile, s: StageArrays, n_p: int, n_d: int, bw_gbps: float, refine: bool
) -> tuple[StageArrays, int, float, float]:
    """Best threshold for a fixed split: (arrays, index, Lambda_max, imbalance score)."""
    lam, score, _ = _limits(profile, s, _prfaas_theta(profile, s, bw_gbps), n_p, n_d)
    i = _pick(lam, score)
    if refine:
        one = _refine(profile, s, i, n_p, n_d, bw_gbps)
        if one is not None:
            lam1, score1, _ = _limits(profile, one, _prfaas_theta(profile, one, bw_gbps), n_p, n_d)
            if _pick(np.array([lam[i], lam1[0]]), np.array([score[i], score1[0]])) == 1:
                return one, 0, float(lam1[0]), float(score1[0])
    return s, i, float(lam[i]), float(score[i])


def _bandwidth(profile: Profile, bandwidth_gbps: float | None) -> float:
    bw = profile.egress_gbps if bandwidth_gbps is None else float(bandwidth_gbps)
    if not bw >= 0:
        raise ValueError(f"bandwidth_gbps: must be >= 0, got {bandwidth_gbps}")
    return bw


def solve(
    profile: Profile,
    bandwidth_gbps: float | None = None,
    t_grid: Sequence[float] | None = None,
) -> Plan:
    """Maximise eq. (6) over ``t`` and ``N_p + N_d = n_pd`` (``N_d >= 1``).

    ``N_p = 0`` is allowed (it is the optimum only when everything is offloaded). With an
    explicit ``t_grid`` exactly those thresholds are tried (plus none of the defaults, and no
    refinement), which reproduces the paper's exhaustive grid.
    """
    bw = _bandwidth(profile, bandwidth_gbps)
    s = _candidates(profile, t_grid)
    if s.t.size == 0:
        raise ValueError("t_grid: need at least one threshold")
    # Grid pass over every split, then refine the splits within reach of the best one.
    coarse = [
        _best_t(profile, s, n_p, profile.n_pd - n_p, bw, False) for n_p in range(profile.n_pd)
    ]
    top = max(c[2] for c in coarse)
    best: tuple[float, float, int, StageArrays, int] | None = None
    for n_p, (arr, i, lam, score) in enumerate(coarse):
        if t_grid is None and lam >= top * (1 - _REFINE_WITHIN):
            arr, i, lam, score = _best_t(profile, s, n_p, profile.n_pd - n_p, bw, True)
        if (
            best is None
            or lam > best[0] * (1 + _TIE)
            or (lam >= best[0] * (1 - _TIE) and score < best[1])
        ):
            best = (lam, score, n_p, arr, i)
    assert best is not None
    _, _, n_p, arr, i = best
    n_d = profile.n_pd - n_p
    result = result_at(profile, arr, i, profile.n_prfaas, n_p, n_d, bw)
    return Plan(
        best=result,
        n_prfaas=profile.n_prfaas,
        n_p=n_p,
        n_d=n_d,
        bandwidth_gbps=bw,
        homogeneous=homogeneous_baseline(profile),
        naive=naive_heterogeneous(profile, bw),
    )


def threshold_for_bandwidth(
    profile: Profile, n_p: int, n_d: int, bandwidth_gbps: float | Sequence[float]
) -> float:
    """Best ``t`` for the live link with the PD split held (the short-term loop).

    ``bandwidth_gbps`` is one figure for the whole PrfaaS egress (spread over the clusters in
    proportion to the profile's) or one per PrfaaS cluster, in the profile's order.
    Returns ``inf`` when offloading nothing is best (e.g. the link is down) and ``0`` when
    offloading everything is.
    """
    if n_p < 0 or n_d < 0:
        raise ValueError(f"instance counts must be >= 0, got {n_p}/{n_d}")
    if not isinstance(bandwidth_gbps, int | float):
        caps = [float(x) for x in bandwidth_gbps]
        fleet = profile.fleet
        if len(caps) != len(fleet):
            raise ValueError(f"need {len(fleet)} link capacities, got {len(caps)}")
        if not all(x >= 0 and math.isfinite(x) for x in caps):
            raise ValueError(f"bandwidth_gbps: must be finite and >= 0, got {caps}")
        profile = profile.with_fleet(
            egress_gbps={c.name: x for c, x in zip(fleet, caps, strict=True)}
        )
        bandwidth_gbps = profile.egress_gbps
    bw = _bandwidth(profile, bandwidth_gbps)
    arr, i, _, _ = _best_t(profile, _candidates(profile, None), n_p, n_d, bw, refine=True)
    return float(arr.t[i])


@dataclass(frozen=True, slots=True)
class OffloadShape:
    """What one offloaded request costs a PrfaaS cluster at the current threshold: prefill
    seconds of one instance and KV bits over the link (PrfaaS eq. 3 at ``l_long``)."""

    prefill_s: float
    kv_bits: float


def offload_shape(profile: Profile, t: float) -> OffloadShape:
    """Prefill seconds and KV bits of the mean offloaded request at threshold ``t``
    (``T_prefill(l_long)``, ``8 E[S_kv | L > t]``): what sizes each PrfaaS cluster's share.
    At a ``t`` that offloads nothing, those of the mean request (the shares still need one)."""
    s = stage_arrays(profile, np.array([float(t)]))
    if float(s.p[0]) > 0:
        return OffloadShape(float(s.prefill_long_s[0]), float(s.kv_long_bytes[0]) * 8.0)
    mean = profile.workload.mean
    return OffloadShape(profile.prfaas.prefill_time(mean), profile.prfaas.kv_size(mean) * 8.0)


def homogeneous_baseline(profile: Profile) -> ModelResult:
    """All ``homogeneous_instances`` of the PD type, no PrfaaS, best ``N_p / N_d`` split."""
    n = profile.homogeneous_instances
    s = stage_arrays(profile, np.array([math.inf]))
    results = [result_at(profile, s, 0, 0, n_p, n - n_p, 0.0) for n_p in range(1, n)]
    top = max(r.lambda_max for r in results)
    tied = [r for r in results if r.lambda_max >= top * (1 - _TIE)]
    return min(tied, key=lambda r: abs(math.log(r.theta_pdp / r.theta_pdd)))


def naive_heterogeneous(profile: Profile, bandwidth_gbps: float | None = None) -> ModelResult:
    """Every prefill on the PrfaaS instances (``t = 0``), every PD instance decodes."""
    bw = _bandwidth(profile, bandwidth_gbps)
    return evaluate(profile, 0.0, profile.n_prfaas, 0, profile.n_pd, bandwidth_gbps=bw)
