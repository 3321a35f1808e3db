"""The PrfaaS paper's claims, replayed on the case-study profile (issue 4, part C).

Every number asserted here comes from the throughput model or the profile, not from a
previous run: homogeneous saturates at its Lambda_max (2.11 req/s), the PrfaaS-PD split at
~3.2, naive in between; TTFT stays bounded below a policy's capacity and grows with the run
length above it. Tolerances were checked on seeds 0-4 (see bench/replay_compare.py for the
figures); the tests use seed 0.

Simulated capacities sit slightly below the model's because the simulator charges each
request ``T(L)`` while the model uses ``T(E[L])``: for the convex H200 curve
``N / E[T(L)]`` is 2-6% lower (naive: 2.37 instead of 2.50 req/s).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from xdc.scheduler.model import evaluate
from xdc.scheduler.planner import solve, threshold_for_bandwidth
from xdc.scheduler.policy import PolicyParams
from xdc.scheduler.profile import load_profile
from xdc.scheduler.sim.policies import PolicyName
from xdc.scheduler.sim.replay import ReplayOptions, compare, replay
from xdc.scheduler.sim.replay_metrics import ReplayResult
from xdc.scheduler.sim.workload import SimRequest, load_trace, parse_link_schedule, synthetic

from tests.paths import REPO

ROOT = REPO
CASE = load_profile(ROOT / "deploy/profiles/prfaas-case-study.toml")
PLAN = solve(CASE)

# Between homogeneous Lambda_max (2.11) and PrfaaS-PD Lambda_max (3.20).
BETWEEN_RATE = 2.7


def homogeneous_capacity(reqs: list[SimRequest]) -> float:
    """N_p / E[T_pd(L)] over these very requests: the model's capacity without sampling noise
    (the H20 curve is linear, so this is eq. (4) at the sample's mean length)."""
    n_p = PLAN.homogeneous.n_p
    return n_p / float(np.mean(CASE.pd.prefill_times([r.input_tokens for r in reqs])))


def assert_homogeneous_saturates(r: ReplayResult, reqs: list[SimRequest]) -> None:
    # Against the sample's own capacity within 4% (which requests finish inside the
    # measuring window varies); against the model's 2.11 within 8%, the sampling spread of
    # a few thousand log-normal lengths.
    assert r.throughput_rps == pytest.approx(homogeneous_capacity(reqs), rel=0.04)
    assert r.throughput_rps == pytest.approx(PLAN.homogeneous.lambda_max, rel=0.08)


@functools.cache
def between_requests(n: int) -> list[SimRequest]:
    return synthetic(CASE.workload, n, BETWEEN_RATE, seed=0)


@functools.cache
def between(n: int) -> dict[str, ReplayResult]:
    reqs = between_requests(n)
    return {r.policy: r for r in compare(CASE, reqs, policies=("prfaas", "homogeneous", "naive"))}


def test_between_the_capacities_prfaas_holds_and_homogeneous_saturates() -> None:
    r = between(2400)
    pr, homo, naive = r["prfaas"], r["homogeneous"], r["naive"]
    # PrfaaS-PD keeps up: (almost) every request served at the arrival rate, P90 TTFT well
    # within the router's 10 s SLO, under 0.5% turned away.
    assert pr.rejected <= 0.005 * pr.requests
    assert pr.throughput_rps >= 0.95 * pr.arrival_rate_rps
    assert pr.ttft_p90_s <= 8.0
    # Homogeneous PD completes at its Lambda_max however fast requests come.
    assert_homogeneous_saturates(homo, between_requests(2400))
    assert homo.rejected == 0
    # Naive lands in between on both throughput and latency.
    assert homo.throughput_rps < naive.throughput_rps < pr.throughput_rps
    assert pr.ttft_p90_s < naive.ttft_p90_s < homo.ttft_p90_s
    assert homo.ttft_p90_s > 10 * pr.ttft_p90_s


def test_above_capacity_queues_grow_with_the_run_and_below_they_do_not() -> None:
    short, long = between(1200), between(2400)
    growth = {p: long[p].ttft_p90_s / short[p].ttft_p90_s for p in short}
    # Twice the arrivals at the same rate: an overloaded queue is twice as long at the end.
    assert growth["homogeneous"] >= 1.5
    assert growth["naive"] >= 1.4
    assert growth["prfaas"] <= 1.1


def test_between_the_capacities_short_term_loop_does_not_shift_the_queue_without_slo() -> None:
    # No SLO admission, so nothing hides a bad threshold behind 429s. The queue trigger must
    # not fire under normal load (4 PrfaaS nodes ~85% busy) nor shift load onto an equally
    # loaded PD-P: before it was based on waiting seconds per instance, mean/P90 TTFT here was
    # 112.6/291.1 s; with the trigger off it is ~3.8/6.9 s.
    reqs = between_requests(2400)
    pr = replay(CASE, reqs, "prfaas", ReplayOptions(params=PolicyParams(ttft_slo_s=math.inf)))
    assert pr.rejected == 0 and pr.unfinished == 0
    assert pr.ttft_mean_s <= 6.0
    assert pr.ttft_p90_s <= 10.0
    assert pr.throughput_rps >= 0.95 * pr.arrival_rate_rps


def test_saturated_throughput_follows_the_model() -> None:
    # 4 req/s is above every configuration's capacity, so each completes at its own limit.
    # static-threshold is the planner's PrfaaS-PD configuration (4/3/5, t = 19.6K) without
    # the runtime loops: the paper's Table 6 comparison.
    reqs = synthetic(CASE.workload, 2400, 4.0, seed=0)
    got = {r.policy: r for r in compare(CASE, reqs)}
    homo = got["homogeneous"].throughput_rps
    split = got["static-threshold"].throughput_rps
    naive = got["naive"].throughput_rps
    assert_homogeneous_saturates(got["homogeneous"], reqs)
    # Model: 1.52x (paper 1.54x) and 1.19x (paper 1.16x; ours is lower, see module doc).
    assert 1.40 <= split / homo <= 1.65
    assert 1.05 <= naive / homo <= 1.20
    # The full router serves at least as many; it also sheds (429s) what cannot make its SLO.
    assert got["prfaas"].throughput_rps >= split
    assert got["prfaas"].rejected > 0
    assert sum(r.rejected for r in got.values()) == got["prfaas"].rejected


# --------------------------------------------------------------------------- link drop
# The case study needs ~12 Gbps at Lambda_max, so its 100 Gbps link would not notice a drop
# to 25 Gbps. Here the link is sized at 20 Gbps and drops to a quarter, 5 Gbps, at 300 s,
# with 1.5 req/s arriving for 900 s. At 5 Gbps the planned t = 19.6K supports only 1.34 req/s
# (egress-bound) while the same split with t re-solved for 5 Gbps supports 1.78.

DROP = parse_link_schedule("0:20,300:5", 20)
DROP_RATE = 1.5


@functools.cache
def drop_requests() -> tuple[SimRequest, ...]:
    return tuple(synthetic(CASE.workload, int(DROP_RATE * 900), DROP_RATE, seed=0))


def run_drop(policy: PolicyName, **opts: Any) -> ReplayResult:
    return replay(CASE, drop_requests(), policy, ReplayOptions(link=DROP, **opts))


def test_link_drop_model_premise() -> None:
    static = solve(CASE, bandwidth_gbps=20).best
    assert static.t == pytest.approx(PLAN.best.t)  # 20 Gbps is enough for the plan
    assert evaluate(CASE, static.t, 4, 3, 5, bandwidth_gbps=5).lambda_max < DROP_RATE
    t5 = threshold_for_bandwidth(CASE, 3, 5, 5.0)
    assert evaluate(CASE, t5, 4, 3, 5, bandwidth_gbps=5).lambda_max > DROP_RATE * 1.15


def test_link_drop_static_threshold_tail_grows_several_fold() -> None:
    static = run_drop("static-threshold")
    before, after = static.phases
    assert (before.link_gbps, after.link_gbps) == (20, 5)
    assert static.rejected == 0
    assert after.ttft_p90_s >= 3 * before.ttft_p90_s
    assert after.egress_gbps_mean == pytest.approx(5.0, rel=0.05)  # saturated link


def test_link_drop_router_defaults_keep_p90_within_slo() -> None:
    # With the router's defaults (short-term loop, 300 s replan, 10 s TTFT SLO) P90 TTFT
    # after the drop stays under the SLO, at the price of turning away some requests whose
    # predicted TTFT cannot make it (HTTP 429 at the gateway): under 8% (it was 72 of 905,
    # 8.0%, while the raise overshot to 4x base t).
    pr = run_drop("prfaas")
    static = run_drop("static-threshold")
    before, after = pr.phases
    assert after.ttft_p90_s <= 10.0
    assert after.rejected < 0.08 * after.arrivals
    assert before.rejected <= 0.01 * before.arrivals
    assert static.phases[1].ttft_p90_s >= 5 * after.ttft_p90_s
    assert pr.t_max > pr.base_t  # the short-term loop raised t ...
    # ... toward the planner's t for the live 5 Gbps, and not beyond it
    assert pr.t_max <= threshold_for_bandwidth(CASE, PLAN.n_p, PLAN.n_d, 5.0) * (1 + 1e-9)
    assert after.offload_fraction < before.offload_fraction
    assert after.egress_gbps_mean < 5.0


def test_link_drop_long_term_replan_alone_keeps_p90_bounded_without_rejecting() -> None:
    # The bandwidth-aware part that does the work: replanning t for the live capacity
    # (LongTermPlanner, here every 30 s) with the short-term raise switched off and no SLO
    # admission. Nothing is rejected; P90 stays within 25 s (vs > 3x that for static).
    params = PolicyParams(ttft_slo_s=float("inf"), max_raise=1.0, min_raise_tokens_per_s=0.0)
    pr = run_drop("prfaas", replan_interval_s=30.0, params=params)
    static = run_drop("static-threshold")
    before, after = pr.phases
    assert pr.rejected == 0 and pr.unfinished == 0
    assert after.ttft_p90_s <= 25.0
    assert static.phases[1].ttft_p90_s >= 3 * after.ttft_p90_s
    # The replanned threshold is the planner's for 5 Gbps on the observed lengths: well
    # above the 20 Gbps one, which offloads fewer, longer requests.
    assert pr.final_t > 1.3 * pr.base_t
    assert after.offload_fraction < before.offload_fraction - 0.1


# --------------------------------------------------------------------------- trace


def ideal_hit_rate(reqs: list[SimRequest], block: int = 512) -> float:
    """Token reuse with one unbounded cache: the leading full blocks seen in earlier requests."""
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        full = r.hashes[: r.input_tokens // block]
        n = 0
        for h in full:
            if h not in seen:
                break
            n += 1
        seen.update(full)
        hit += min(n * block, r.input_tokens)
        total += r.input_tokens
    return hit / total


def test_mooncake_trace_replay_reuses_prefixes(mooncake_trace: Path) -> None:
    reqs = load_trace(mooncake_trace, limit=1500)
    ideal = ideal_hit_rate(reqs)
    assert ideal > 0.2
    r = replay(CASE, reqs, "prfaas")
    assert r.completed + r.rejected + r.unfinished == 1500
    assert r.unfinished == 0
    assert r.rejected <= 0.02 * 1500
    assert 0 < r.offload_fraction < 1
    # Two clusters' caches, fed only by what each prefilled, and prompts that arrive before
    # their prefix is computed: close to, never above, one unbounded cache.
    assert 0.9 * ideal <= r.cache_hit_rate <= ideal + 1e-9
    # A cache far smaller than the trace's working set loses most of that reuse.
    small = replay(CASE, reqs, "prfaas", ReplayOptions(cache_blocks_per_instance=200))
    assert small.cache_hit_rate < 0.5 * ideal
