"""Long-term loop: re-solving N_p / N_d and t from observed traffic (case-study profile)."""

from __future__ import annotations

import random

import pytest
from xdc.scheduler.longterm import LongTermPlanner
from xdc.scheduler.planner import solve
from xdc.scheduler.policy import RouteRequest
from xdc.scheduler.profile import Profile, load_profile
from xdc.scheduler.service.router import RouterService

from tests.paths import REPO
from xdc.config import RouterConfig

PROFILE = REPO / "deploy/profiles/prfaas-case-study.toml"
ROLES_3_5 = {f"pd-{i}": ("prefill" if i < 3 else "decode") for i in range(8)}


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


def _feed(lt: LongTermPlanner, lo: int, hi: int, n: int = 1000) -> None:
    rnd = random.Random(7)
    for i in range(n):
        lt.observe_arrival(i * 0.3, rnd.randint(lo, hi))


def test_few_samples_use_profile_workload_and_keep_optimal_split(profile: Profile) -> None:
    lt = LongTermPlanner(profile)
    _feed(lt, 1000, 2000, n=50)
    rec = lt.replan(20.0, ROLES_3_5, 4)
    assert rec.samples == 50 and rec.workload.startswith("profile:")
    assert rec.role_changes == ()
    plan = solve(profile)
    assert (plan.n_p, plan.n_d) == (3, 5)
    assert rec.t == pytest.approx(plan.best.t, rel=1e-3)
    assert rec.lambda_current == pytest.approx(plan.best.lambda_max, rel=1e-3)


def test_long_prompts_convert_decode_nodes_to_prefill(profile: Profile) -> None:
    lt = LongTermPlanner(profile)
    _feed(lt, 60_000, 120_000)
    rec = lt.replan(300.0, ROLES_3_5, 4)
    assert rec.workload.startswith("observed:")
    assert rec.n_p > 3 and rec.n_p + rec.n_d == 8
    assert len(rec.role_changes) == rec.n_p - 3
    assert all(c.from_role == "decode" and c.to_role == "prefill" for c in rec.role_changes)
    assert {c.node for c in rec.role_changes} <= {n for n, r in ROLES_3_5.items() if r == "decode"}
    assert rec.lambda_max > rec.lambda_current * 1.05
    assert rec.t > 19_400  # long traffic: the threshold for the current split rises too


def test_short_prompts_convert_prefill_nodes_to_decode(profile: Profile) -> None:
    lt = LongTermPlanner(profile)
    _feed(lt, 500, 4000)
    rec = lt.replan(300.0, ROLES_3_5, 4)
    assert rec.n_d > 5
    assert all(c.to_role == "decode" for c in rec.role_changes)
    assert rec.bottleneck == "pd-decode"
    assert rec.t < 4000


def test_small_gain_does_not_flip_roles(profile: Profile) -> None:
    lt = LongTermPlanner(profile, min_gain=10.0)
    _feed(lt, 60_000, 120_000)
    rec = lt.replan(300.0, ROLES_3_5, 4)
    assert rec.role_changes == () and (rec.n_p, rec.n_d) == (3, 5)
    assert any("gains only" in r for r in rec.reasons)


def test_window_drops_old_arrivals(profile: Profile) -> None:
    lt = LongTermPlanner(profile, window_s=100.0)
    _feed(lt, 60_000, 120_000)  # arrivals at 0..300 s
    obs = lt.snapshot(350.0)
    assert len(obs.lengths) == sum(1 for i in range(1000) if i * 0.3 >= 250.0)
    assert obs.arrival_rate == pytest.approx(1 / 0.3, rel=0.01)


def test_no_decode_nodes_holds(profile: Profile) -> None:
    lt = LongTermPlanner(profile)
    rec = lt.replan(0.0, {"pd-0": "prefill"}, 4)
    assert rec.role_changes == () and "nothing to rebalance" in rec.reasons[-1]


def test_service_replan_applies_t_and_feeds_on_its_own_decisions(profile: Profile) -> None:
    now = [0.0]
    svc = RouterService(RouterConfig(), profile, clock=lambda: now[0])
    base = svc.threshold.base_t
    rnd = random.Random(3)
    for i in range(400):
        now[0] = i * 5.0  # slow enough that queues drain; 2,000 s fits the 1 h window
        d, _ = svc.route(RouteRequest(f"r{i}", rnd.randint(70_000, 120_000)))
        assert not d.rejected
    rec = svc.replan()
    assert rec.samples == 400 and rec.role_changes
    assert svc.threshold.base_t == pytest.approx(rec.t) and rec.t > base
    assert svc.plan_json()["recommendation"]["n_p"] == rec.n_p
