"""Routing policy: every rule of NOTES section 3 with hand-checkable numbers.

Costs are linear so each expected value can be worked out on paper: PD-P prefills at
2e-4 s/token + 0.1 s, PrfaaS at 1e-4 s/token + 0.05 s, KV is 50 kB per token, the link is
100 Gbps. t = 19,400 tokens (the paper's case-study threshold), block size 512.
"""

from __future__ import annotations

import math

import pytest
from xdc.scheduler.cacheindex import PrefixMatch
from xdc.scheduler.link_table import LinkView
from xdc.scheduler.policy import (
    ClusterView,
    CostModel,
    Decision,
    NodeLoad,
    PolicyParams,
    QueueSignal,
    RouteRequest,
    ThresholdController,
    bandwidth_scarce,
    effective_threshold,
    link_pressure,
    queue_signal,
    route,
)

from tests.paths import REPO
from xdc.linkreport import LinkHealth

T = 19_400.0
NOW = 1000.0
Q0 = QueueSignal(0.0, 0.0)  # both clusters idle
SURGE = QueueSignal(12.0, 1.0)  # PrfaaS backed up 12 s per instance, PD-P nearly idle
P = PolicyParams(block_size=512, ttft_slo_s=10.0)
COSTS = CostModel(
    prfaas_prefill_s=lambda total, cached: 1e-4 * (total - cached) + 0.05,
    pd_prefill_s=lambda total, cached: 2e-4 * (total - cached) + 0.1,
    kv_bytes=lambda upto, already: 50_000.0 * max(upto - already, 0),
    egress_bps=100e9,
)
VIEW = ClusterView(
    prfaas_prefill=(NodeLoad("f0"), NodeLoad("f1")),
    pd_prefill=(NodeLoad("p0"), NodeLoad("p1")),
    pd_decode=(NodeLoad("d0", load=0.5), NodeLoad("d1", load=0.2)),
)


def link(state: str = "ok", util: float = 0.3, cap: float = 100e9, at: float = NOW) -> LinkView:
    return LinkView(util, util * cap, cap, LinkHealth(state), 0.0, 1.0, at)


def match(prfaas: int = 0, pd: int = 0, **nodes: int) -> PrefixMatch:
    """Cluster prefixes in blocks; node prefixes as f0=.., p0=.. keyword args."""
    nb: dict[str, dict[str, int]] = {"prfaas": {}, "pd": {}}
    for name, n in nodes.items():
        nb["prfaas" if name.startswith("f") else "pd"][name] = n
    best = {c: (max(nb[c], key=lambda k: nb[c][k]) if nb[c] else None) for c in nb}
    return PrefixMatch(blocks={"prfaas": prfaas, "pd": pd}, node_blocks=nb, best_node=best)


def decide(
    total: int,
    m: PrefixMatch,
    lk: LinkView | None,
    view: ClusterView = VIEW,
    slo: float | None = None,
    t: float = T,
) -> object:
    return route(RouteRequest("r1", total, (), slo), m, t, lk, view, COSTS, P, NOW)


# --- scarce vs abundant -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lk", "queue", "why"),
    [
        (None, Q0, "no live link report"),
        (link(at=NOW - 6.0), Q0, "stale"),
        (link("congested", 0.5), Q0, "congested"),
        (link("warn", 0.5), Q0, "warning"),
        (link("ok", 0.85), Q0, "utilisation 85% >= 80%"),
        (link("ok", 0.3), QueueSignal(8.0, 2.0), "PrfaaS wait 8.0s/instance >= 8.0s"),
    ],
)
def test_scarce_conditions(lk: LinkView | None, queue: QueueSignal, why: str) -> None:
    scarce, reason = bandwidth_scarce(lk, queue, NOW, P)
    assert scarce and why in reason


def test_abundant_when_link_ok_and_queue_short() -> None:
    assert bandwidth_scarce(link("ok", 0.79), QueueSignal(7.9, 0.0), NOW, P)[0] is False
    # a long PrfaaS wait is no surge when PD-P is at least as backed up: nothing to shift
    assert bandwidth_scarce(link("ok", 0.3), QueueSignal(12.0, 12.0), NOW, P)[0] is False


