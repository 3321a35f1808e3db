"""The PrfaaS-PD steady-state throughput model, equations (3)-(6) of the PrfaaS paper (3.4.1).

Three stages form a converging pipeline: PrfaaS prefill takes the fraction ``p = P(L > t)`` of
requests, PD-P prefill takes the rest, PD-D decodes everything. Each stage has a capacity in
requests per second (a Theta); the system sustains ``Lambda_max``, the largest arrival rate no
stage is overrun by. Following the paper, each side of the split is represented by its mean
length (``l_long``, ``l_short``) when evaluating prefill time.

One deliberate refinement: the PrfaaS egress cap in eq. (3) divides the link by the *expected*
KV bytes of an offloaded request, ``E[S_kv(L) | L > t]``, rather than ``S_kv(l_long)``, so that
the reported egress (``Lambda * p * E[S_kv | L > t]``) can never exceed the link the model says
it fits in. For near-linear KV curves the two differ by well under 1%.

Everything here is a pure function of a Profile and explicit numbers; the vectorised
``stage_arrays`` exists so the planner can sweep thousands of thresholds in a millisecond.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt
from xdc.scheduler.profile import FloatArray, InstanceProfile, Profile, Workload

BOTTLENECKS = ("prfaas-compute", "prfaas-egress", "pd-prefill", "pd-decode")


@dataclass(frozen=True)
class SplitStats:
    """How threshold ``t`` splits the workload.

    ``p = P(L > t)``; ``l_long = E[L | L > t]`` (0 when nothing is offloaded);
    ``l_short = E[L | L <= t]`` (0 when everything is offloaded).
    """

    p: float
    l_long: float
    l_short: float


@dataclass(frozen=True)
class ModelResult:
    """Eq. (3)-(6) evaluated at one operating point.

    ``t`` is the routing threshold in uncached tokens: ``L > t`` goes to PrfaaS, so ``0`` means
    offload everything and ``inf`` offload nothing. ``offload_fraction`` is the fraction of
    *requests* offloaded (= ``p``); ``offload_token_fraction`` the fraction of prefill *tokens*.
    ``egress_gbps_used`` is the mean PrfaaS egress at ``lambda_max``:
    ``lambda_max * E[S_kv(L); L > t] * 8 / 1e9``.
    """

    t: float
    p: float
    l_long: float
    l_short: float
    theta_prfaas: float
    theta_pdp: float
    theta_pdd: float
    lambda_max: float
    bottleneck: str
    egress_gbps_used: float
    offload_fraction: float
    offload_token_fraction: float
    n_prfaas: int
    n_p: int
    n_d: int
    bandwidth_gbps: float

    def to_dict(self) -> dict[str, float | int | str | None]:
        """JSON-safe: infinities become None."""
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in asdict(self).items()
        }


def _conditional(mass: FloatArray, moment: FloatArray) -> FloatArray:
    with np.errstate(divide="ignore", invalid="ignore"):
        out: FloatArray = np.where(mass > 0, moment / np.where(mass > 0, mass, 1.0), 0.0)
    return out


@dataclass(frozen=True)
class StageArrays:
    """Per-threshold quantities that do not depend on instance counts (vectorised over t)."""

    t: FloatArray
    p: FloatArray
    l_long: FloatArray
    l_short: FloatArray
    prefill_long_s: FloatArray  # T_prefill^prfaas(l_long)
    prefill_short_s: FloatArray  # T_prefill^pd(l_short)
    kv_long_bytes: FloatArray  # E[S_kv(L) | L > t]
    kv_offloaded_bytes: FloatArray  # E[S_kv(L); L > t] = p * kv_long_bytes


def split_arrays(
    workload: Workload,
    t: FloatArray,
    cdf: FloatArray | None = None,
    pmean: FloatArray | None = None,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """``(p, l_long, l_short)`` for every threshold in ``t``; cached F/M may be passed in."""
    f = workload.cdf(t) if cdf is None else cdf
    m = workload.partial_mean(t) if pmean is None else pmean
    mean = workload.mean
    p: FloatArray = np.clip(1.0 - f, 0.0, 1.0)
    l_long = _conditional(p, np.maximum(mean - m, 0.0))
    l_short = _conditional(1.0 - p, m)
    return p, l_long, l_short


def split_stats(workload: Workload, t: float) -> SplitStats:
    """Eq. inputs for threshold ``t``: ``p``, ``l_long`` and ``l_short``."""
    p, l_long, l_short = split_arrays(workload, np.array([float(t)]))
    return SplitStats(float(p[0]), float(l_long[0]), float(l_short[0]))


def offloaded_expectation(
    workload: Workload, inst: InstanceProfile, t: FloatArray, cdf_t: FloatArray, pmean_t: FloatArray
) -> FloatArray:
    """``E[S_kv(L); L > t]`` exactly, using the KV curve's affine pieces.

    On a piece ``a + b*x`` over ``(lo, hi]`` the contribution is ``a * P(...) + b * E[L; ...]``
    over the part of the piece above ``t``; both come from the workload's F and M.
    """
    pieces = [q for q in inst.kv_pieces if q.intercept != 0.0 or q.slope != 0.0]
    lo = np.array([q.lo for q in pieces])[:, None]
    hi = np.array([q.hi for q in pieces])[:, None]
    a = np.array([q.intercept for q in pieces])[:, None]
    b = np.array([q.slope for q in pieces])[:, None]
    f_lo, m_lo = workload.cdf(lo), workload.partial_mean(lo)
    f_hi, m_hi = workload.cdf(hi), workload.partial_mean(hi)
    above = t[None, :] > lo
    mass = np.maximum(f_hi - np.where(above, cdf_t[None, :], f_lo), 0.0)
    moment = np.maximum(m_hi - np.where(above, pmean_t[None, :], m_lo), 0.0)
    total: FloatArray = np.where(t[None, :] < hi, a * mass + b * moment, 0.0).sum(axis=0)
    return total


def stage_arrays(
    profile: Profile,
    t: npt.ArrayLike,
    cdf: FloatArray | None = None,
    pmean: FloatArray | None = None,
) -> StageArrays:
    """Everything eq. (3)-(4) need at each threshold, computed once for all instance splits."""
    wl = profile.workload
    ta = np.asarray(t, dtype=np.float64)
    f = wl.cdf(ta) if cdf is None else cdf
    m = wl.partial_mean(ta) if pmean is None else pmean
    p, l_long, l_short = split_arrays(wl, ta, f, m)
    offloaded = offloaded_expectation(wl, profile.prfaas, ta, f, m)
    return StageArrays(
        t=ta,
        p=p,
        l_long=l_long,
        l_short=l_short,
        prefill_long_s=profile.prfaas.prefill_times(l_long),
        prefill_short_s=profile.pd.prefill_times(l_short),
        kv_long_bytes=_conditional(p, offloaded),
        kv_offloaded_bytes=offloaded,
    )


def _rate(n: float, seconds: float) -> float:
    if n <= 0:
        return 0.0
    return math.inf if seconds <= 0 else n / seconds


def fleet_shares(
    profile: Profile, n_prfaas: float, bandwidth_bps: float
) -> list[tuple[float, float]]:
    """``(instances, egress bits/s)`` per PrfaaS cluster for a total count and bandwidth.

    Totals equal to the profile's give each cluster exactly its own figures (pass a profile
    from ``Profile.with_fleet`` to model live per-cluster values); other totals are spread in
    proportion to the profile's, so a one-number "what if the link were X" still works.
    """
    fleet = profile.fleet
    if len(fleet) == 1:
        return [(float(n_prfaas), float(bandwidth_bps))]
    n_tot = sum(c.instances for c in fleet)
    bw_tot = sum(c.egress_gbps for c in fleet)
    k = len(fleet)
    return [
        (
            n_prfaas * (c.instances / n_tot if n_tot > 0 else 1.0 / k),
            bandwidth_bps * (c.egress_gbps / bw_tot if bw_tot > 0 else 1.0 / k),
        )
        for c in fleet
    ]


def prfaas_caps(
    profile: Profile,
    n: float,
    l_long: float,
    bandwidth_bps: float,
    *,
    kv_bytes: float | None = None,
) -> tuple[float, float]:
    """Eq. (3) over the PrfaaS fleet, split into its compute-bound and egress-bound parts.

    Each PrfaaS cluster ``c`` sustains ``min(N_c / T_prefill(l_long), B_c / S_kv)`` requests/s
    (its own instances behind its own link), and the router splits offloaded traffic between
    clusters in proportion to exactly that, so the fleet sustains the sum. Returned as
    ``(sum over compute-bound clusters, sum over egress-bound clusters)``; with one cluster
    that is ``(compute, inf)`` or ``(inf, egress)``, whose min is the paper's eq. (3).
    """
    t_pre = profile.prfaas.prefill_time(l_long)
    s_kv = profile.prfaas.kv_size(l_long) if kv_bytes is None else kv_bytes
    compute_part = egress_part = 0.0
    compute_any = egress_any = False
    for n_c, bps_c in fleet_shares(profile, n, bandwidth_bps):
        compute = _rate(n_c, t_pre)
        egress = _rate(bps_c, 8.0 * s_kv)
        if compute <= egress:
            compute_part += compute
            compute_any = True
        else:
            egress_part += egress
            egress_any = True
    if not egress_any:
        return compute_part, math.inf
    if not compute_any:
        return math.inf, egress_part
    total = compute_part + egress_part
    # mixed fleet: report the total under the part that binds more of it
    return (total, math.inf) if compute_part >= egress_part else (math.inf, total)


def theta_prfaas(
    profile: Profile,
    n: float,
    l_long: float,
    bandwidth_bps: float,
    *,
    kv_bytes: float | None = None,
) -> float:
    """Eq. (3): PrfaaS throughput, the slower of compute and egress (layer-wise pipelined),
    summed over PrfaaS clusters (see ``prfaas_caps``).

    ``bandwidth_bps`` is in bits/s; ``kv_bytes`` overrides ``S_kv(l_long)`` (see module doc).
    """
    return min(prfaas_caps(profile, n, l_long, bandwidth_bps, kv_bytes=kv_bytes))


def theta_pdp(profile: Profile, n_p: int, l_short: float) -> float:
    """Eq. (4): PD-P throughput; intra-cluster RDMA is not the bottleneck."""
    return _rate(n_p, profile.pd.prefill_time(l_short))


def theta_pdd(profile: Profile, n_d: int) -> float:
    """Eq. (5): ``N_d * BS_max / (T_decode * L_out)``, folded into the per-instance rate."""
    return max(n_d, 0) * profile.pd.decode_rate_rps


def stage_limits(
    theta_prfaas: float, theta_pdp: float, theta_pdd: float, p: float
) -> tuple[float, float, float]:
    """The three terms of eq. (6); a stage that receives no requests does not limit (inf)."""
    a = theta_prfaas / p if p > 0 else math.inf
    b = theta_pdp / (1.0 - p) if p < 1 else math.inf
    return a, b, theta_pdd


def lambda_max(theta_prfaas: float, theta_pdp: float, theta_pdd: float, p: float) -> float:
    """Eq. (6): ``min(Theta_prfaas / p, Theta_pd-p / (1 - p), Theta_pd-d)``."""
    return min(stage_limits(theta_prfaas, theta_pdp, theta_pdd, p))


def evaluate(
    profile: Profile,
    t: float,
    n_prfaas: int,
    n_p: int,
    n_d: int,
    bandwidth_gbps: float | None = None,
) -> ModelResult:
    """The model at threshold ``t`` with the given instance counts.

    ``bandwidth_gbps`` defaults to the profile's egress; pass the live figure to ask what the
    current link supports.
    """
    if min(n_prfaas, n_p, n_d) < 0:
        raise ValueError(f"instance counts must be >= 0, got {n_prfaas}/{n_p}/{n_d}")
    bw = profile.egress_gbps if bandwidth_gbps is None else float(bandwidth_gbps)
    if not bw >= 0:
        raise ValueError(f"bandwidth_gbps: must be >= 0, got {bw}")
    if math.isnan(t) or t < 0:
        raise ValueError(f"t: must be >= 0 (0 = offload all, inf = none), got {t}")
    s = stage_arrays(profile, np.array([float(t)]))
    return result_at(profile, s, 0, n_prfaas, n_p, n_d, bw)


def result_at(
    profile: Profile,
    s: StageArrays,
    i: int,
    n_prfaas: int,
    n_p: int,
    n_d: int,
    bandwidth_gbps: float,
) -> ModelResult:
    """A ModelResult for index ``i`` of precomputed stage arrays (shared with the planner)."""
    p, l_long, l_short = float(s.p[i]), float(s.l_long[i]), float(s.l_short[i])
    compute, egress = prfaas_caps(
        profile, n_prfaas, l_long, bandwidth_gbps * 1e9, kv_bytes=float(s.kv_long_bytes[i])
    )
    th_prfaas = min(compute, egress)
    th_pdp = theta_pdp(profile, n_p, l_short)
    th_pdd = theta_pdd(profile, n_d)
    a, b, c = stage_limits(th_prfaas, th_pdp, th_pdd, p)
    lam = min(a, b, c)
    if lam == a:
        neck = "prfaas-compute" if compute <= egress else "prfaas-egress"
    else:
        neck = "pd-prefill" if lam == b else "pd-decode"
    mean = profile.workload.mean
    return ModelResult(
        t=float(s.t[i]),
        p=p,
        l_long=l_long,
        l_short=l_short,
        theta_prfaas=th_prfaas,
        theta_pdp=th_pdp,
        theta_pdd=th_pdd,
        lambda_max=lam,
        bottleneck=neck,
        egress_gbps_used=lam * float(s.kv_offloaded_bytes[i]) * 8.0 / 1e9,
        offload_fraction=p,
        offload_token_fraction=p * l_long / mean if mean > 0 else 0.0,
        n_prfaas=n_prfaas,
        n_p=n_p,
        n_d=n_d,
        bandwidth_gbps=bandwidth_gbps,
    )
