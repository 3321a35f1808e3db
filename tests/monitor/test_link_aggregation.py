"""Links by id: one report type from monitor to router, many senders' shares combined into one
state per link, silent senders expiring, and the PrfaaS fleet's split following link capacity.
Pure: explicit clocks, no sockets."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
from xdc.monitor.link_estimator import LinkEstimator, Sample
from xdc.scheduler.link_table import (
    Held,
    LinkTable,
    LinkView,
    UnknownLink,
    combine,
    usable_capacity_bps,
)
from xdc.scheduler.policy import RouteRequest, offload_weights, pick_prfaas
from xdc.scheduler.profile import PrfaasCluster, Profile, load_profile
from xdc.scheduler.service.router import RouterService

from tests.paths import REPO
from xdc.config import MonitorConfig, RouterConfig
from xdc.linkreport import SCHEMA, LinkCause, LinkHealth, LinkId, LinkReport, report_problems

PROFILE = REPO / "deploy/profiles/prfaas-case-study.toml"
AB = LinkId("prfaas-a", "pd")


def rep(
    reporter: str,
    goodput: float,
    cap: float,
    *,
    state: str = "ok",
    retrans: float = 0.0,
    rtt: float = 2.0,
    at: float = 1.0,
    link: LinkId = AB,
) -> LinkReport:
    return LinkReport(
        link.src,
        link.dst,
        reporter,
        goodput / cap if cap else 0.0,
        goodput,
        cap,
        LinkHealth(state),
        retrans,
        rtt,
        at,
    )


# --- the one report type -------------------------------------------------------------------


def test_report_json_round_trip_and_schema_agree() -> None:
    r = rep("s1", 3e9, 10e9, state="warn", retrans=0.004)
    assert LinkReport.from_json(r.to_json()) == r
    assert set(r.to_json()) == set(SCHEMA["properties"]) == {*SCHEMA["required"], "cause"}
    # cause is optional (older senders): absent means clear; present it is checked
    old = {k: v for k, v in r.to_json().items() if k != "cause"}
    assert LinkReport.from_json(old).cause == "clear"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"goodput_bps": math.nan}, "goodput_bps"),
        ({"rtt_ms": -1}, "rtt_ms"),
        ({"capacity_bps": 1e300}, "capacity_bps"),
        ({"retrans_ratio": 1.5}, "retrans_ratio"),
        ({"utilisation": True}, "utilisation"),
        ({"state": "bad"}, "state"),
        ({"cause": "gremlins"}, "cause"),
        ({"from_cluster": "a b"}, "from_cluster"),
        ({"reporter": ""}, "reporter"),
        ({"extra": 1}, "unknown field"),
    ],
)
def test_report_problems_name_the_field(change: dict[str, object], problem: str) -> None:
    body = {**rep("s1", 1e9, 10e9).to_json(), **change}
    problems = report_problems(body)
    assert any(problem in p for p in problems), problems
    with pytest.raises(ValueError):
        LinkReport.from_json(body)


def test_monitor_snapshot_becomes_a_clamped_report() -> None:
    est = LinkEstimator(MonitorConfig(link_capacity_bps=10e9))
    snap = est.update(Sample(0.0, [], wall=1700000000.0))
    snap = dataclasses.replace(snap, rtt_ms=None, utilisation=-0.5, retrans_ratio=3.0)
    r = snap.report(AB, "sender-1")
    assert (r.from_cluster, r.to_cluster, r.reporter) == ("prfaas-a", "pd", "sender-1")
    assert r.rtt_ms == 0.0 and r.utilisation == 0.0 and r.retrans_ratio == 1.0
    assert r.capacity_bps == 10e9 and r.state == LinkHealth.OK.value
    assert report_problems(r.to_json()) == []


# --- aggregation ---------------------------------------------------------------------------


def test_two_senders_on_one_link_give_one_combined_state() -> None:
    table = LinkTable([AB], reporter_ttl_s=5.0)
    # each sender sees its share: 3 and 4 Gbit/s of a 10 Gbit/s link, each estimating 5-6
    assert table.accept(rep("s1", 3e9, 5e9, rtt=2.0, at=10.0), received_at=100.0)
    assert table.accept(
        rep("s2", 4e9, 6e9, state="warn", retrans=0.003, rtt=9.0, at=20.0), received_at=100.5
    )
    v = table.view(AB, 101.0)
    assert v is not None
    assert v.reporters == 2
    assert v.goodput_bps == pytest.approx(7e9)  # total goodput
    assert v.capacity_bps == pytest.approx(7e9)  # both backlogged: the sum is the link
    assert v.utilisation == pytest.approx(1.0)
    assert v.state == "warn" and v.retrans_ratio == 0.003 and v.rtt_ms == 9.0  # worst
    assert v.updated_at == 100.5


def test_capacity_is_the_largest_estimate_when_one_sender_had_the_link_alone() -> None:
    held = LinkTable([AB], 5.0)
    held.accept(rep("s1", 9e9, 10e9), 1.0)  # alone on the link: its estimate is the link
    held.accept(rep("s2", 0.5e9, 1e9), 1.0)  # just started
    v = held.view(AB, 1.0)
    assert v is not None and v.capacity_bps == 10e9 and v.goodput_bps == pytest.approx(9.5e9)


def test_a_silent_sender_expires_and_the_last_one_leaves_the_link_unknown() -> None:
    table = LinkTable([AB], reporter_ttl_s=5.0)
    table.accept(rep("s1", 3e9, 6e9, state="congested"), 100.0)
    table.accept(rep("s2", 4e9, 6e9), 103.0)
    assert table.view(AB, 104.0).state == "congested"  # type: ignore[union-attr]
    v = table.view(AB, 105.5)  # s1 silent for 5.5 s: gone, and its "congested" with it
    assert v is not None and v.reporters == 1 and v.state == "ok"
    assert v.goodput_bps == 4e9 and table.expired == 1
    assert table.view(AB, 108.5) is None  # s2 silent too: unknown
    assert set(table.reporters(AB)) == set()


def test_an_older_report_from_the_same_sender_is_ignored_but_not_another_senders() -> None:
    table = LinkTable([AB], 5.0)
    assert table.accept(rep("s1", 3e9, 6e9, at=50.0), 1.0)
    assert not table.accept(rep("s1", 1e9, 6e9, at=49.0), 1.1)  # reordered in flight
    assert table.accept(rep("s2", 1e9, 6e9, at=1.0), 1.2)  # another clock entirely
    assert table.view(AB, 1.2).goodput_bps == 4e9  # type: ignore[union-attr]


def test_unknown_link_is_refused() -> None:
    table = LinkTable([AB], 5.0)
    with pytest.raises(UnknownLink, match="prfaas-x->pd"):
        table.accept(rep("s1", 1e9, 2e9, link=LinkId("prfaas-x", "pd")), 1.0)


def test_capacity_follows_a_drop_as_the_senders_estimates_do() -> None:
    # 10 Gbit/s shared by two backlogged senders, then the path drops to 4 Gbit/s: each
    # sender's own estimate falls to its share within ~1 s, the combined capacity with it
    before = combine([])
    assert before is None
    table = LinkTable([AB], 5.0)
    table.accept(rep("s1", 5e9, 5e9), 1.0)
    table.accept(rep("s2", 5e9, 5e9), 1.0)
    assert table.view(AB, 1.0).capacity_bps == 10e9  # type: ignore[union-attr]
    table.accept(rep("s1", 2e9, 2e9), 2.0)
    table.accept(rep("s2", 2e9, 2e9), 2.0)
    assert table.view(AB, 2.0).capacity_bps == 4e9  # type: ignore[union-attr]


# --- several PrfaaS clusters ----------------------------------------------------------------


def test_rendezvous_pick_splits_by_weight_and_is_stable() -> None:
    w = {"prfaas-a": 4.0, "prfaas-b": 1.0}
    picks = Counter(pick_prfaas(f"r{i}", w) for i in range(20_000))
    assert picks["prfaas-a"] / 20_000 == pytest.approx(0.8, abs=0.015)
    assert all(pick_prfaas(f"r{i}", w) == pick_prfaas(f"r{i}", dict(w)) for i in range(100))
    # lowering b's weight only moves requests off b, never between a's requests
    w2 = {"prfaas-a": 4.0, "prfaas-b": 0.5}
    moved = [i for i in range(2000) if pick_prfaas(f"r{i}", w) != pick_prfaas(f"r{i}", w2)]
    assert all(pick_prfaas(f"r{i}", w) == "prfaas-b" for i in moved)
    assert pick_prfaas("r", {"prfaas-a": 0.0}) is None


def test_offload_weights_are_min_of_compute_and_link() -> None:
    from xdc.scheduler.planner import OffloadShape

    shape = OffloadShape(prefill_s=2.0, kv_bits=1e9)  # 1 Gbit/s per req/s
    w = offload_weights([("a", 4, 10e9), ("b", 4, 1e9), ("c", 1, 100e9)], shape)
    assert w == {"a": 2.0, "b": 1.0, "c": 0.5}  # a compute-bound, b link-bound, c compute


def two_cluster_profile(a_gbps: float = 10.0, b_gbps: float = 2.5) -> Profile:
    base = load_profile(PROFILE)
    fleet = (PrfaasCluster("prfaas-a", 4, a_gbps), PrfaasCluster("prfaas-b", 4, b_gbps))
    return dataclasses.replace(base, prfaas_clusters=fleet, n_prfaas=8, egress_gbps=a_gbps + b_gbps)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _offload_split(svc: RouterService, n: int, tag: str) -> Counter[str]:
    out: Counter[str] = Counter()
    for i in range(n):
        # a lax SLO: the split itself, not the SLO fallback, decides
        d, _ = svc.route(RouteRequest(f"{tag}{i}", 100_000, ttft_slo_s=1e4), dry_run=True)
        if d.target != "pd":
            out[d.target] += 1
    return out


def test_two_prfaas_clusters_split_traffic_by_link_capacity_and_follow_a_drop() -> None:
    clock = Clock()
    cfg = RouterConfig(gateway_token="g", daemon_token="d", link_stale_s=5.0)
    svc = RouterService(cfg, two_cluster_profile(10.0, 2.5), clock=clock)
    # both clusters are link-bound at these capacities: 10 : 2.5 = 4 : 1
    w = svc.weights(clock.now)
    assert w["prfaas-a"] / w["prfaas-b"] == pytest.approx(4.0, rel=0.01)
    split = _offload_split(svc, 2000, "x")
    assert sum(split.values()) == 2000  # 100K-token prompts all offload
    assert split["prfaas-a"] / 2000 == pytest.approx(0.8, abs=0.03)
    # the senders on prfaas-a's link report its capacity fell to 2.5 Gbit/s
    for s in ("a1", "a2"):
        svc.update_link(
            LinkReport("prfaas-a", "pd", s, 1.0, 1.25e9, 1.25e9, LinkHealth.OK, 0.0, 2.0, 1.0)
        )
    split = _offload_split(svc, 2000, "y")
    assert split["prfaas-a"] / 2000 == pytest.approx(0.5, abs=0.03)
    decision, _ = svc.route(RouteRequest("y7", 100_000, ttft_slo_s=1e4), dry_run=True)
    assert decision.target != "pd" and decision.link == f"{decision.target}->pd"
    # the senders go silent: after router.link_dark_s the link is dark and nothing is
    # offloaded over it (issue 28); prfaas-b takes every offload
    clock.now += 2.5
    split = _offload_split(svc, 2000, "z")
    assert split == {"prfaas-b": 2000}, split
    decision, _ = svc.route(RouteRequest("z1", 100_000, ttft_slo_s=1e4), dry_run=True)
    assert any("PrfaaS prfaas-a not used: link prfaas-a->pd dark" in r for r in decision.reasons)
    # they report again after their old reports expired: the configured 10 Gbit/s stands
    # again beside the fresh report's own estimate, and the split follows it
    clock.now += 4.0
    for s in ("a1", "a2"):
        svc.update_link(
            LinkReport("prfaas-a", "pd", s, 0.0, 0.0, 0.0, LinkHealth.OK, 0.0, 2.0, 2.0)
        )
    split = _offload_split(svc, 2000, "w")
    assert split["prfaas-a"] / 2000 == pytest.approx(0.8, abs=0.03)


def test_cache_affinity_beats_the_capacity_pick_when_it_is_faster() -> None:
    from xdc.scheduler.cacheindex import CacheEvent

    clock = Clock()
    cfg = RouterConfig(gateway_token="g", daemon_token="d")
    svc = RouterService(cfg, two_cluster_profile(10.0, 10.0), clock=clock)
    hashes = tuple(range(1, 201))  # 200 blocks = 102,400 tokens
    for c in ("prfaas-a", "prfaas-b"):
        svc.update_link(LinkReport(c, "pd", "s", 0.1, 1e9, 10e9, LinkHealth.OK, 0.0, 2.0, 1.0))
    svc.apply_events([CacheEvent("stored", "prfaas-b", "prfaas-b-1", 1, hashes[:150])])
    targets = Counter(
        svc.route(RouteRequest(f"c{i}", 102_400, hashes), dry_run=True)[0].target
        for i in range(200)
    )
    assert targets == {"prfaas-b": 200}
    d, _ = svc.route(RouteRequest("c0", 102_400, hashes), dry_run=True)
    assert d.prefill_node == "prfaas-b-1" and d.cached_tokens == 150 * 512


def test_planner_sums_the_fleet() -> None:
    from xdc.scheduler.planner import solve

    one = load_profile(PROFILE)
    two = two_cluster_profile(50.0, 50.0)  # 8 instances, 100 Gbit/s in total, evenly
    doubled = dataclasses.replace(one, n_prfaas=8)
    assert solve(two).lambda_max == pytest.approx(solve(doubled).lambda_max, rel=1e-6)
    starved = two_cluster_profile(50.0, 0.5)  # b's link nearly gone: its instances idle
    assert solve(starved).lambda_max < solve(two).lambda_max


def test_a_congested_link_counts_with_its_goodput_but_never_below_the_floor_share() -> None:
    def view(state: str, goodput: float, cap: float = 10e9) -> LinkView:
        return LinkView(
            goodput / cap, goodput, cap, LinkHealth(state), 0.0, 50.0, 0.0, cause=LinkCause.QUEUE
        )

    assert usable_capacity_bps(view("ok", 3e9), 0.1) == 10e9  # not congested: capacity
    assert usable_capacity_bps(view("warn", 3e9), 0.1) == 10e9
    assert usable_capacity_bps(view("congested", 3e9), 0.1) == 3e9  # what others leave us
    assert usable_capacity_bps(view("congested", 1e6), 0.1) == 1e9  # app-limited: the floor
    assert usable_capacity_bps(view("congested", 0.0), 0.1) == 10e9  # nothing measured


def test_the_worst_reporter_names_the_cause() -> None:
    a = rep("s1", 3e9, 10e9, state="ok")
    b = LinkReport.from_json(
        {**rep("s2", 3e9, 10e9, state="congested").to_json(), "cause": "queue"}
    )
    c = LinkReport.from_json({**rep("s3", 1e9, 10e9, state="ok").to_json(), "cause": "random_loss"})
    held = [Held(r, 1.0) for r in (a, b, c)]
    v = combine(held)
    assert v is not None and v.state == "congested" and v.cause == "queue"
    v = combine([Held(a, 1.0), Held(c, 1.0)])
    assert v is not None and v.state == "ok" and v.cause == "random_loss"
