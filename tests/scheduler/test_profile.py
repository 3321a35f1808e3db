"""Profiles: interpolation, workload distribution functions, sampling, traces, loading."""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xdc.scheduler.profile import (
    MIB,
    InstanceProfile,
    Profile,
    ProfileError,
    Workload,
    interpolate,
    linear_pieces,
    load_profile,
    profile_from_dict,
)

from tests.paths import REPO

ROOT = REPO
CASE = ROOT / "deploy/profiles/prfaas-case-study.toml"
DEMO = ROOT / "deploy/profiles/small-demo.toml"


def _inst(**kw: Any) -> InstanceProfile:
    base: dict[str, Any] = {
        "name": "x",
        "gpus": 8,
        "lengths": (1000, 2000, 4000),
        "prefill_s": (1.0, 3.0, 4.0),
        "kv_bytes": (10.0, 20.0, 40.0),
        "decode_rate_rps": 1.0,
    }
    base.update(kw)
    return InstanceProfile(**base)


# ------------------------------------------------------------------ interpolation


def test_interpolation_hits_knots_and_is_linear_between() -> None:
    inst = _inst()
    assert [inst.prefill_time(x) for x in (1000, 2000, 4000)] == [1.0, 3.0, 4.0]
    assert inst.prefill_time(1500) == pytest.approx(2.0)
    assert inst.prefill_time(3000) == pytest.approx(3.5)
    assert inst.kv_size(3000) == pytest.approx(30.0)
    assert isinstance(inst.prefill_time(1234.5), float)


def test_interpolation_extrapolates_linearly_and_never_negative() -> None:
    inst = _inst()
    # Right of the table: slope of the last segment (0.5 s per 1000 tokens).
    assert inst.prefill_time(8000) == pytest.approx(4.0 + 4 * 0.5)
    assert inst.kv_size(6000) == pytest.approx(60.0)
    # Left of the table: slope of the first segment (2 s per 1000) runs below zero -> clipped.
    assert inst.prefill_time(800) == pytest.approx(0.6)
    assert inst.prefill_time(500) == 0.0
    assert inst.prefill_time(0) == 0.0
    falling = _inst(prefill_s=(3.0, 2.0, 1.0))
    assert falling.prefill_time(5000) == pytest.approx(0.5)
    assert falling.prefill_time(9000) == 0.0


@settings(max_examples=60, deadline=None)
@given(
    ys=st.lists(st.floats(0, 100, allow_nan=False), min_size=2, max_size=6),
    xs_raw=st.lists(st.integers(1, 10_000), min_size=6, max_size=6, unique=True),
    probes=st.lists(st.floats(0, 40_000, allow_nan=False), min_size=1, max_size=20),
)
def test_linear_pieces_reproduce_the_interpolated_curve(
    ys: list[float], xs_raw: list[int], probes: list[float]
) -> None:
    xs = sorted(xs_raw)[: len(ys)]
    pieces = linear_pieces(xs, ys)
    assert pieces[0].lo == 0.0 and math.isinf(pieces[-1].hi)
    for a, b in itertools.pairwise(pieces):
        assert a.hi == b.lo
    for x in probes:
        piece = next(p for p in pieces if p.lo <= x <= p.hi)
        via_piece = piece.intercept + piece.slope * x
        assert via_piece == pytest.approx(float(interpolate(xs, ys, x)), abs=1e-6)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"lengths": (1000,), "prefill_s": (1.0,), "kv_bytes": (1.0,)}, "lengths"),
        ({"lengths": (1000, 1000, 4000)}, "lengths"),
        ({"lengths": (0, 1000, 4000)}, "lengths"),
        ({"prefill_s": (1.0, 2.0)}, "prefill_s"),
        ({"kv_bytes": (1.0, -2.0, 3.0)}, "kv_bytes"),
        ({"gpus": 0}, "gpus"),
        ({"decode_rate_rps": -1.0}, "decode_rate_rps"),
    ],
)
def test_instance_profile_rejects_bad_tables(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ProfileError, match=field):
        _inst(**kw)


# ------------------------------------------------------------------ workload


