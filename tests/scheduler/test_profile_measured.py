"""From samples to a profile (``scheduler/measured.py``), without an engine: medians per
length, prefill times that never fall with length, decode from the largest batch swept, the
base profile kept around the measured tables, and the TOML written loads back as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from xdc.scheduler.measured import (
    DecodeSample,
    EngineMeasurement,
    KvSample,
    LinkMeasurement,
    PrefillSample,
    instance_table,
    kv_curve,
    measured_profile,
    monotone,
    render_toml,
    with_cluster,
)
from xdc.scheduler.profile import ProfileError, load_profile, read_profile_data

from tests.paths import REPO

TINY = REPO / "deploy" / "profiles" / "tiny-cpu.toml"
TWO_LINKS = REPO / "deploy" / "profiles" / "prfaas-two-clusters.toml"


def engine(prefill: dict[int, list[float]], steps: dict[int, list[float]]) -> EngineMeasurement:
    return EngineMeasurement(
        "http://e",
        "m",
        tuple(PrefillSample(n, t) for n, ts in prefill.items() for t in ts),
        tuple(DecodeSample(b, s) for b, ss in steps.items() for s in ss),
    )


def test_an_instance_table_is_the_median_per_length_and_the_largest_batchs_step() -> None:
    m = engine({256: [0.01, 0.5, 0.011], 1024: [0.03, 0.02, 0.025]}, {1: [0.004], 4: [0.006]})
    t = instance_table(m, "cpu", 1, 2048.0)
    assert t["lengths"] == [256, 1024]
    assert t["prefill_s"] == [0.011, 0.025]  # the 0.5 s outlier is not the median
    assert t["kv_bytes"] == [256 * 2048, 1024 * 2048]
    assert (t["bs_max"], t["t_decode_s"]) == (4, 0.006)


def test_a_longer_prompt_never_reads_as_cheaper_than_a_shorter_one() -> None:
    assert monotone([0.02, 0.015, 0.05, 0.04]) == [0.02, 0.02, 0.05, 0.05]
    m = engine({256: [0.03], 1024: [0.02], 2048: [0.06]}, {1: [0.01]})
    assert instance_table(m, "x", 1, 1.0)["prefill_s"] == [0.03, 0.03, 0.06]


@pytest.mark.parametrize(
    ("prefill", "steps", "kv", "why"),
    [
        ({256: [0.01]}, {1: [0.01]}, 1.0, "1 prefill length"),
        ({256: [0.01], 512: [0.02]}, {}, 1.0, "no decode step"),
        ({256: [0.01], 512: [0.02]}, {1: [0.01]}, 0.0, "kv bytes per token"),
        ({256: [0.0], 512: [0.02]}, {1: [0.01]}, 1.0, "not a positive number"),
    ],
)
def test_a_measurement_that_cannot_make_a_profile_says_why(
    prefill: dict[int, list[float]], steps: dict[int, list[float]], kv: float, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        instance_table(engine(prefill, steps), "pd", 1, kv)


def test_the_written_profile_loads_back_with_the_measured_values(tmp_path: Path) -> None:
    pd = instance_table(
        engine({256: [0.02], 1024: [0.05], 2048: [0.11]}, {1: [0.01], 4: [0.02]}), "pd", 1, 2048
    )
    prfaas = instance_table(
        engine({256: [0.02], 1024: [0.05], 2048: [0.12]}, {1: [0.01]}), "prfaas", 1, 2048
    )
    base = read_profile_data(TINY)
    link = LinkMeasurement(2.5e9, 0.1, "measured")
    data = measured_profile(base, TINY.parent, prfaas, pd, link)
    out = tmp_path / "sub" / "measured.toml"
    out.parent.mkdir()
    out.write_text(render_toml(data, ["measured here", ""]))
    got = load_profile(out)
    want = load_profile(TINY)
    assert got.pd.lengths == (256, 1024, 2048) and got.pd.prefill_s == (0.02, 0.05, 0.11)
    assert got.prfaas.prefill_s == (0.02, 0.05, 0.12)
    assert got.pd.kv_bytes == (256 * 2048, 1024 * 2048, 2048 * 2048)
    # eq. (5): bs_max / (t_decode_s * output_tokens), with the base workload's output length
    assert got.pd.decode_rate_rps == pytest.approx(4 / (0.02 * want.workload.output_tokens))
    assert got.egress_gbps == 2.5
    assert (got.n_prfaas, got.n_pd, got.workload.mean) == (
        want.n_prfaas,
        want.n_pd,
        want.workload.mean,
    )
    assert out.read_text().startswith("# measured here\n#\n")


def test_the_measured_systems_shape_replaces_the_bases_counts(tmp_path: Path) -> None:
    """``xdc up`` runs one PrfaaS and one PD engine: its profile says so, so the all-PD
    baseline a replay compares with has the engines there are, not the declaration's."""
    pd = instance_table(engine({256: [0.02], 1024: [0.05]}, {1: [0.01]}), "pd", 1, 2048)
    base, _ = with_cluster(read_profile_data(TINY), TINY.parent, {"homogeneous_instances": 2})
    assert base["cluster"]["homogeneous_instances"] == 2
    assert read_profile_data(TINY)["cluster"]["homogeneous_instances"] == 3  # a copy
    out = tmp_path / "m.toml"
    out.write_text(render_toml(measured_profile(base, TINY.parent, pd, pd, None), []))
    got = load_profile(out)
    assert (got.n_prfaas, got.n_pd, got.homogeneous_instances) == (1, 2, 2)
    # a shape no planner can use is refused before any engine would be measured
    with pytest.raises(ProfileError, match="homogeneous_instances: must be >= 2"):
        with_cluster(read_profile_data(TINY), TINY.parent, {"homogeneous_instances": 1})
    with pytest.raises(ProfileError, match="cannot set egress_gbps"):
        with_cluster(read_profile_data(TINY), TINY.parent, {"egress_gbps": 5})


