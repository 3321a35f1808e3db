"""`xdc plan` end to end, as a subprocess through the real console entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from xdc.scheduler.planner import solve
from xdc.scheduler.profile import load_profile

from tests.paths import REPO

ROOT = REPO
CASE = ROOT / "deploy/profiles/prfaas-case-study.toml"
DEMO = ROOT / "deploy/profiles/small-demo.toml"


def _xdc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xdc", "plan", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_plan_json_matches_the_library() -> None:
    proc = _xdc("--profile", str(CASE), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    plan = solve(load_profile(CASE))
    best = out["prfaas_pd"]
    assert (best["n_prfaas"], best["n_p"], best["n_d"]) == (4, 3, 5)
    assert best["t"] == pytest.approx(plan.t)
    assert best["lambda_max"] == pytest.approx(plan.lambda_max)
    assert best["egress_gbps_used"] == pytest.approx(plan.best.egress_gbps_used)
    assert out["homogeneous_pd"]["lambda_max"] == pytest.approx(plan.homogeneous.lambda_max)
    assert out["homogeneous_pd"]["t"] is None
    assert out["naive_heterogeneous"]["t"] == 0.0
    assert out["ratio_vs_homogeneous"]["prfaas_pd"] == pytest.approx(plan.vs_homogeneous)
    assert out["bandwidth_gbps"] == 100.0
    assert out["profile"] == str(CASE)


def test_plan_human_table() -> None:
    proc = _xdc("--profile", str(DEMO))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in (
        "PrfaaS-PD",
        "homogeneous PD",
        "naive hetero",
        "threshold t (tokens)",
        "2 / 2 / 4",  # worked optimum in small-demo.toml
        "- / 4 / 4",
        "4.46",
        "prfaas-egress",
        "1.12x",
    ):
        assert needle in text, needle


def test_bandwidth_override() -> None:
    proc = _xdc("--profile", str(CASE), "--json", "--bandwidth-gbps", "5")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["bandwidth_gbps"] == 5.0
    assert out["prfaas_pd"]["bottleneck"] == "prfaas-egress"
    assert out["prfaas_pd"]["egress_gbps_used"] == pytest.approx(5.0)


def test_bad_profile_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace("n_pd = 6", "n_pd = -6"))
    proc = _xdc("--profile", str(bad), "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "cluster.n_pd" in proc.stderr
    missing = _xdc("--profile", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    negative = _xdc("--profile", str(DEMO), "--bandwidth-gbps", "-1")
    assert negative.returncode == 2 and "--bandwidth-gbps" in negative.stderr