def _lognormal_pdf(x: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    out: np.ndarray = np.exp(-((np.log(x) - mu) ** 2) / (2 * sigma**2)) / (
        x * sigma * math.sqrt(2 * math.pi)
    )
    return out


def test_lognormal_cdf_and_partial_mean_match_numeric_integration() -> None:
    wl = Workload.lognormal(9.9, 1.0, 128, 131072, output_tokens=1024)
    x = np.geomspace(128, 131072, 400_001)
    pdf = _lognormal_pdf(x, 9.9, 1.0)
    mass = np.trapezoid(pdf, x)
    cdf = np.concatenate([[0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))]) / mass
    xm = x * pdf
    pm = np.concatenate([[0], np.cumsum((xm[1:] + xm[:-1]) / 2 * np.diff(x))]) / mass
    for t in (128, 500, 5000, 19400, 60000, 131072):
        i = int(np.searchsorted(x, t))  # compare at the grid point nearest above t
        assert float(wl.cdf(x[i])) == pytest.approx(cdf[i], abs=1e-7)
        assert float(wl.partial_mean(x[i])) == pytest.approx(pm[i], rel=1e-6, abs=1e-3)
    assert float(wl.cdf(100)) == 0.0 and float(wl.cdf(1e9)) == 1.0
    # The paper describes this workload's mean as "approximately 27K tokens".
    assert wl.mean == pytest.approx(pm[-1], rel=1e-6)
    assert 26_500 < wl.mean < 28_500


def test_empirical_distribution_functions_are_exact() -> None:
    wl = Workload.empirical([4000, 1000, 2000, 2000, 10000], output_tokens=100)
    assert list(wl.cdf([999, 1000, 2000, 3999, 10000])) == [0.0, 0.2, 0.6, 0.6, 1.0]
    assert float(wl.partial_mean(2000)) == pytest.approx((1000 + 2000 + 2000) / 5)
    assert wl.mean == pytest.approx(19000 / 5)
    assert (wl.min_length, wl.max_length) == (1000, 10000)
    # Thresholds between distinct lengths; the largest offloads nothing so it is left out.
    assert list(wl.threshold_grid.t) == [1000, 2000, 4000]


def test_lognormal_samples_are_truncated_reproducible_and_unbiased() -> None:
    wl = Workload.lognormal(9.9, 1.0, 128, 131072, output_tokens=1024)
    a = wl.samples(200_000, seed=7)
    assert a.shape == (200_000,)
    assert a.min() >= 128 and a.max() <= 131072
    assert np.array_equal(a, wl.samples(200_000, seed=7))
    assert not np.array_equal(a[:100], wl.samples(100, seed=8))
    assert a.mean() == pytest.approx(wl.mean, rel=0.01)
    assert (a > 19400).mean() == pytest.approx(1 - float(wl.cdf(19400)), abs=0.005)


def test_narrow_truncation_sampling_still_exact() -> None:
    # Window far in the tail: rejection would accept ~1e-4 of draws, so inverse-CDF is used.
    wl = Workload.lognormal(5.0, 0.5, 1000, 2000, output_tokens=10)
    a = wl.samples(3000, seed=1)
    assert a.min() >= 1000 and a.max() <= 2000
    assert a.mean() == pytest.approx(wl.mean, rel=0.01)


def test_empirical_samples_come_from_the_list() -> None:
    wl = Workload.empirical([100, 200, 300], output_tokens=5)
    s = wl.samples(3000, seed=3)
    assert set(s.tolist()) == {100.0, 200.0, 300.0}
    assert s.mean() == pytest.approx(200, rel=0.03)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"sigma": 0.0}, "sigma"),
        ({"min_tokens": 0.0}, "min_tokens"),
        ({"max_tokens": 100.0}, "max_tokens"),
        ({"output_tokens": 0.0}, "output_tokens"),
    ],
)
def test_workload_rejects_bad_parameters(kw: dict[str, float], field: str) -> None:
    args: dict[str, float] = {
        "mu": 9.9,
        "sigma": 1.0,
        "min_tokens": 128,
        "max_tokens": 131072,
        "output_tokens": 1024,
    }
    args.update(kw)
    with pytest.raises(ProfileError, match=field):
        Workload.lognormal(**args)


# ------------------------------------------------------------------ traces