def test_queue_signal_is_mean_wait_per_instance_not_summed_depth() -> None:
    # 4 PrfaaS nodes each busy for 3 s (the old summed depth would read 4+ as a queue);
    # PD-P: 1 s and 5 s
    view = ClusterView(
        prfaas_prefill=tuple(NodeLoad(f"f{i}", queue_s=3.0) for i in range(4)),
        pd_prefill=(NodeLoad("p0", queue_s=1.0), NodeLoad("p1", queue_s=5.0)),
        pd_decode=(),
        prfaas_queue_depth=12,
    )
    assert queue_signal(view) == QueueSignal(3.0, 3.0)
    assert link_pressure(link("ok", 0.7), queue_signal(view), NOW, P) == "hold"
    # no PD-P node: infinite PD-P wait, so a PrfaaS backlog cannot be shifted
    only_prfaas = ClusterView(view.prfaas_prefill, (), ())
    assert queue_signal(only_prfaas).pd_s == math.inf


# --- the rule ---------------------------------------------------------------------------------


def test_scarce_judges_pd_cache_alone_and_offloads_long_remainder() -> None:
    # 30,000 tokens; PrfaaS holds 40 blocks (20,480 tokens), PD nothing: 30,000 > t -> PrfaaS
    d = route(RouteRequest("r1", 30_000), match(prfaas=40, f1=40), T, None, VIEW, COSTS, P, NOW)
    assert d.mode == "scarce" and not d.rejected
    assert d.target == "prfaas" and d.prefill_node == "f1"  # f1 holds the prefix itself
    assert (d.cached_tokens, d.uncached_tokens) == (20_480, 9_520)
    assert d.cache_transfer is None
    # KV crossing = everything PD lacks: 30,000 tokens * 50 kB = 1.5 GB; at 10% of 100 Gbps
    # (link unknown) that is 1.2 s, longer than the 1.002 s prefill, so 0.198 s is exposed.
    assert d.kv_bytes == pytest.approx(1.5e9)
    assert d.prefill_s == pytest.approx(1e-4 * 9_520 + 0.05)
    assert d.transfer_s == pytest.approx(1.2 - 1.002)
    assert d.predicted_ttft_s == pytest.approx(d.transfer_s + d.queue_s + d.prefill_s)
    assert d.predicted_ttft_s == pytest.approx(1.2)
    assert d.decode_node == "d1"  # least loaded
    assert "scarce" in d.reasons[0]


def test_scarce_keeps_request_local_when_pd_cache_leaves_short_remainder() -> None:
    # 24 PD blocks = 12,288 cached; 30,000 - 12,288 = 17,712 <= t -> PD-P
    d = route(RouteRequest("r1", 30_000), match(pd=24, p1=24), T, None, VIEW, COSTS, P, NOW)
    assert d.target == "pd" and d.prefill_node == "p1"
    assert (d.cached_tokens, d.uncached_tokens) == (12_288, 17_712)
    assert d.kv_bytes == 0 and d.cache_transfer is None
    assert d.predicted_ttft_s == pytest.approx(2e-4 * 17_712 + 0.1)
    assert "17712 <= t=19400" in " ".join(d.reasons)


def test_scarce_ignores_the_longer_prfaas_cache_for_the_pd_decision() -> None:
    # Same request as the abundant case below: PrfaaS holds 20,480 tokens, PD none. Scarce:
    # l_total - l_pd = 30,000 > t, so it offloads instead of pulling the cache across.
    d = route(
        RouteRequest("r1", 30_000), match(prfaas=40), T, link("congested"), VIEW, COSTS, P, NOW
    )
    assert d.target == "prfaas" and d.cache_transfer is None


def test_abundant_pulls_longer_prfaas_cache_into_pd() -> None:
    # l_prefix = 20,480 -> 9,520 <= t -> PD-P, and the prefix crosses PrfaaS -> PD
    d = route(RouteRequest("r1", 30_000), match(prfaas=40, f0=40), T, link(), VIEW, COSTS, P, NOW)
    assert d.mode == "abundant"
    assert d.target == "pd"
    assert (d.cached_tokens, d.uncached_tokens) == (20_480, 9_520)
    x = d.cache_transfer
    assert x is not None
    assert (x.source_cluster, x.source_node, x.dest_cluster) == ("prfaas", "f0", "pd")
    assert (x.first_block, x.blocks) == (0, 40)
    # 20,480 tokens * 50 kB = 1.024 GB = 8.192 Gbit at 70 Gbps free (utilisation 30%)
    assert x.bytes == pytest.approx(1.024e9)
    assert x.seconds == pytest.approx(8.192 / 70)
    assert d.predicted_ttft_s == pytest.approx(8.192 / 70 + 2e-4 * 9_520 + 0.1)


