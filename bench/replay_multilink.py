"""Two PrfaaS clusters, each behind its own link, and a capacity drop on the better link:
the router's capacity at a TTFT SLO against the two simpler ways to run two sites.

Capacity is the largest Poisson arrival rate at which the P90 TTFT over *all* requests stays
within the SLO, a rejected request counting as one that missed it (so no policy can buy a low
P90 by refusing work). Each rate is replayed for ``--seconds`` of arrivals on every seed and
the TTFTs of all seeds are pooled; the rate is found by a coarse grid, then bisection.

Policies (``scheduler/sim/policies.py``):
* ``prfaas``: the router: offloads split by each cluster's live capacity, plan for the fleet;
* ``better-link``: every offload over the link with the highest configured capacity, the
  other cluster idle, plan solved for that one cluster;
* ``single-cluster``: the clusters planned and routed as one pooled cluster (summed instances
  and bandwidth, one merged link state), each offload to the least-loaded PrfaaS node.

    python bench/replay_multilink.py [--profile deploy/profiles/prfaas-two-clusters.toml]
        [--schedule prfaas-a=0:40,300:2] [--slo 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from xdc.scheduler.profile import Profile, load_profile
from xdc.scheduler.sim.policies import PolicyName
from xdc.scheduler.sim.replay import ReplayOptions, ReplaySim
from xdc.scheduler.sim.replay_cli import link_schedules
from xdc.scheduler.sim.workload import synthetic

ROOT = Path(__file__).resolve().parents[1]
POLICIES: tuple[PolicyName, ...] = ("prfaas", "better-link", "single-cluster")


def p90_all(
    profile: Profile, policy: PolicyName, rate: float, args: argparse.Namespace
) -> dict[str, Any]:
    """P90 TTFT over every request of every seed (rejected = missed) at ``rate`` req/s."""
    link, links = link_schedules(args.schedule, profile)
    opts = ReplayOptions(link=link, links=links)
    ttft: list[float] = []
    rejected = offloaded = total = 0
    split: dict[str, int] = {}
    for seed in range(args.seeds):
        n = max(int(rate * args.seconds), 20)
        reqs = synthetic(profile.workload, n, rate, seed)
        sim = ReplaySim(profile, reqs, policy, opts)
        res = sim.run()
        for r in sim.reqs:
            ttft.append(math.inf if r.rejected or math.isnan(r.ready) else r.ready - r.arrival)
        rejected += res.rejected
        offloaded += round(res.offload_fraction * (res.requests - res.rejected))
        total += res.requests
        for k, v in res.offload_split.items():
            split[k] = split.get(k, 0) + v
    p90 = float(np.percentile(np.array(ttft), 90))
    return {
        "rate": rate,
        "p90_s": p90 if math.isfinite(p90) else None,
        "ok": p90 <= args.slo,
        "rejected": rejected,
        "requests": total,
        "offloaded": offloaded,
        "split": split,
    }


def capacity(profile: Profile, policy: PolicyName, args: argparse.Namespace) -> dict[str, Any]:
    grid = np.arange(args.min_rate, args.max_rate + 1e-9, args.step)
    runs = []
    last_ok: dict[str, Any] | None = None
    first_bad: dict[str, Any] | None = None
    for rate in grid:
        r = p90_all(profile, policy, float(rate), args)
        runs.append(r)
        if r["ok"]:
            last_ok = r
        else:
            first_bad = r
            break
    if last_ok is not None and first_bad is not None:
        lo, hi = last_ok["rate"], first_bad["rate"]
        for _ in range(args.bisect):
            mid = (lo + hi) / 2
            r = p90_all(profile, policy, mid, args)
            runs.append(r)
            if r["ok"]:
                lo, last_ok = mid, r
            else:
                hi = mid
    return {
        "policy": policy,
        "capacity_rps": None if last_ok is None else round(last_ok["rate"], 3),
        "at_capacity": last_ok,
        "runs": sorted(runs, key=lambda x: x["rate"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(ROOT / "deploy/profiles/prfaas-two-clusters.toml"))
    ap.add_argument("--schedule", action="append", default=None, metavar="[CLUSTER=]T:GBPS,...")
    ap.add_argument("--slo", type=float, default=10.0, help="P90 TTFT SLO in seconds")
    ap.add_argument("--seconds", type=float, default=600.0, help="arrivals per replay")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--min-rate", type=float, default=1.0)
    ap.add_argument("--max-rate", type=float, default=4.0)
    ap.add_argument("--step", type=float, default=0.25)
    ap.add_argument("--bisect", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    if args.schedule is None:
        args.schedule = ["prfaas-a=0:40,300:2"]
    profile = load_profile(args.profile)
    t0 = time.perf_counter()
    results = [capacity(profile, p, args) for p in POLICIES]
    wall = time.perf_counter() - t0
    fleet = ", ".join(f"{c.name} {c.instances} x {c.egress_gbps:g} Gbps" for c in profile.fleet)
    print(f"profile {args.profile}: {fleet}; schedule {'; '.join(args.schedule)}")
    print(
        f"capacity = largest arrival rate with P90 TTFT <= {args.slo:g} s over all requests "
        f"(rejected = missed), {args.seeds} seeds x {args.seconds:g} s of arrivals each"
    )
    print(f"{'policy':>16}{'capacity req/s':>16}{'P90 s':>8}{'rejected':>10}  offloads per cluster")
    base = next(r for r in results if r["policy"] == "prfaas")["capacity_rps"]
    for r in results:
        at = r["at_capacity"] or {}
        cap = r["capacity_rps"]
        p90 = at.get("p90_s")
        cap_s = f"{cap:.3f}" if cap else "-"
        p90_s = f"{p90:.2f}" if p90 is not None else "-"
        rej = f"{at.get('rejected', '-')}/{at.get('requests', '-')}"
        vs = f"  (router {base / cap:.2f}x)" if cap and base and r["policy"] != "prfaas" else ""
        print(f"{r['policy']:>16}{cap_s:>16}{p90_s:>8}{rej:>10}  {at.get('split', {})}{vs}")
    print(f"({wall:.0f} s)")
    out = {
        "profile": args.profile,
        "schedule": args.schedule,
        "slo_s": args.slo,
        "results": results,
    }
    print(
        json.dumps(
            {k: v for k, v in out.items() if k != "results"}
            | {"capacity_rps": {r["policy"]: r["capacity_rps"] for r in results}}
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