def _write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_lengths_and_mean_output(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 1200, "output_length": 30, "hash_ids": [0, 1, 3]},
        {"timestamp": 9, "input_length": 600, "output_length": 20, "hash_ids": [4, 5]},
    ]
    path = _write_trace(tmp_path / "t.jsonl", rows)
    wl = Workload.from_trace(path)
    assert sorted(wl.lengths) == [600, 1200, 1500]
    assert wl.output_tokens == pytest.approx(20.0)
    # With an unbounded prefix cache the second request reuses blocks 0 and 1 (2 x 512 tokens).
    cached = Workload.from_trace(path, output_tokens=64, prefix_cache=True, block_tokens=512)
    assert sorted(cached.lengths) == [176, 600, 1500]
    assert cached.output_tokens == 64


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 10, "output_length": 1}\n{"input_length": "x"}\n')
    with pytest.raises(ProfileError, match=r"bad.jsonl:2: input_length"):
        Workload.from_trace(bad)
    nojson = tmp_path / "nojson.jsonl"
    nojson.write_text("{oops\n")
    with pytest.raises(ProfileError, match=r"nojson.jsonl:1: not valid JSON"):
        Workload.from_trace(nojson)
    no_out = _write_trace(tmp_path / "noout.jsonl", [{"input_length": 5}])
    with pytest.raises(ProfileError, match="output_tokens"):
        Workload.from_trace(no_out)
    assert Workload.from_trace(no_out, output_tokens=3).lengths == (5,)


def test_mooncake_trace_loads(mooncake_trace: Path) -> None:
    wl = Workload.from_trace(mooncake_trace)
    # /work/shared/NOTES.md: 3,993 requests, mean input 15,325, mean output 149 tokens.
    assert len(wl.lengths) == 3993
    assert wl.mean == pytest.approx(15325, rel=0.001)
    assert wl.output_tokens == pytest.approx(149, abs=0.5)
    cached = Workload.from_trace(mooncake_trace, prefix_cache=True)
    assert cached.mean < wl.mean


# ------------------------------------------------------------------ loading


def test_case_study_profile_loads_with_derived_figures() -> None:
    prof = load_profile(CASE)
    assert (prof.n_prfaas, prof.n_pd, prof.homogeneous_instances) == (4, 8, 12)
    assert prof.egress_gbps == 100
    assert prof.prfaas.prefill_time(32768) == pytest.approx(1.84)
    assert prof.prfaas.kv_size(131072) == pytest.approx(2316.3 * MIB)
    # BS_max 20 / (25 ms * 1024 tokens) = 0.78125 req/s per H20 decode instance.
    assert prof.pd.decode_rate_rps == pytest.approx(0.78125)
    assert prof.prfaas.decode_rate_rps == 0.0
    assert prof.workload.kind == "lognormal" and prof.workload.output_tokens == 1024


def test_json_profile_equals_toml(tmp_path: Path) -> None:
    data = tomllib.loads(DEMO.read_text())
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(data))
    assert load_profile(path) == load_profile(DEMO)


def test_trace_workload_path_is_relative_to_profile(tmp_path: Path) -> None:
    _write_trace(tmp_path / "w.jsonl", [{"input_length": n, "output_length": 8} for n in (5, 9)])
    data = tomllib.loads(DEMO.read_text())
    data["workload"] = {"kind": "trace", "trace": "w.jsonl"}
    prof = profile_from_dict(data, base_dir=tmp_path)
    assert prof.workload.lengths == (5, 9)
    assert prof.workload.output_tokens == 8