def test_abundant_sends_longer_pd_cache_to_prfaas_for_long_remainder() -> None:
    # 100,000 tokens, PD holds 80 blocks (40,960), PrfaaS 10 blocks (5,120):
    # 100,000 - 40,960 = 59,040 > t -> PrfaaS; PD's extra 70 blocks go PD -> PrfaaS
    d = route(
        RouteRequest("r1", 100_000), match(prfaas=10, pd=80, p0=80), T, link(), VIEW, COSTS, P, NOW
    )
    assert d.target == "prfaas" and d.cached_tokens == 40_960
    x = d.cache_transfer
    assert x is not None
    assert (x.source_cluster, x.source_node, x.dest_cluster) == ("pd", "p0", "prfaas")
    assert (x.first_block, x.blocks) == (10, 70)
    assert x.bytes == pytest.approx(50_000 * (40_960 - 5_120))
    # only the part PD lacks streams back: 59,040 tokens
    assert d.kv_bytes == pytest.approx(50_000 * 59_040)


def test_abundant_no_transfer_when_longer_cache_is_already_in_target() -> None:
    d = route(RouteRequest("r1", 30_000), match(prfaas=10, pd=30), T, link(), VIEW, COSTS, P, NOW)
    assert d.target == "pd" and d.cache_transfer is None and d.cached_tokens == 15_360


def test_abundant_skips_transfer_that_is_slower_than_recompute() -> None:
    # 1 Gbps link at 10%: 8.192 Gbit takes 9.1 s, recompute of 20,480 tokens on PD-P 4.1 s.
    slow = link("ok", 0.1, cap=1e9)
    req = RouteRequest("r1", 30_000, (), 60.0)
    d = route(req, match(prfaas=40), T, slow, VIEW, COSTS, P, NOW)
    assert d.mode == "abundant" and d.cache_transfer is None
    assert d.target == "prfaas" and d.cached_tokens == 20_480  # judged on own caches
    assert any("would take" in r for r in d.reasons)
    # Streaming all 30,000 tokens of KV (12 Gbit) at 0.9 Gbps takes 13.3 s: over the default
    # 10 s SLO, so the request falls back to recomputing everything in PD-P (6.1 s).
    d = route(RouteRequest("r1", 30_000), match(prfaas=40), T, slow, VIEW, COSTS, P, NOW)
    assert d.target == "pd" and d.cached_tokens == 0 and not d.rejected
    assert d.predicted_ttft_s == pytest.approx(6.1)
    assert any("misses SLO" in r for r in d.reasons)


# --- nodes, SLO, rejection --------------------------------------------------------------------


def test_prefill_node_by_affinity_then_load() -> None:
    view = ClusterView(
        prfaas_prefill=(NodeLoad("f0"),),
        pd_prefill=(NodeLoad("p0", queue_s=2.0), NodeLoad("p1"), NodeLoad("p2", queue_s=1.0)),
        pd_decode=(NodeLoad("d0"),),
    )
    # p0 holds the prefix and still meets the SLO -> affinity wins over p1's empty queue
    d = route(RouteRequest("r1", 10_000), match(pd=8, p0=8), T, None, view, COSTS, P, NOW)
    assert d.prefill_node == "p0" and d.queue_s == 2.0
    # no affinity anywhere -> least loaded
    d = route(RouteRequest("r1", 10_000), match(), T, None, view, COSTS, P, NOW)
    assert d.prefill_node == "p1"
    # affinity node's queue would miss the SLO -> next best by load
    busy = ClusterView(
        view.prfaas_prefill, (NodeLoad("p0", 9.5), *view.pd_prefill[1:]), view.pd_decode
    )
    d = route(RouteRequest("r1", 10_000), match(pd=8, p0=8), T, None, busy, COSTS, P, NOW)
    assert d.prefill_node == "p1"


