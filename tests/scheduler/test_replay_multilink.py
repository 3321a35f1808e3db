"""Replay with two PrfaaS clusters behind their own links: the router splits offloads by each
link's live capacity and follows a capacity drop on one; the CLI takes a schedule per cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from xdc.scheduler.profile import load_profile
from xdc.scheduler.sim.replay import ReplayOptions, ReplaySim, compare
from xdc.scheduler.sim.replay_cli import link_schedules
from xdc.scheduler.sim.workload import ReplayInputError, synthetic

from tests.paths import REPO

ROOT = REPO
TWO = ROOT / "deploy/profiles/prfaas-two-clusters.toml"


def _split(sim: ReplaySim, t0: float, t1: float) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in sim.reqs:
        if t0 <= r.arrival < t1 and r.target not in ("", "pd"):
            out[r.target] = out.get(r.target, 0) + 1
    return out


def test_router_follows_a_capacity_drop_on_one_link() -> None:
    profile = load_profile(TWO)
    link, links = link_schedules(["prfaas-a=0:40,300:2"], profile)
    reqs = synthetic(profile.workload, 1200, 2.0, seed=3)
    sim = ReplaySim(profile, reqs, "prfaas", ReplayOptions(link=link, links=links))
    res = sim.run()
    before, after = _split(sim, 0, 300), _split(sim, 330, 600)
    # both sites compute-bound before (2 instances each): about even; a's link at 2 Gbit/s
    # carries a quarter of what b's 8 do, and its share follows
    share_a = before["prfaas-a"] / sum(before.values())
    assert 0.35 < share_a < 0.65
    assert after["prfaas-a"] / sum(after.values()) < 0.5 * share_a
    assert res.offload_split == _split(sim, 0, 1e9)


def test_compare_on_two_clusters_includes_the_one_cluster_alternatives() -> None:
    profile = load_profile(TWO)
    reqs = synthetic(profile.workload, 300, 1.5, seed=1)
    link, links = link_schedules(["prfaas-a=0:40,100:2"], profile)
    results = {r.policy: r for r in compare(profile, reqs, ReplayOptions(link=link, links=links))}
    assert {"better-link", "single-cluster"} <= set(results)
    assert set(results["better-link"].offload_split) <= {"prfaas-a"}  # b idles
    assert results["better-link"].n_prfaas == 2  # the better link's cluster only


def test_link_schedule_names_must_be_clusters_of_the_profile() -> None:
    profile = load_profile(TWO)
    with pytest.raises(ReplayInputError, match="prfaas-z"):
        link_schedules(["prfaas-z=0:10"], profile)
    with pytest.raises(ReplayInputError, match="twice"):
        link_schedules(["prfaas-a=0:10", "prfaas-a=0:20"], profile)


def test_cli_replays_two_clusters_with_per_cluster_schedules() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "xdc",
            "replay",
            "--profile",
            str(TWO),
            "--synthetic",
            "200",
            "--rate",
            "1.5",
            "--link-schedule",
            "prfaas-a=0:40,60:2",
            "--link-schedule",
            "prfaas-b=0:8",
            "--json",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "prfaas-a: 40 Gbps from 0s, 2 Gbps from 60s" in body["link_schedule"]
    split = body["results"][0]["offload_split"]
    assert set(split) == {"prfaas-a", "prfaas-b"}
