"""Mechanics of the replay simulator on hand-checkable cases (small-demo profile).

small-demo: PrfaaS prefill 0.1 s + 1e-4 s/token, PD prefill 0.2 s + 2e-4 s/token, KV 1e5
bytes/token, 10 Gbps, decode 1.2 req/s per instance at 256 output tokens. Its plan is t = 3000,
N_prfaas / N_p / N_d = 2 / 2 / 4; homogeneous is 4 / 4. Decode slots: round(1.2 * 256 * 0.025)
= 8, so a token takes 8 / (1.2 * 256) s.
"""

from __future__ import annotations

import math

import pytest
from xdc.scheduler.planner import solve
from xdc.scheduler.profile import load_profile
from xdc.scheduler.sim.replay import ReplayOptions, ReplaySim, compare, replay
from xdc.scheduler.sim.workload import (
    ReplayInputError,
    SimRequest,
    parse_link_schedule,
    synthetic,
)

from tests.paths import REPO

ROOT = REPO
DEMO = load_profile(ROOT / "deploy/profiles/small-demo.toml")
CASE = load_profile(ROOT / "deploy/profiles/prfaas-case-study.toml")
TOKEN_S = 8 / (1.2 * 256)


def test_layouts_come_from_the_plan() -> None:
    plan = solve(DEMO)
    reqs = [SimRequest(0, 0.0, 1000, 10)]
    got = {p: (r.n_prfaas, r.n_p, r.n_d) for p, r in ((r.policy, r) for r in compare(DEMO, reqs))}
    assert got["prfaas"] == got["static-threshold"] == (plan.n_prfaas, plan.n_p, plan.n_d)
    assert got["homogeneous"] == (0, plan.homogeneous.n_p, plan.homogeneous.n_d)
    assert got["naive"] == (plan.n_prfaas, 0, DEMO.n_pd)


def test_one_local_request_costs_prefill_then_decode() -> None:
    r = replay(DEMO, [SimRequest(0, 0.0, 5000, 256)], "homogeneous")
    # PD prefill of 5000 tokens: 0.2 + 1.0 s; then 256 tokens of decode.
    assert r.ttft_mean_s == pytest.approx(1.2)
    assert r.makespan_s == pytest.approx(1.2 + 256 * TOKEN_S)
    assert (r.completed, r.rejected, r.unfinished, r.offload_fraction) == (1, 0, 0, 0.0)


def test_offloaded_kv_transfer_hides_behind_prefill_on_a_fast_link() -> None:
    # 10000 > t = 3000 -> PrfaaS: prefill 1.1 s; 1 GB of KV at 10 Gbps needs only 0.8 s.
    r = replay(DEMO, [SimRequest(0, 0.0, 10_000, 1)], "static-threshold")
    assert r.offload_fraction == 1.0
    assert r.ttft_mean_s == pytest.approx(1.1)
    assert r.egress_gbps_peak > 0


def test_transfer_that_outlasts_prefill_adds_its_remainder() -> None:
    # The link drops to 2 Gbps at 0.5 s: 0.4545 GB of the 1 GB stream is out by then
    # (produced at 1 GB / 1.1 s); the rest takes 0.5455 / 0.25 = 2.18 s more.
    link = parse_link_schedule("0:10,0.5:2", 10)
    r = replay(DEMO, [SimRequest(0, 0.0, 10_000, 1)], "static-threshold", ReplayOptions(link=link))
    assert r.ttft_mean_s == pytest.approx(0.5 + (1 - 0.5 / 1.1) / 0.25)


def test_fifo_queueing_on_one_instance() -> None:
    # Homogeneous demo has 4 PD-P instances: the 5th simultaneous request waits for the
    # shortest queue, i.e. one full 1.2 s prefill.
    reqs = [SimRequest(i, 0.0, 5000, 1) for i in range(5)]
    r = replay(DEMO, reqs, "homogeneous")
    assert r.ttft_max_s == pytest.approx(2.4)
    assert r.ttft_mean_s == pytest.approx((4 * 1.2 + 2.4) / 5)
    assert r.pd_prefill_wait_mean_s == pytest.approx(1.2 / 5)


def test_decode_slots_queue_when_full() -> None:
    # 40 prompts at once: 4 PD-P instances prefill them 0.4 s each, booked decode load spreads
    # them 10 per decode instance, which has 8 slots held 256 tokens (6.7 s) each: the last 2
    # on every instance wait for a slot.
    reqs = [SimRequest(i, 0.0, 1000, 256) for i in range(40)]
    r = replay(DEMO, reqs, "homogeneous")
    assert r.completed == 40
    assert r.decode_waiting_max == 8
    assert r.decode_wait_mean_s > 0


def prefix_requests() -> list[SimRequest]:
    """Two prompts of the same 10 full 512-token blocks; the second comes after the first has
    prefilled, so all of it is cached if the cache kept it."""
    keys = tuple(range(100, 110))
    return [SimRequest(0, 0.0, 5120, 1, keys), SimRequest(1, 10.0, 5120, 1, keys)]