def test_falls_back_to_other_cluster_when_rule_choice_misses_slo() -> None:
    view = ClusterView(
        prfaas_prefill=(NodeLoad("f0"),),
        pd_prefill=(NodeLoad("p0", queue_s=30.0),),
        pd_decode=(NodeLoad("d0"),),
    )
    d = route(RouteRequest("r1", 10_000), match(), T, link(), view, COSTS, P, NOW)
    assert not d.rejected and d.target == "prfaas"
    assert any("misses SLO" in r for r in d.reasons)


def test_rejects_with_reason_when_nothing_meets_slo() -> None:
    view = ClusterView(
        prfaas_prefill=(NodeLoad("f0", queue_s=20.0),),
        pd_prefill=(NodeLoad("p0", queue_s=30.0),),
        pd_decode=(NodeLoad("d0"),),
    )
    d = route(RouteRequest("r1", 10_000), match(), T, link(), view, COSTS, P, NOW)
    assert d.rejected
    assert "reject: no choice meets TTFT SLO 10.00s" in d.reasons[-1]
    assert "PD-P 32.10s" in d.reasons[-1] and "PrfaaS 21.05s" in d.reasons[-1]
    # a looser per-request SLO admits it on the faster option
    d = route(RouteRequest("r1", 10_000, (), 25.0), match(), T, link(), view, COSTS, P, NOW)
    assert not d.rejected and d.target == "prfaas"


def test_rejects_when_every_decode_node_is_full() -> None:
    view = ClusterView(VIEW.prfaas_prefill, VIEW.pd_prefill, (NodeLoad("d0", load=1.0),))
    d = route(RouteRequest("r1", 1_000), match(), T, link(), view, COSTS, P, NOW)
    assert d.rejected and d.decode_node is None
    assert "PD-D nodes at load >= 1.00" in d.reasons[-1]


def test_no_pd_prefill_nodes_routes_everything_to_prfaas() -> None:
    view = ClusterView(VIEW.prfaas_prefill, (), VIEW.pd_decode)
    d = route(RouteRequest("r1", 1_000), match(), T, link(), view, COSTS, P, NOW)
    assert d.target == "prfaas" and not d.rejected


def test_decision_json_has_no_infinities() -> None:
    view = ClusterView((), (), ())
    d = route(RouteRequest("r1", 1_000), match(), T, None, view, COSTS, P, NOW)
    assert d.rejected
    j = d.to_json()
    assert j["predicted_ttft_s"] is None and j["rejected"] is True


# --- threshold under congestion ---------------------------------------------------------------


def test_congestion_raises_t_and_clearing_lowers_it() -> None:
    c = ThresholdController(T, P, now=0.0)
    assert c.update(link("congested", at=1.0), Q0, 1.0) == pytest.approx(T * 1.5)  # 1 s pressure
    assert c.update(link("congested", at=2.0), Q0, 2.0) == pytest.approx(T * 2.25)
    for s in range(3, 20):
        c.update(link("congested", at=float(s)), Q0, float(s))
    assert c.t == pytest.approx(T * 4)  # no bandwidth target known: capped at max_raise
    # clear: excess 3T halves every 10 s
    assert c.update(link("ok", 0.2, at=29.0), Q0, 29.0) == pytest.approx(T + 3 * T / 2)
    assert c.update(link("ok", 0.2, at=39.0), Q0, 39.0) == pytest.approx(T + 3 * T / 4)
    c.update(link("ok", 0.2, at=500.0), Q0, 500.0)
    assert c.t == T


def test_link_raise_stops_at_the_bandwidth_target_and_keeps_hysteresis() -> None:
    # The planner's t for 25 Gbps is 1.6 T; a congested 25 Gbps link raises t to there, not 4 T.
    asked: list[tuple[float, ...]] = []

    def target(gbps: tuple[float, ...]) -> float:
        asked.append(gbps)
        return T * (1.6 if sum(gbps) < 50 else 1.0)

    c = ThresholdController(T, P, now=0.0, bandwidth_t=target)
    for s in range(1, 30):
        c.update(link("congested", cap=25e9, at=float(s)), Q0, float(s))
    assert c.t == pytest.approx(T * 1.6)
    assert asked == [(25.0,)]  # solved once per capacity, then cached
    # inside the hysteresis band t holds at the target, it does not fall
    assert c.update(link("ok", 0.7, cap=25e9, at=40.0), Q0, 40.0) == pytest.approx(T * 1.6)
    # a target below the current t never lowers it under pressure
    c2 = ThresholdController(T, P, now=0.0, bandwidth_t=lambda g: T * 1.2)
    c2.t = T * 2
    assert c2.update(link("congested", at=1.0), Q0, 1.0) == pytest.approx(T * 2)
    # stale link: no target, no raise
    assert c.bandwidth_target(link("congested", cap=25e9, at=0.0), 100.0) is None