def test_a_base_with_several_links_is_not_given_one_links_capacity() -> None:
    pd = instance_table(engine({256: [0.02], 1024: [0.05]}, {1: [0.01]}), "pd", 8, 190e3)
    base = read_profile_data(TWO_LINKS)
    with pytest.raises(ProfileError, match="several links"):
        measured_profile(base, TWO_LINKS.parent, pd, pd, LinkMeasurement(1e9, None, "flag"))
    kept = measured_profile(base, TWO_LINKS.parent, pd, pd, None)  # without a link: kept
    assert kept["cluster"]["prfaas"] == base["cluster"]["prfaas"]


def test_a_relative_trace_path_is_made_absolute_so_the_file_reads_anywhere(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "base" / "t.jsonl"
    trace.parent.mkdir()
    trace.write_text('{"input_length": 300, "output_length": 8}\n' * 3)
    base = read_profile_data(TINY)
    base["workload"] = {"kind": "trace", "trace": "t.jsonl"}
    pd = instance_table(engine({256: [0.02], 1024: [0.05]}, {1: [0.01]}), "pd", 1, 2048)
    data = measured_profile(base, trace.parent, pd, pd, None)
    assert data["workload"]["trace"] == str(trace.resolve())
    out = tmp_path / "elsewhere.toml"
    out.write_text(render_toml(data, []))
    assert load_profile(out).workload.mean == 300


def test_kv_sizes_are_the_bytes_moved_where_transfers_were_measured() -> None:
    m = engine({256: [0.02], 1024: [0.05]}, {1: [0.01]})
    moved = kv_curve([KvSample(256, 524_544), KvSample(256, 524_544), KvSample(1024, 2_098_176)])
    t = instance_table(m, "prfaas", 1, 0.0, moved)  # no per-token figure needed
    assert t["kv_bytes"] == [524_544, 2_098_176]
    with pytest.raises(ValueError, match=r"no KV transfer measured at \[1024\]"):
        instance_table(m, "prfaas", 1, 2048.0, kv_curve([KvSample(256, 1)]))
