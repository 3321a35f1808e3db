"""The profile corrected by what the engines report (issue 32): the estimator's ratio of
measured to profiled prefill time (pooled, smoothed, clamped), the scaled profile, the scrape
windows it is fed, and a live router whose PD engine slows down mid-run: the router sees it,
re-solves t with the corrected curve, and says so in /v1/state and /metrics."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from xdc.scheduler.drift import (
    DriftEstimator,
    PrefillWindow,
    factors_from_json,
    predicted_seconds,
    scaled,
)
from xdc.scheduler.profile import load_profile
from xdc.scheduler.service.router_app import VLLM_POLLER
from xdc.scheduler.vllm_metrics import EngineLoad, parse_metrics, prefill_window

from tests.router_fixtures import MetricsEndpoint, vllm_scrape
from tests.router_rig import RouterRig

PROFILE = Path(__file__).resolve().parents[2] / "deploy/profiles/prfaas-case-study.toml"
MEASURED = Path(__file__).resolve().parents[2] / "deploy/profiles/measured-2core-vm.toml"


def window(n: int, length: int, slowdown: float) -> PrefillWindow:
    """``n`` prefills of ``length`` tokens on an engine ``slowdown`` x its profile."""
    pd = load_profile(PROFILE).pd
    return PrefillWindow(n, n * pd.prefill_time(length) * slowdown, n * length)


def test_an_engine_as_fast_as_its_profile_keeps_the_factor_at_one() -> None:
    d = DriftEstimator()
    for _ in range(3):
        d.observe("pd", window(10, 8192, 1.0), load_profile(PROFILE).pd)
    assert d.factor("pd") == pytest.approx(1.0) and d.factor("prfaas") == 1.0
    assert d.state()["pd"]["requests"] == 30


def test_a_slower_engine_moves_the_factor_towards_its_ratio_after_enough_requests() -> None:
    pd = load_profile(PROFILE).pd
    d = DriftEstimator(min_requests=8, alpha=0.5)
    d.observe("pd", window(5, 8192, 3.0), pd)
    assert d.factor("pd") == 1.0  # 5 prefills are not enough to judge
    d.observe("pd", window(5, 8192, 3.0), pd)
    assert d.factor("pd") == pytest.approx(3.0)  # the first judgement is taken as it is
    d.observe("pd", window(10, 8192, 1.0), pd)
    assert d.factor("pd") == pytest.approx(2.0)  # then smoothed: half way back
    assert d.state()["pd"]["last_ratio"] == pytest.approx(1.0)


def test_the_factor_is_clamped_and_nonsense_windows_are_ignored() -> None:
    pd = load_profile(PROFILE).pd
    d = DriftEstimator(min_requests=1, limit=10.0)
    d.observe("pd", window(10, 8192, 1000.0), pd)
    assert d.factor("pd") == 10.0
    for bad in (PrefillWindow(0, 1.0, 10), PrefillWindow(3, -1.0, 10), PrefillWindow(3, 1.0, 0)):
        d.observe("prfaas", bad, pd)
    assert d.state()["prfaas"]["windows"] == 0


def test_the_scaled_profile_changes_prefill_only() -> None:
    p = load_profile(PROFILE)
    s = scaled(p, {"pd": 2.0})
    assert s.pd.prefill_s == tuple(2 * t for t in p.pd.prefill_s)
    assert s.prfaas == p.prfaas and s.pd.kv_bytes == p.pd.kv_bytes
    assert s.pd.decode_rate_rps == p.pd.decode_rate_rps


def test_factors_another_replica_published_are_taken_only_whole_and_clamped() -> None:
    assert factors_from_json({"prfaas": 1, "pd": 2.5}) == {"prfaas": 1.0, "pd": 2.5}
    assert factors_from_json({"prfaas": 0.001, "pd": 1e9}) == {"prfaas": 0.1, "pd": 10.0}
    bad: object
    for bad in (None, [], {"pd": 2.0}, {"prfaas": 1, "pd": "2"}, {"prfaas": True, "pd": 1}):
        assert factors_from_json(bad) is None, bad
    assert factors_from_json({"prfaas": 1, "pd": float("nan")}) is None


BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, math.inf)  # vLLM's 1-2-5


def _histogram(lengths: list[int]) -> str:
    lines = [
        f'vllm:request_prompt_tokens_bucket{{le="{"+Inf" if math.isinf(b) else float(b)}"}} '
        f"{sum(1 for n in lengths if n <= b)}"
        for b in BUCKETS
    ]
    return "\n".join(lines) + "\n"


def test_a_mix_of_short_and_long_prompts_as_fast_as_profiled_reads_as_no_drift() -> None:
    """The curve is convex: priced at the mean length, 20 prompts of 32 tokens and 20 of
    3,000 read as an engine ~1.4x slower than it is; priced per histogram bucket, as it is."""
    pd = load_profile(MEASURED).pd  # xdc up's engines, as measured on the 2-core VM
    lengths = [32] * 20 + [3000] * 20
    seconds = sum(pd.prefill_time(n) for n in lengths)
    before = parse_metrics(vllm_scrape(0, 0.0, 0.0) + _histogram([]))
    after = parse_metrics(vllm_scrape(40, seconds, sum(lengths)) + _histogram(lengths))
    w = prefill_window(after, before)
    assert w is not None and sum(k for _, _, k in w.lengths) == 40
    assert (20.0, 50.0, 20) in w.lengths and (2000.0, 5000.0, 20) in w.lengths
    assert predicted_seconds(w, pd) == pytest.approx(seconds, rel=0.05)
    at_mean = dataclasses.replace(w, lengths=())  # an engine that exports no histogram
    assert seconds / predicted_seconds(at_mean, pd) > 1.3
    est = DriftEstimator()
    est.observe("pd", w, pd)
    assert est.factor("pd") == pytest.approx(1.0, rel=0.05)


def test_a_histogram_that_changed_shape_or_went_backwards_falls_back_to_the_mean() -> None:
    before = parse_metrics(vllm_scrape(10, 1.0, 5000) + _histogram([500] * 10))
    went_back = parse_metrics(vllm_scrape(20, 2.0, 9000) + _histogram([500] * 5))
    w = prefill_window(went_back, before)
    assert w is not None and w.lengths == () and w.n == 10
    other = parse_metrics(
        vllm_scrape(20, 2.0, 9000) + 'vllm:request_prompt_tokens_bucket{le="+Inf"} 20\n'
    )
    w = prefill_window(other, before)
    assert w is not None and w.lengths == ()


def test_a_hostile_prompt_histogram_is_refused_or_priced_at_the_mean_never_a_crash() -> None:
    """What a scraped endpoint may send: bucket counts that sum past any engine's (two label
    sets of 1e308 overflowed to inf, and int(inf) ended the poller), bounds that are no
    prompt length, and buckets no length can be read from ((0, 0], a lone +Inf: the
    estimator divided by zero)."""
    overflow = 'vllm:request_prompt_tokens_bucket{{le="5",a="{a}"}} 1e308\n'
    with pytest.raises(ValueError, match="sums to inf"):
        parse_metrics(vllm_scrape(1, 1.0, 5) + overflow.format(a=1) + overflow.format(a=2))
    for bad in ("-5", "NaN"):
        with pytest.raises(ValueError, match="not a prompt length"):
            parse_metrics(
                vllm_scrape(1, 1.0, 5) + f'vllm:request_prompt_tokens_bucket{{le="{bad}"}} 1\n'
            )
    pd = load_profile(MEASURED).pd
    for buckets in ('{le="0"} %d\n', '{le="+Inf"} %d\n'):
        line = "vllm:request_prompt_tokens_bucket" + buckets
        before = parse_metrics(vllm_scrape(0, 0.0, 0.0) + line % 0)
        after = parse_metrics(vllm_scrape(10, 1.0, 5000.0) + line % 10)
        w = prefill_window(after, before)
        assert w is not None and w.lengths
        assert predicted_seconds(w, pd) == pytest.approx(10 * pd.prefill_time(500))


def test_a_scrape_window_is_what_finished_between_two_scrapes() -> None:
    a = EngineLoad(0, 1, 0.1, 5.0, 10, 10_000.0)
    b = EngineLoad(0, 1, 0.1, 8.0, 14, 18_000.0)
    assert prefill_window(b, a) == PrefillWindow(4, 3.0, 8_000.0)
    assert prefill_window(b, None) is None  # the first scrape has nothing to compare with
    assert prefill_window(a, b) is None  # counters went back: the engine restarted
    assert prefill_window(EngineLoad(0, 1, 0.1, 9.0, 15, 18_000.0), b) is None  # no tokens


def test_a_pd_engine_that_slows_down_mid_run_is_corrected_for_on_the_long_timescale(
    endpoint: MetricsEndpoint,
) -> None:
    pd = load_profile(PROFILE).pd
    per = pd.prefill_time(8192)  # the profile's seconds for one 8K-token prefill
    count, seconds, tokens = 0, 0.0, 0.0
    endpoint.body = vllm_scrape(count, seconds, tokens)
    with RouterRig() as rig:
        rig.start(
            "",
            vllm_metrics=(f"pd/eng-9@prefill=http://127.0.0.1:{endpoint.port}/metrics",),
            vllm_metrics_interval_s=0.05,
            replan_interval_s=0.3,
        )

        def finish(n: int, slowdown: float) -> None:
            nonlocal count, seconds, tokens
            scrapes = rig.router.app[VLLM_POLLER].scrapes
            count, seconds, tokens = count + n, seconds + n * per * slowdown, tokens + n * 8192
            endpoint.body = vllm_scrape(count, seconds, tokens)
            rig.wait_for(lambda: rig.router.app[VLLM_POLLER].scrapes >= scrapes + 2)

        rig.wait_for(lambda: rig.router.app[VLLM_POLLER].scrapes >= 1)
        finish(10, 1.0)  # as profiled
        rig.wait_for(lambda: rig.state()["profile_drift"]["measured"]["pd"]["windows"] == 1)
        before = rig.state()
        assert before["profile_drift"]["applied"]["pd"] == pytest.approx(1.0, rel=0.01)
        base_t = before["threshold"]["base_t"]
        for _ in range(3):  # then three times slower
            finish(10, 3.0)
        rig.wait_for(lambda: rig.state()["profile_drift"]["applied"]["pd"] > 2.5, timeout=10)
        after = rig.state()
        assert after["counts"]["profile_corrections"] >= 1
        assert after["profile_drift"]["applied"]["prfaas"] == 1.0  # no PrfaaS engine reported
        # PD prefill 2.5x+ slower than planned: offloading pays from shorter prompts on
        assert after["threshold"]["base_t"] < base_t, (base_t, after["threshold"])
        status, metrics = rig.router.call("GET", "/metrics")
        assert status == 200
        line = next(x for x in str(metrics).splitlines() if 'profile_drift{instance="pd"}' in x)
        assert float(line.split()[-1]) > 2.5, line