def test_hysteresis_band_holds_t() -> None:
    # utilisation flapping between 0.65 and 0.79 is inside (util_clear, util_scarce): no change
    t = T * 2
    for i, u in enumerate([0.65, 0.79, 0.7, 0.75] * 5):
        lk = link("ok", u, at=NOW)
        t2 = effective_threshold(T, lk, Q0, prev_t=t, dt_s=1.0, now=NOW, params=P)
        assert t2 == t, i
    assert link_pressure(link("warn", 0.1), Q0, NOW, P) == "hold"
    assert link_pressure(link("ok", 0.5), Q0, NOW, P) == "lower"
    # PrfaaS still waiting 3 s per instance, PD-P less: not yet clear
    assert link_pressure(link("ok", 0.5), QueueSignal(3.0, 1.0), NOW, P) == "hold"
    # PD-P has caught up with PrfaaS: the raise went far enough, push back
    assert link_pressure(link("ok", 0.5), QueueSignal(3.0, 4.0), NOW, P) == "lower"


def test_queue_surge_raises_t_even_without_link_state() -> None:
    t = effective_threshold(T, None, SURGE, prev_t=T, dt_s=2.0, now=NOW, params=P)
    assert t == pytest.approx(T * 2.25)
    # unknown link and a calm queue: hold (no evidence either way)
    assert effective_threshold(T, None, Q0, prev_t=2 * T, dt_s=5.0, now=NOW, params=P) == 2 * T


def test_queue_surge_never_raises_t_when_pd_p_is_as_backed_up() -> None:
    # Balanced load: both clusters wait 12 s. Raising t would only move the queue to PD-P.
    both = QueueSignal(12.0, 12.0)
    assert link_pressure(link("ok", 0.3), both, NOW, P) == "lower"
    assert effective_threshold(T, link(), both, prev_t=T, dt_s=5.0, now=NOW, params=P) == T
    # and an earlier raise falls back: excess T halves in 10 s
    t = effective_threshold(T, link(), both, prev_t=2 * T, dt_s=10.0, now=NOW, params=P)
    assert t == pytest.approx(1.5 * T)
    # A queue raise continues only while PD-P stays shorter than PrfaaS.
    c = ThresholdController(T, P, now=0.0)
    assert c.update(link(at=1.0), SURGE, 1.0) == pytest.approx(T * 1.5)
    # PD-P overtook PrfaaS on a quiet link: the excess decays (half-life 10 s), no more raise
    t2 = c.update(link(at=2.0), QueueSignal(12.0, 13.0), 2.0)
    assert t2 == pytest.approx(T + 0.5 * T * 0.5**0.1)
    # a link report carries no queue signal: the controller keeps the last one it saw
    assert T < c.update(link(at=3.0), None, 3.0) < t2


def test_raised_t_changes_routing_of_mid_length_requests() -> None:
    # 25,000 uncached tokens offload at t=19,400 but stay local once congestion raised t
    c = ThresholdController(T, P, now=0.0)
    t_hot = c.update(link("congested", at=1.0), Q0, 1.0)
    assert (
        route(RouteRequest("r", 25_000), match(), T, link(), VIEW, COSTS, P, NOW).target == "prfaas"
    )
    d = route(RouteRequest("r", 25_000), match(), t_hot, link(), VIEW, COSTS, P, NOW)
    assert d.target == "pd" and d.effective_t == pytest.approx(T * 1.5)


def test_zero_threshold_can_still_rise() -> None:
    t = effective_threshold(0.0, link("congested"), Q0, prev_t=0.0, dt_s=1.0, now=NOW, params=P)
    assert t == pytest.approx(512.0)
    assert math.isfinite(t)