def test_prefix_cache_hits_reuse_computed_blocks() -> None:
    r = replay(DEMO, prefix_requests(), "homogeneous")
    assert r.cache_hit_rate == pytest.approx(0.5)
    # The second prompt is fully cached: one token to compute, 0.2 s + 2e-4 s.
    assert r.ttft_p50_s == pytest.approx((1.224 + 0.2002) / 2)


def test_prefix_cache_capacity_is_enforced_lru() -> None:
    # One block per instance: 4 blocks for the PD cluster; the oldest 6 of the first prompt's
    # 10 blocks are evicted, so the second prompt's first block misses and nothing is reused.
    opts = ReplayOptions(cache_blocks_per_instance=1)
    r = replay(DEMO, prefix_requests(), "homogeneous", opts)
    assert r.cache_hit_rate == 0.0


def test_prfaas_routes_through_the_real_router() -> None:
    # At low load the router's own TTFT prediction (queue + prefill + exposed transfer, from
    # the profile and the link state the simulated monitor reports) is close to what the
    # simulated cluster then does; it errs only when it discounts bandwidth a recent transfer
    # used. Rule-based baselines make no prediction.
    reqs = synthetic(DEMO.workload, 300, 0.3, seed=3)
    r = replay(DEMO, reqs, "prfaas")
    assert r.completed == 300
    assert 0.2 < r.offload_fraction < 0.6
    assert r.ttft_prediction_mae_s < 0.1 * r.ttft_mean_s
    assert math.isnan(replay(DEMO, reqs, "static-threshold").ttft_prediction_mae_s)


def test_same_seed_same_result_other_seed_other_result() -> None:
    a = replay(CASE, synthetic(CASE.workload, 400, 2.5, seed=11), "prfaas")
    b = replay(CASE, synthetic(CASE.workload, 400, 2.5, seed=11), "prfaas")
    c = replay(CASE, synthetic(CASE.workload, 400, 2.5, seed=12), "prfaas")
    assert a.deterministic() == b.deterministic()
    assert a.deterministic() != c.deterministic()


@pytest.mark.parametrize("policy", ["prfaas", "homogeneous", "naive", "static-threshold"])
def test_every_request_is_accounted_for(policy: str) -> None:
    # Overloaded (4 req/s is above every policy's capacity): queues grow, some requests may be
    # rejected, all the rest must still finish.
    reqs = synthetic(CASE.workload, 600, 4.0, seed=5)
    r = replay(CASE, reqs, policy)  # type: ignore[arg-type]
    assert r.completed + r.rejected + r.unfinished == 600
    assert r.unfinished == 0
    assert r.completed > 0


def test_requests_stuck_on_a_dead_link_are_counted_unfinished() -> None:
    # The link dies for good at 30 s: offloaded KV can never arrive. The run must stop, not
    # spin, and report those requests as unfinished.
    reqs = synthetic(CASE.workload, 200, 1.0, seed=2)
    opts = ReplayOptions(link=parse_link_schedule("0:100,30:0", 100))
    r = replay(CASE, reqs, "static-threshold", opts)
    assert r.unfinished > 0
    assert r.completed + r.rejected + r.unfinished == 200
    assert "stuck" in r.note


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ReplayInputError, match="no requests"):
        ReplaySim(DEMO, [], "prfaas")
    with pytest.raises(ReplayInputError, match="policy"):
        ReplaySim(DEMO, [SimRequest(0, 0.0, 10, 1)], "fastest")  # type: ignore[arg-type]
    with pytest.raises(ReplayInputError, match="monitor interval"):
        ReplaySim(DEMO, [SimRequest(0, 0.0, 10, 1)], "prfaas", ReplayOptions(monitor_interval_s=0))


def test_request_order_and_ids_do_not_matter() -> None:
    reqs = synthetic(DEMO.workload, 120, 2.0, seed=4)
    shuffled = [
        SimRequest(7 * r.rid + 1000, r.arrival_s, r.input_tokens, r.output_tokens)
        for r in reversed(reqs)
    ]
    a = replay(DEMO, reqs, "prfaas")
    b = replay(DEMO, shuffled, "prfaas")
    assert a.deterministic() == b.deterministic()


def test_run_ends_when_the_last_request_finishes() -> None:
    # A link change scheduled long after the work is done must not stretch the run.
    opts = ReplayOptions(link=parse_link_schedule("0:10,1000000:1", 10))
    r = replay(DEMO, [SimRequest(0, 0.0, 10_000, 1)], "prfaas", opts)
    assert r.completed == 1 and r.note == ""
    assert r.makespan_s == pytest.approx(1.1 + TOKEN_S)


def test_drain_limit_stops_a_hopeless_run() -> None:
    reqs = synthetic(CASE.workload, 300, 6.0, seed=1)
    r = replay(CASE, reqs, "homogeneous", ReplayOptions(max_drain_s=10.0))
    assert "drain limit" in r.note
    assert r.unfinished > 0
    assert r.completed + r.rejected + r.unfinished == 300