def _mutate(path: str, value: Any) -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads(DEMO.read_text())
    *parents, leaf = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("pd.prefill_s", _DELETE, "pd.prefill_s: missing"),
        ("pd.prefill_s", [0.4], "pd.prefill_s: has 1 entries but lengths has 2"),
        ("prfaas.lengths", [11000, 1000], "prfaas.lengths: must be strictly increasing"),
        ("prfaas.lengths", [1000.5, 2000], "prfaas.lengths: every length must be a whole"),
        ("prfaas.kv_mib", [1, 2], "prfaas.kv_bytes: give exactly one of kv_bytes or kv_mib"),
        ("prfaas.prefill_s", "fast", "prfaas.prefill_s: expected a list of numbers"),
        ("prfaas.speed", 3, "prfaas.speed: unknown field"),
        ("pd.decode_rate_rps", _DELETE, "pd.decode_rate_rps: the PD instance type must decode"),
        ("pd.bs_max", 20, "pd.decode_rate_rps: give decode_rate_rps or bs_max"),
        ("cluster.egress_gbps", -1, "cluster.egress_gbps: must be finite and >= 0"),
        ("cluster.n_pd", 0, "cluster.n_pd: must be >= 1"),
        ("cluster.n_pd", 2.5, "cluster.n_pd: expected an integer"),
        ("cluster.n_prfaas", True, "cluster.n_prfaas: expected a number"),
        ("cluster.homogeneous_instances", 1, "cluster.homogeneous_instances: must be >= 2"),
        ("workload.kind", "zipf", "workload.kind: expected 'lognormal', 'empirical' or 'trace'"),
        ("workload.lengths", [], "workload.lengths: an empirical workload needs"),
        ("workload.output_tokens", _DELETE, "workload.output_tokens: missing"),
        ("cluster", _DELETE, "cluster: missing [cluster] table"),
        ("extra", {"a": 1}, "extra: unknown table"),
    ],
)
def test_bad_profiles_are_rejected_naming_the_field(
    tmp_path: Path, path: str, value: Any, needle: str
) -> None:
    data = _mutate(path, value)
    file = tmp_path / "bad.json"
    file.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_profile(file)
    assert needle in str(err.value)
    assert str(file) in str(err.value)


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    data = _mutate("cluster.n_pd", 0)
    data["pd"]["gpus"] = "eight"
    data["workload"]["kind"] = "lognormal"  # then mu, sigma, ... are missing
    with pytest.raises(ProfileError) as err:
        profile_from_dict(data)
    text = str(err.value)
    for needle in ("pd.gpus: expected a number", "workload.mu: missing", "workload.sigma"):
        assert needle in text


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"absent\.toml: cannot read: not found"):
        load_profile(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[cluster\nn_pd = 3\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_profile(broken)
    trace_missing = tmp_path / "p.toml"
    text = DEMO.read_text().split("[workload]")[0]
    trace_missing.write_text(text + '[workload]\nkind = "trace"\ntrace = "nope.jsonl"\n')
    with pytest.raises(ValueError, match=r"nope\.jsonl: cannot read: not found"):
        load_profile(trace_missing)


def test_profile_is_hashable_and_frozen() -> None:
    prof = load_profile(DEMO)
    assert isinstance(prof, Profile)
    assert hash(prof) == hash(load_profile(DEMO))
    with pytest.raises(AttributeError):
        prof.n_pd = 3  # type: ignore[misc]


def test_several_prfaas_clusters_load_and_sum() -> None:
    from xdc.scheduler.profile import PrfaasCluster

    root = REPO
    p = load_profile(root / "deploy/profiles/prfaas-two-clusters.toml")
    assert p.fleet == (PrfaasCluster("prfaas-a", 2, 40.0), PrfaasCluster("prfaas-b", 2, 8.0))
    assert (p.n_prfaas, p.egress_gbps) == (4, 48.0)
    live = p.with_fleet(egress_gbps={"prfaas-a": 2.0})
    assert live.egress_gbps == 10.0 and live.fleet[0].egress_gbps == 2.0
    one = load_profile(root / "deploy/profiles/prfaas-case-study.toml")
    assert [c.name for c in one.fleet] == ["prfaas"]


def test_bad_prfaas_cluster_tables_name_every_problem(tmp_path: Path) -> None:
    root = REPO
    text = (root / "deploy/profiles/prfaas-two-clusters.toml").read_text()
    bad = text.replace('name = "prfaas-b"', 'name = "prfaas-a"').replace(
        "[cluster]\n", "[cluster]\nn_prfaas = 4\n", 1
    )
    f = tmp_path / "bad.toml"
    f.write_text(bad.replace("egress_gbps = 8", 'egress_gbps = "fast"'))
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    msg = str(e.value)
    assert "cluster.n_prfaas" in msg and "egress_gbps" in msg
    f.write_text(text.replace('name = "prfaas-b"', 'name = "prfaas-a"'))
    with pytest.raises(ProfileError, match="duplicate"):
        load_profile(f)