def test_fast_curves_match_profile_interpolation() -> None:

    from xdc.scheduler.policy import costs_from_profile
    from xdc.scheduler.profile import load_profile

    prof = load_profile(REPO / "deploy/profiles/prfaas-case-study.toml")
    costs = costs_from_profile(prof)
    for total in (1, 100, 1024, 5000, 8192, 20_000, 131_072, 300_000):
        for cached in (0, 512, 1024, 4096):
            if cached >= total:
                continue
            new = max(total - cached, 1)
            for inst, fn in ((prof.pd, costs.pd_prefill_s), (prof.prfaas, costs.prfaas_prefill_s)):
                want = (
                    inst.prefill_time(total)
                    if cached == 0
                    else max(
                        inst.prefill_time(total) - inst.prefill_time(cached), inst.prefill_time(new)
                    )
                )
                assert fn(total, cached) == pytest.approx(want, rel=1e-12, abs=1e-12)
            want_kv = (
                prof.prfaas.kv_size(total)
                if cached == 0
                else max(
                    prof.prfaas.kv_size(total) - prof.prfaas.kv_size(cached),
                    prof.prfaas.kv_size(new),
                )
            )
            assert costs.kv_bytes(total, cached) == pytest.approx(want_kv, rel=1e-12)
    assert costs.egress_bps == 100e9


# --- links and decode intakes out of use (scheduler.outages) -----------------------------------


def test_nothing_is_offloaded_over_a_link_that_is_down() -> None:
    m = match()
    d = route(RouteRequest("r1", 40_000), m, T, link(), VIEW, COSTS, P, NOW)
    assert d.target == "prfaas"
    down = {"prfaas": "link prfaas->pd dark: no report for 2.5s"}
    d = route(RouteRequest("r1", 40_000), m, T, link(), VIEW, COSTS, P, NOW, links_down=down)
    assert d.target == "pd" and not d.rejected, d
    assert d.reasons[0] == "PrfaaS prfaas not used: link prfaas->pd dark: no report for 2.5s"


def test_with_two_prfaas_clusters_a_down_link_sends_its_share_to_the_other() -> None:
    view = ClusterView(
        prfaas_prefill=(NodeLoad("f0"), NodeLoad("g0")),
        pd_prefill=VIEW.pd_prefill,
        pd_decode=VIEW.pd_decode,
        prfaas_by_cluster={"fa": (NodeLoad("f0"),), "fb": (NodeLoad("g0"),)},
    )
    links = {"fa": link(), "fb": link()}
    w = {"fa": 1.0, "fb": 1.0}
    targets = {
        route(RouteRequest(f"r{i}", 40_000), match(), T, links, view, COSTS, P, NOW, w).target
        for i in range(40)
    }
    assert targets == {"fa", "fb"}
    for i in range(40):
        d = route(
            RouteRequest(f"r{i}", 40_000),
            match(),
            T,
            links,
            view,
            COSTS,
            P,
            NOW,
            w,
            links_down={"fa": "sender_down"},
        )
        assert d.target == "fb", d.reasons


def test_offloaded_kv_goes_only_to_decode_nodes_that_take_it_in() -> None:
    m = match()
    d = route(RouteRequest("r1", 40_000), m, T, link(), VIEW, COSTS, P, NOW)
    assert (d.target, d.decode_node) == ("prfaas", "d1")  # the less loaded
    d = route(
        RouteRequest("r1", 40_000), m, T, link(), VIEW, COSTS, P, NOW, intakes_down={"d1": "x"}
    )
    assert (d.target, d.decode_node) == ("prfaas", "d0")
    # no decode node takes KV: the request prefills in PD-P, and d1 (least loaded) decodes
    both = {"d0": "receiver_gone", "d1": "receiver_gone"}
    d = route(RouteRequest("r1", 40_000), m, T, link(), VIEW, COSTS, P, NOW, intakes_down=both)
    assert (d.target, d.decode_node) == ("pd", "d1") and not d.rejected, d
    assert "no decode node takes KV in now" in d.reasons[-1]
    # a short request that stays in PD-P is not affected
    d = route(RouteRequest("r2", 1_000), m, T, link(), VIEW, COSTS, P, NOW, intakes_down=both)
    assert (d.target, d.decode_node) == ("pd", "d1")


# --- which decode node -------------------------------------------------------------------------

