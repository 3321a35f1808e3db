"""Replay comparisons on the PrfaaS case study: policies across rates, a link drop, the trace.

Sections (all deterministic for a seed; wall time is the only thing that varies):

1. low load (1 req/s): TTFT per configuration next to the paper's Table 6;
2. rate sweep: throughput / TTFT / rejections of the four policies from well below to above
   every capacity, saturation ratios against the throughput model;
3. link drop: a 20 Gbps link falls to 5 Gbps at 300 s under 1.5 req/s, with the router's
   defaults, the long-term replan alone, the short-term loop alone, and static-threshold;
4. controller ablation at 2.7 req/s, no drop and no SLO admission: what each short-term
   trigger does to TTFT when nothing is rejected;
5. the Mooncake trace (prefix reuse);
6. speed: 10k requests through the real router.

    python bench/replay_compare.py [--seed 0] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from xdc.scheduler.planner import solve
from xdc.scheduler.policy import PolicyParams
from xdc.scheduler.profile import load_profile
from xdc.scheduler.sim.policies import BASE_POLICIES as POLICIES
from xdc.scheduler.sim.replay import ReplayOptions, compare, replay
from xdc.scheduler.sim.replay_metrics import ReplayResult
from xdc.scheduler.sim.workload import load_trace, parse_link_schedule, synthetic

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy/profiles/prfaas-case-study.toml"
TRACE = REPO.parent / "shared/traces/mooncake_synthetic_trace.jsonl"
# Table 6: mean / P90 TTFT (s) per configuration.
PAPER_TTFT = {
    "PrfaaS-PD": (2.22, 3.51),
    "homogeneous": (4.44, 9.73),
    "naive": (1.74, 3.51),
}
NO_RAISE: dict[str, Any] = {"max_raise": 1.0, "min_raise_tokens_per_s": 0.0}


def f(x: float, spec: str = ".2f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    for r in rows:
        out.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return "\n".join(out)


def brief(r: ReplayResult) -> dict[str, Any]:
    keys = (
        "policy",
        "requests",
        "completed",
        "rejected",
        "unfinished",
        "arrival_rate_rps",
        "throughput_rps",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "offload_fraction",
        "cache_hit_rate",
        "egress_gbps_mean",
        "egress_gbps_peak",
        "base_t",
        "t_mean",
        "t_max",
        "final_t",
        "wall_s",
    )
    d = r.to_json()
    out = {k: d[k] for k in keys}
    out["phases"] = d["phases"]
    return out


def low_load(profile: Any, seed: int, n: int) -> dict[str, Any]:
    reqs = synthetic(profile.workload, n, 1.0, seed)
    got = {r.policy: r for r in compare(profile, reqs)}
    rows = []
    for label, pol in (
        ("PrfaaS-PD", "static-threshold"),
        ("PrfaaS-PD (router)", "prfaas"),
        ("homogeneous", "homogeneous"),
        ("naive", "naive"),
    ):
        r = got[pol]
        paper = PAPER_TTFT.get(label.split(" ")[0], (math.nan, math.nan))
        rows.append(
            [
                label,
                pol,
                f(r.ttft_mean_s),
                f(r.ttft_p90_s),
                f(paper[0]),
                f(paper[1]),
                str(r.rejected),
            ]
        )
    print("\n== 1. low load, 1 req/s (below every capacity): TTFT vs Table 6 ==")
    print(
        table(
            ["configuration", "policy", "mean", "P90", "paper mean", "paper P90", "rejected"], rows
        )
    )
    return {p: brief(r) for p, r in got.items()}


def sweep(profile: Any, seed: int, rates: Sequence[float], duration: float) -> dict[str, Any]:
    plan = solve(profile)
    model = {
        "prfaas": plan.best.lambda_max,
        "static-threshold": plan.best.lambda_max,
        "homogeneous": plan.homogeneous.lambda_max,
        "naive": plan.naive.lambda_max,
    }
    out: dict[str, Any] = {}
    rows = []
    for rate in rates:
        reqs = synthetic(profile.workload, int(rate * duration), rate, seed)
        got = compare(profile, reqs)
        out[str(rate)] = [brief(r) for r in got]
        for r in got:
            rows.append(
                [
                    f"{rate:g}",
                    r.policy,
                    f(r.throughput_rps, ".3f"),
                    f(model[r.policy], ".2f"),
                    f(r.ttft_mean_s, ".1f"),
                    f(r.ttft_p90_s, ".1f"),
                    str(r.rejected),
                    f(100 * r.offload_fraction, ".0f") + "%",
                    f(r.egress_gbps_mean, ".1f"),
                ]
            )
    print(f"\n== 2. rate sweep ({duration:g} s of Poisson arrivals per rate, seed {seed}) ==")
    print(
        table(
            [
                "rate",
                "policy",
                "thr req/s",
                "model Λmax",
                "TTFT mean",
                "P90",
                "rejected",
                "offload",
                "egress Gbps",
            ],
            rows,
        )
    )
    top = str(max(rates))
    sat = {r["policy"]: r["throughput_rps"] for r in out[top]}
    h = sat["homogeneous"]
    ratios = {p: sat[p] / h for p in sat}
    print(
        f"saturated at {top} req/s, throughput vs homogeneous: "
        + ", ".join(f"{p} {ratios[p]:.2f}x" for p in POLICIES)
        + f"  (model: PrfaaS-PD {plan.vs_homogeneous:.2f}x, naive "
        f"{plan.naive.lambda_max / plan.homogeneous.lambda_max:.2f}x; paper 1.54x, 1.16x)"
    )
    return {"runs": out, "saturation_ratio_vs_homogeneous": ratios}


def link_drop(profile: Any, seed: int) -> dict[str, Any]:
    link = parse_link_schedule("0:20,300:5", 20)
    reqs = synthetic(profile.workload, 1350, 1.5, seed)
    variants: list[tuple[str, str, ReplayOptions]] = [
        ("prfaas, router defaults", "prfaas", ReplayOptions(link=link)),
        (
            "prfaas, long-term replan 30s only",
            "prfaas",
            ReplayOptions(
                link=link,
                replan_interval_s=30.0,
                params=replace(PolicyParams(ttft_slo_s=math.inf), **NO_RAISE),
            ),
        ),
        (
            "prfaas, short-term loop only, no SLO",
            "prfaas",
            ReplayOptions(
                link=link, replan_interval_s=None, params=PolicyParams(ttft_slo_s=math.inf)
            ),
        ),
        ("static-threshold", "static-threshold", ReplayOptions(link=link)),
        ("naive", "naive", ReplayOptions(link=link)),
    ]
    out: dict[str, Any] = {}
    rows = []
    for label, pol, opts in variants:
        r = replay(profile, reqs, pol, opts)  # type: ignore[arg-type]
        a, b = r.phases
        out[label] = brief(r)
        rows.append(
            [
                label,
                f(a.ttft_p90_s, ".1f"),
                f(b.ttft_p90_s, ".1f"),
                f(b.ttft_mean_s, ".1f"),
                f"{b.rejected}/{b.arrivals}",
                f(100 * a.offload_fraction, ".0f") + "%",
                f(100 * b.offload_fraction, ".0f") + "%",
                f(b.egress_gbps_mean, ".1f"),
                f"{r.base_t / 1000:.1f}K/{r.t_max / 1000:.1f}K",
            ]
        )
    print("\n== 3. link drop 20 -> 5 Gbps at 300 s, 1.5 req/s for 900 s ==")
    print(
        table(
            [
                "variant",
                "P90 before",
                "P90 after",
                "mean after",
                "rejected after",
                "offload before",
                "after",
                "egress after",
                "t base/max",
            ],
            rows,
        )
    )
    return out


def ablation(profile: Any, seed: int) -> dict[str, Any]:
    reqs = synthetic(profile.workload, 2400, 2.7, seed)
    inf = math.inf
    variants = [
        ("router defaults (SLO 10 s)", {}),
        ("defaults, no SLO admission", {"ttft_slo_s": inf}),
        ("no SLO, queue trigger off", {"ttft_slo_s": inf, "queue_scarce_s": inf}),
        ("no SLO, t never raised", {"ttft_slo_s": inf, **NO_RAISE}),
    ]
    out: dict[str, Any] = {}
    rows = []
    for label, kw in variants:
        r = replay(profile, reqs, "prfaas", ReplayOptions(params=PolicyParams(**kw)))
        out[label] = brief(r)
        rows.append(
            [
                label,
                f(r.ttft_mean_s, ".1f"),
                f(r.ttft_p90_s, ".1f"),
                str(r.rejected),
                f(100 * r.offload_fraction, ".0f") + "%",
                f"{r.t_mean / 1000:.1f}K",
            ]
        )
    s = replay(profile, reqs, "static-threshold")
    out["static-threshold"] = brief(s)
    rows.append(
        [
            "static-threshold",
            f(s.ttft_mean_s, ".1f"),
            f(s.ttft_p90_s, ".1f"),
            str(s.rejected),
            f(100 * s.offload_fraction, ".0f") + "%",
            "19.6K",
        ]
    )
    print("\n== 4. short-term controller ablation: prfaas at 2.7 req/s, 100 Gbps, 2400 requests ==")
    print(table(["variant", "TTFT mean", "P90", "rejected", "offload", "t mean"], rows))
    return out


def trace(profile: Any) -> dict[str, Any]:
    if not TRACE.exists():
        print(f"\n== 5. trace: {TRACE} not found, skipped ==")
        return {}
    reqs = load_trace(TRACE)
    got = compare(profile, reqs)
    rows = [
        [
            r.policy,
            str(r.requests),
            f(r.throughput_rps, ".2f"),
            f(r.ttft_mean_s),
            f(r.ttft_p90_s),
            f(100 * r.cache_hit_rate, ".1f") + "%",
            f(100 * r.offload_fraction, ".0f") + "%",
            f(r.egress_gbps_mean, ".1f"),
            str(r.rejected),
        ]
        for r in got
    ]
    print(f"\n== 5. Mooncake trace ({len(reqs)} requests, {reqs[-1].arrival_s:.0f} s) ==")
    print(
        table(
            [
                "policy",
                "requests",
                "thr",
                "TTFT mean",
                "P90",
                "cache hit",
                "offload",
                "egress",
                "rejected",
            ],
            rows,
        )
    )
    return {r.policy: brief(r) for r in got}


def speed(profile: Any, seed: int) -> dict[str, Any]:
    reqs = synthetic(profile.workload, 10_000, 3.0, seed)
    t0 = time.perf_counter()
    r = replay(profile, reqs, "prfaas")
    wall = time.perf_counter() - t0
    print(
        f"\n== 6. speed: 10,000 requests through the real router: {wall:.2f} s wall "
        f"({r.events} events, {r.events / wall:,.0f} events/s) =="
    )
    return {"requests": 10_000, "wall_s": wall, "events": r.events}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    ap.add_argument("--quick", action="store_true", help="shorter runs (for smoke tests)")
    args = ap.parse_args()
    profile = load_profile(PROFILE)
    t0 = time.perf_counter()
    duration = 300.0 if args.quick else 900.0
    res = {
        "profile": str(PROFILE.relative_to(REPO)),
        "seed": args.seed,
        "low_load": low_load(profile, args.seed, 1000 if args.quick else 3000),
        "rate_sweep": sweep(profile, args.seed, (1.5, 2.0, 2.5, 2.7, 3.0, 3.5, 4.0), duration),
        "link_drop": link_drop(profile, args.seed),
        "ablation": ablation(profile, args.seed),
        "trace": trace(profile),
        "speed": speed(profile, args.seed),
    }
    print(f"\ntotal {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
