"""Eq. (3)-(6): split statistics, stage throughputs, Lambda_max, bottleneck, egress."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.model import (
    evaluate,
    lambda_max,
    offloaded_expectation,
    split_stats,
    theta_pdd,
    theta_pdp,
    theta_prfaas,
)
from xdc.scheduler.profile import Profile, Workload, interpolate, load_profile

from tests.paths import REPO

ROOT = REPO
CASE = load_profile(ROOT / "deploy/profiles/prfaas-case-study.toml")
DEMO = load_profile(ROOT / "deploy/profiles/small-demo.toml")


def _grid_moments(mu: float, sigma: float, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    x = np.geomspace(lo, hi, 400_001)
    pdf = np.exp(-((np.log(x) - mu) ** 2) / (2 * sigma**2)) / (x * sigma * math.sqrt(2 * math.pi))
    return x, pdf / np.trapezoid(pdf, x)


@pytest.mark.parametrize("t", [300.0, 4000.0, 19400.0, 45000.0, 100000.0])
def test_split_stats_match_numeric_integration(t: float) -> None:
    wl = CASE.workload
    x, pdf = _grid_moments(9.9, 1.0, 128, 131072)
    long = x > t
    p = np.trapezoid(pdf[long], x[long])
    l_long = np.trapezoid(x[long] * pdf[long], x[long]) / p
    l_short = np.trapezoid(x[~long] * pdf[~long], x[~long]) / (1 - p)
    s = split_stats(wl, t)
    assert s.p == pytest.approx(p, abs=2e-5)
    assert s.l_long == pytest.approx(l_long, rel=2e-4)
    assert s.l_short == pytest.approx(l_short, rel=2e-4)


def test_split_stats_of_the_papers_threshold() -> None:
    # Paper 4.3.1: t = 19.4K offloads 49.6% of requests, E[L | L > t] ~ 44K.
    s = split_stats(CASE.workload, 19400)
    assert s.p == pytest.approx(0.496, abs=0.001)
    assert 43_000 < s.l_long < 46_000


def test_split_stats_edges_and_empirical_exactness() -> None:
    wl = DEMO.workload  # lengths 1000, 2000, 3000, 4000, 10000
    s = split_stats(wl, 3000)
    assert (s.p, s.l_long, s.l_short) == pytest.approx((0.4, 7000.0, 2000.0))
    everything = split_stats(wl, 0.0)
    assert (everything.p, everything.l_long, everything.l_short) == (1.0, 4000.0, 0.0)
    nothing = split_stats(wl, math.inf)
    assert (nothing.p, nothing.l_long, nothing.l_short) == (0.0, 0.0, 4000.0)
    assert split_stats(wl, 10000).p == 0.0


def test_stage_formulas_by_hand() -> None:
    # small-demo: PrfaaS T(l) = 0.1 + 1e-4 l, S(l) = 1e5 l bytes; PD T(l) = 0.2 + 2e-4 l.
    assert theta_prfaas(DEMO, 2, 7000, 10e9) == pytest.approx(min(2 / 0.8, 10e9 / (8 * 7e8)))
    assert theta_prfaas(DEMO, 2, 7000, 100e9) == pytest.approx(2 / 0.8)  # compute-bound
    assert theta_prfaas(DEMO, 2, 7000, 10e9, kv_bytes=5e8) == pytest.approx(2.5)
    assert theta_prfaas(DEMO, 0, 7000, 10e9) == 0.0
    assert theta_pdp(DEMO, 3, 2000) == pytest.approx(3 / 0.6)
    assert theta_pdd(DEMO, 4) == pytest.approx(4 * 1.2)
    assert lambda_max(2.0, 3.0, 10.0, p=0.4) == pytest.approx(min(2 / 0.4, 3 / 0.6, 10))
    # A stage that receives nothing does not limit.
    assert lambda_max(0.0, 3.0, 10.0, p=0.0) == pytest.approx(3.0)
    assert lambda_max(2.0, 0.0, 10.0, p=1.0) == pytest.approx(2.0)


def test_evaluate_small_demo_by_hand() -> None:
    r = evaluate(DEMO, 3000, n_prfaas=2, n_p=2, n_d=4)
    assert (r.p, r.l_long, r.l_short) == pytest.approx((0.4, 7000.0, 2000.0))
    assert r.theta_prfaas == pytest.approx(10e9 / (8 * 7e8))  # 1.786, egress-bound
    assert r.theta_pdp == pytest.approx(2 / 0.6)
    assert r.theta_pdd == pytest.approx(4.8)
    assert r.lambda_max == pytest.approx(10e9 / (8 * 7e8) / 0.4)  # 4.464
    assert r.bottleneck == "prfaas-egress"
    # Egress at Lambda_max: Lambda * p * E[S | L > t] * 8 = exactly the link when egress-bound.
    assert r.egress_gbps_used == pytest.approx(10.0)
    assert r.offload_fraction == r.p
    assert r.offload_token_fraction == pytest.approx((4000 + 10000) / 20000)
    assert (r.n_prfaas, r.n_p, r.n_d, r.bandwidth_gbps) == (2, 2, 4, 10.0)


@pytest.mark.parametrize(
    ("kw", "neck"),
    [
        ({"n_prfaas": 2, "n_p": 9, "n_d": 9, "bandwidth_gbps": 100.0}, "prfaas-compute"),
        ({"n_prfaas": 2, "n_p": 2, "n_d": 4, "bandwidth_gbps": 1.0}, "prfaas-egress"),
        ({"n_prfaas": 9, "n_p": 1, "n_d": 9, "bandwidth_gbps": 100.0}, "pd-prefill"),
        ({"n_prfaas": 9, "n_p": 9, "n_d": 1, "bandwidth_gbps": 100.0}, "pd-decode"),
    ],
)
def test_bottleneck_is_the_binding_stage(kw: dict[str, float], neck: str) -> None:
    r = evaluate(DEMO, 3000, **kw)  # type: ignore[arg-type]
    assert r.bottleneck == neck
    limits = {
        "prfaas-compute": r.theta_prfaas / r.p,
        "prfaas-egress": r.theta_prfaas / r.p,
        "pd-prefill": r.theta_pdp / (1 - r.p),
        "pd-decode": r.theta_pdd,
    }
    assert r.lambda_max == pytest.approx(min(limits.values()))
    assert r.lambda_max == pytest.approx(limits[neck])
    others = [v for k, v in limits.items() if not k.startswith(neck[:6])]
    assert all(r.lambda_max < v for v in others)


def test_case_study_point_matches_table_6_column() -> None:
    # Table 6 PrfaaS-PD at the paper's own operating point t = 19.4K, 4 / 3 / 5.
    r = evaluate(CASE, 19400, 4, 3, 5)
    assert r.theta_pdp == pytest.approx(1.64, abs=0.005)  # the H20 curve was derived from it
    assert r.theta_pdd == pytest.approx(3.91, abs=0.005)
    assert r.theta_prfaas == pytest.approx(1.61, rel=0.03)  # Table 5 interpolation: 1.58
    assert r.lambda_max == pytest.approx(3.24, rel=0.03)
    assert r.bottleneck == "prfaas-compute"


def test_offloaded_kv_bytes_are_an_exact_expectation() -> None:
    # E[S_kv(L); L > t] against brute-force integration of the interpolated curve.
    wl, inst = CASE.workload, CASE.prfaas
    x, pdf = _grid_moments(9.9, 1.0, 128, 131072)
    s = interpolate(inst.lengths, inst.kv_bytes, x)
    ts = np.array([0.0, 128.0, 900.0, 19400.0, 70000.0, 131072.0, math.inf])
    got = offloaded_expectation(wl, inst, ts, wl.cdf(ts), wl.partial_mean(ts))
    for t, value in zip(ts, got, strict=True):
        keep = x > t
        want = np.trapezoid((s * pdf)[keep], x[keep]) if keep.sum() > 1 else 0.0
        assert value == pytest.approx(want, rel=1e-4, abs=1.0)


def test_kv_curve_clipped_at_zero_is_integrated_as_zero() -> None:
    # KV table whose left extrapolation goes negative below 500 tokens.
    inst = dataclasses.replace(
        CASE.prfaas, lengths=(1000, 2000), prefill_s=(1.0, 2.0), kv_bytes=(100.0, 300.0)
    )
    wl = Workload.empirical([100, 400, 600, 2500], output_tokens=1)
    t = np.array([0.0])
    got = offloaded_expectation(wl, inst, t, wl.cdf(t), wl.partial_mean(t))
    assert got[0] == pytest.approx((0 + 0 + 20 + 400) / 4)


@settings(max_examples=40, deadline=None)
@given(bw=st.floats(0.01, 400), t=st.floats(0, 131072))
def test_egress_never_exceeds_the_link(bw: float, t: float) -> None:
    r = evaluate(CASE, t, 4, 3, 5, bandwidth_gbps=bw)
    assert r.egress_gbps_used <= bw * (1 + 1e-9)
    if r.bottleneck == "prfaas-egress":
        assert r.egress_gbps_used == pytest.approx(bw, rel=1e-9)


def test_evaluate_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="instance counts"):
        evaluate(CASE, 1000, 4, -1, 5)
    with pytest.raises(ValueError, match="t:"):
        evaluate(CASE, -5, 4, 3, 5)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        evaluate(CASE, 1000, 4, 3, 5, bandwidth_gbps=-1)


def test_zero_prfaas_instances_cannot_take_offload() -> None:
    prof: Profile = dataclasses.replace(DEMO, n_prfaas=0)
    assert evaluate(prof, 3000, 0, 2, 4).lambda_max == 0.0
    assert evaluate(prof, math.inf, 0, 2, 4).lambda_max == pytest.approx(2 / 1.0)