PD_MIXED = ClusterView(
    prfaas_prefill=(NodeLoad("f0"),),
    pd_prefill=(NodeLoad("pd-p", instance="A"), NodeLoad("pd2-p", instance="B")),
    pd_decode=(NodeLoad("pd-d", 0.0, 0.3, "A"), NodeLoad("pd2-d", 0.0, 0.1, "B")),
)


def test_a_pd_prefill_decodes_on_its_own_instance_where_its_kv_already_is() -> None:
    """PD-mixed instances (one PD-P and one PD-D node each): a request prefilled on pd-p for
    its cached prefix decodes on pd-d, not on the less loaded pd2-d (which would need the KV
    sent over and has no sender)."""
    d = route(
        RouteRequest("r1", 1_000), match(pd=2, **{"pd-p": 2}), T, link(), PD_MIXED, COSTS, P, NOW
    )
    assert (d.target, d.prefill_node, d.decode_node) == ("pd", "pd-p", "pd-d"), d.reasons
    # full: then another instance decodes
    full = ClusterView(
        PD_MIXED.prfaas_prefill,
        PD_MIXED.pd_prefill,
        (NodeLoad("pd-d", 0.0, 1.0, "A"), NodeLoad("pd2-d", 0.0, 0.1, "B")),
    )
    d = route(RouteRequest("r1", 1_000), match(pd=2, **{"pd-p": 2}), T, link(), full, COSTS, P, NOW)
    assert d.decode_node == "pd2-d"


def test_offloaded_kv_goes_where_its_prefix_is_cached_unless_that_node_is_much_busier() -> None:
    m = match(prfaas=4, pd=4, **{"pd-p": 4})  # pd-p's instance (A) holds 4 blocks of it
    d = route(RouteRequest("r1", 40_000), m, T, link(), PD_MIXED, COSTS, P, NOW)
    assert (d.target, d.decode_node) == ("prfaas", "pd-d"), d.reasons  # load 0.3 vs 0.1
    busy = ClusterView(
        PD_MIXED.prfaas_prefill,
        PD_MIXED.pd_prefill,
        (NodeLoad("pd-d", 0.0, 0.6, "A"), NodeLoad("pd2-d", 0.0, 0.1, "B")),
    )
    d = route(RouteRequest("r1", 40_000), m, T, link(), busy, COSTS, P, NOW)
    assert (d.target, d.decode_node) == ("prfaas", "pd2-d")  # beyond the slack: load wins
    d = route(RouteRequest("r1", 40_000), match(), T, link(), PD_MIXED, COSTS, P, NOW)
    assert d.decode_node == "pd2-d"  # nothing cached: the least loaded


# --- keep_local_when_faster (issue 32) -----------------------------------------------------

EQUAL = CostModel(  # PrfaaS no faster than PD-P: the engines `xdc up` measures on one CPU
    prfaas_prefill_s=lambda total, cached: 2e-4 * (total - cached) + 0.1,
    pd_prefill_s=lambda total, cached: 2e-4 * (total - cached) + 0.1,
    kv_bytes=lambda upto, already: 50_000.0 * max(upto - already, 0),
    egress_bps=100e9,
)


def _equal_speed(view: ClusterView, keep: bool) -> Decision:
    params = PolicyParams(block_size=512, ttft_slo_s=10.0, keep_local_when_faster=keep)
    req = RouteRequest("r1", 30_000, (), None)
    return route(req, match(), T, link(), view, EQUAL, params, NOW)


def test_an_offload_predicted_no_faster_than_pd_p_stays_local_when_asked() -> None:
    d = _equal_speed(VIEW, keep=False)
    assert d.target == "prfaas"  # the paper's rule: 30K tokens > t offloads
    d = _equal_speed(VIEW, keep=True)
    assert d.target == "pd" and d.prefill_node in ("p0", "p1"), d
    assert any("kept local (keep_local_when_faster)" in r for r in d.reasons), d.reasons


def test_a_busy_pd_p_still_offloads_with_keep_local_when_faster() -> None:
    busy = ClusterView(
        prfaas_prefill=VIEW.prfaas_prefill,
        pd_prefill=(NodeLoad("p0", queue_s=3.0), NodeLoad("p1", queue_s=3.0)),
        pd_decode=VIEW.pd_decode,
    )
    d = _equal_speed(busy, keep=True)
    assert d.target == "prfaas", d.reasons  # 3 s of queue in PD-P: offloading is faster
