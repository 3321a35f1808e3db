"""The 2-D search (PrfaaS 3.4.2) and the Table 6 baselines.

Tolerances against the paper's Table 6 are explained in deploy/profiles/README.md: the model
is fed Table 5 by piecewise-linear interpolation, which puts H200 prefill ~2% off the curve
the paper must have used, so PrfaaS-side figures are held to a few percent, not to the digit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.model import evaluate
from xdc.scheduler.planner import (
    homogeneous_baseline,
    naive_heterogeneous,
    solve,
    threshold_for_bandwidth,
)
from xdc.scheduler.profile import Profile, Workload, load_profile

from tests.paths import REPO

ROOT = REPO
CASE = load_profile(ROOT / "deploy/profiles/prfaas-case-study.toml")
DEMO = load_profile(ROOT / "deploy/profiles/small-demo.toml")


def test_case_study_lands_near_table_6() -> None:
    plan = solve(CASE)
    b = plan.best
    # Table 6, PrfaaS-PD: t = 19.4K, 4/3/5, Theta 1.61/1.64/3.91, Lambda_max 3.24.
    assert (plan.n_prfaas, plan.n_p, plan.n_d) == (4, 3, 5)
    assert (b.n_prfaas, b.n_p, b.n_d) == (4, 3, 5)
    assert b.t == pytest.approx(19_400, rel=0.03)
    assert b.p == pytest.approx(0.496, abs=0.01)
    assert 43_000 < b.l_long < 46_500  # paper: "~44K"
    assert b.theta_prfaas == pytest.approx(1.61, rel=0.03)
    assert b.theta_pdp == pytest.approx(1.64, rel=0.02)
    assert b.theta_pdd == pytest.approx(3.91, abs=0.005)
    assert b.lambda_max == pytest.approx(3.24, rel=0.02)
    # Paper: ~13 Gbps; its own Lambda, p and l_long give 12.2 under eq. (3) (see README).
    assert 11.5 < b.egress_gbps_used < 13.5
    # Homogeneous PD: 9 / 3, Lambda_max 2.11. Naive heterogeneous: 4 / - / 8, 2.45.
    h, n = plan.homogeneous, plan.naive
    assert (h.n_prfaas, h.n_p, h.n_d) == (0, 9, 3)
    assert h.lambda_max == pytest.approx(2.11, rel=0.005)
    assert h.theta_pdd == pytest.approx(2.35, abs=0.01)
    assert (n.n_prfaas, n.n_p, n.n_d, n.t, n.p) == (4, 0, 8, 0.0, 1.0)
    assert n.lambda_max == pytest.approx(2.45, rel=0.03)
    assert n.theta_pdd == pytest.approx(6.25)
    # Ratios: 1.54x and 1.16x in the paper.
    assert plan.vs_homogeneous == pytest.approx(1.54, abs=0.04)
    assert n.lambda_max / h.lambda_max == pytest.approx(1.16, abs=0.04)


def test_optimum_balances_eq_7() -> None:
    b = solve(CASE).best
    assert b.bottleneck in ("prfaas-compute", "pd-prefill")
    assert b.theta_prfaas / b.p == pytest.approx(b.theta_pdp / (1 - b.p), rel=1e-5)
    assert b.lambda_max < b.theta_pdd  # decode has slack: integer N_d cannot meet eq. (8)


def _brute_force(prof: Profile, ts: list[float], bw: float | None = None) -> float:
    return max(
        evaluate(prof, t, prof.n_prfaas, n_p, prof.n_pd - n_p, bandwidth_gbps=bw).lambda_max
        for t in ts
        for n_p in range(prof.n_pd)
    )


def test_solve_matches_exhaustive_search_on_empirical_workload() -> None:
    # Every t between two distinct lengths gives the same split, so this grid is exhaustive.
    ts = [0.0, 1000.0, 1500.0, 2000.0, 3000.0, 3500.0, 4000.0, 10000.0, math.inf]
    plan = solve(DEMO)
    assert plan.lambda_max == pytest.approx(_brute_force(DEMO, ts))
    # The worked optimum written in small-demo.toml.
    assert (plan.n_p, plan.n_d, plan.t) == (2, 4, 3000.0)
    assert plan.lambda_max == pytest.approx(10e9 / (8 * 7e8) / 0.4)
    assert plan.homogeneous.lambda_max == pytest.approx(4.0)
    assert plan.naive.lambda_max == pytest.approx(10e9 / (8 * 4e8))


@pytest.mark.parametrize("bw", [100.0, 20.0, 5.0, 0.5])
def test_solve_is_at_least_as_good_as_a_dense_brute_force(bw: float) -> None:
    ts = [0.0, *np.geomspace(128, 131072, 300).tolist(), math.inf]
    plan = solve(CASE, bandwidth_gbps=bw)
    assert plan.lambda_max >= _brute_force(CASE, ts, bw) * (1 - 1e-9)
    assert plan.best.egress_gbps_used <= bw * (1 + 1e-9)


def test_less_bandwidth_raises_t_and_lowers_throughput() -> None:
    last_t, last_lam = -1.0, math.inf
    for bw in (100.0, 10.0, 5.0, 2.0, 1.0):
        plan = solve(CASE, bandwidth_gbps=bw)
        assert plan.t >= last_t
        assert plan.lambda_max <= last_lam * (1 + 1e-9)
        last_t, last_lam = plan.t, plan.lambda_max
    assert solve(CASE, bandwidth_gbps=5.0).best.bottleneck == "prfaas-egress"
    dead = solve(CASE, bandwidth_gbps=0.0)
    assert math.isinf(dead.t) and dead.best.p == 0.0
    assert dead.lambda_max == pytest.approx(homogeneous_like(CASE, CASE.n_pd))


def homogeneous_like(prof: Profile, n: int) -> float:
    """Best PD-only Lambda_max with n PD instances, by brute force."""
    return max(evaluate(prof, math.inf, 0, k, n - k).lambda_max for k in range(1, n))


def test_threshold_for_bandwidth_holds_the_split() -> None:
    plan = solve(CASE)
    t100 = threshold_for_bandwidth(CASE, plan.n_p, plan.n_d, 100.0)
    assert t100 == pytest.approx(plan.t, rel=1e-6)
    ts = [threshold_for_bandwidth(CASE, 3, 5, bw) for bw in (50.0, 10.0, 4.0, 1.0)]
    assert ts == sorted(ts) and ts[-1] > 2 * t100
    assert math.isinf(threshold_for_bandwidth(CASE, 3, 5, 0.0))
    # The chosen t is the best one for that split (dense scan never beats it).
    t4 = threshold_for_bandwidth(CASE, 3, 5, 4.0)
    best = evaluate(CASE, t4, 4, 3, 5, bandwidth_gbps=4.0).lambda_max
    scan = max(
        evaluate(CASE, t, 4, 3, 5, bandwidth_gbps=4.0).lambda_max
        for t in np.geomspace(128, 131072, 400)
    )
    assert best >= scan * (1 - 1e-9)
    # No PD prefill instances: only offloading everything makes sense.
    assert threshold_for_bandwidth(CASE, 0, 8, 100.0) == 0.0


def test_ties_go_to_the_balanced_threshold() -> None:
    # Two decode instances make every t in a wide range decode-bound at the same Lambda_max;
    # the planner must still report the threshold that balances eq. (7).
    prof = dataclasses.replace(CASE, n_pd=8)
    t = threshold_for_bandwidth(prof, 6, 2, 100.0)
    r = evaluate(prof, t, 4, 6, 2)
    assert r.bottleneck == "pd-decode"
    assert r.theta_prfaas / r.p == pytest.approx(r.theta_pdp / (1 - r.p), rel=1e-5)
    assert evaluate(prof, t * 0.7, 4, 6, 2).lambda_max == pytest.approx(r.lambda_max)


def test_explicit_grid_is_searched_exactly() -> None:
    grid = [10_000.0, 19_400.0, 30_000.0]
    plan = solve(CASE, t_grid=grid)
    assert plan.t in grid
    assert plan.t == 19_400.0
    assert plan.lambda_max == pytest.approx(evaluate(CASE, 19_400, 4, 3, 5).lambda_max)
    with pytest.raises(ValueError, match="t_grid"):
        solve(CASE, t_grid=[-1.0])
    with pytest.raises(ValueError, match="t_grid"):
        solve(CASE, t_grid=[])


def test_baselines_by_brute_force() -> None:
    h = homogeneous_baseline(CASE)
    assert h.lambda_max == pytest.approx(homogeneous_like(CASE, 12))
    assert h.t == math.inf and h.theta_prfaas == 0.0
    n = naive_heterogeneous(CASE, bandwidth_gbps=5.0)
    assert n.bottleneck == "prfaas-egress" and n.egress_gbps_used == pytest.approx(5.0)


def test_without_prfaas_instances_nothing_is_offloaded() -> None:
    prof = dataclasses.replace(DEMO, n_prfaas=0)
    plan = solve(prof)
    assert plan.best.p == 0.0 and math.isinf(plan.t)
    assert plan.lambda_max == pytest.approx(homogeneous_like(prof, prof.n_pd))


def test_plan_serialises_to_strict_json() -> None:
    data = solve(CASE).to_dict()
    text = json.dumps(data, allow_nan=False)
    back = json.loads(text)
    assert back["homogeneous_pd"]["t"] is None  # inf: offload nothing
    assert back["naive_heterogeneous"]["t"] == 0.0
    assert back["prfaas_pd"]["n_p"] == 3


def test_solve_is_fast_enough_for_the_router() -> None:
    solve(CASE)  # warm the per-workload caches, as a long-running router would
    times = []
    for _ in range(7):
        start = time.perf_counter()
        solve(CASE, bandwidth_gbps=37.0)
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.05
    # Even a cold profile (fresh workload object, no cached grid) stays well under budget.
    cold = load_profile(ROOT / "deploy/profiles/prfaas-case-study.toml")
    start = time.perf_counter()
    solve(cold)
    assert time.perf_counter() - start < 0.25


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(100, 50_000), min_size=1, max_size=12),
    n_prfaas=st.integers(0, 4),
    n_pd=st.integers(1, 6),
    bw=st.floats(0.0, 50.0),
    rate=st.floats(0.1, 3.0),
)
def test_solve_is_exhaustively_optimal_on_random_empirical_profiles(
    lengths: list[int], n_prfaas: int, n_pd: int, bw: float, rate: float
) -> None:
    wl = Workload.empirical(lengths, output_tokens=100)
    pd = dataclasses.replace(DEMO.pd, decode_rate_rps=rate)
    prof = dataclasses.replace(DEMO, workload=wl, n_prfaas=n_prfaas, n_pd=n_pd, pd=pd)
    plan = solve(prof, bandwidth_gbps=bw)
    # With an empirical workload the distinct lengths (plus 0 and inf) are every possible split.
    ts = [0.0, *sorted(set(map(float, lengths))), math.inf]
    assert plan.lambda_max == pytest.approx(_brute_force(prof, ts, bw), rel=1e-9)
    assert plan.n_p + plan.n_d == n_pd and plan.n_d >= 1
    assert plan.best.egress_gbps_used <= bw * (1 + 1e-9) + 1e-12
