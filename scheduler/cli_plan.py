"""`xdc plan`: solve ``t`` and ``N_p / N_d`` for a profile and show it beside the baselines.

Offline and side-effect free, so an operator can size a deployment (or check what a degraded
link would do with ``--bandwidth-gbps``) before touching the router.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from xdc.scheduler.model import ModelResult
from xdc.scheduler.planner import Plan, solve
from xdc.scheduler.profile import Profile, load_profile


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, metavar="FILE", help="profile TOML or JSON")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=None,
        metavar="GBPS",
        help="PrfaaS egress to plan for (default: the profile's cluster.egress_gbps)",
    )


def _tokens(x: float) -> str:
    if math.isinf(x):
        return "none"
    return f"{x / 1000:.1f}K" if x >= 1000 else f"{x:.0f}"


def _threshold(r: ModelResult) -> str:
    if math.isinf(r.t):
        return "- (no offload)"
    if r.t == 0:
        return "0 (offload all)"
    return _tokens(r.t)


def _counts(r: ModelResult, prfaas: bool, pd_p: bool) -> str:
    a = str(r.n_prfaas) if prfaas else "-"
    b = str(r.n_p) if pd_p else "-"
    return f"{a} / {b} / {r.n_d}"


def _theta(value: float, used: bool) -> str:
    return f"{value:.2f}" if used else "-"


def render(profile: Profile, plan: Plan, source: str) -> str:
    """The human table: PrfaaS-PD next to homogeneous PD and naive heterogeneous, as Table 6."""
    best, homo, naive = plan.best, plan.homogeneous, plan.naive
    cols = [
        ("PrfaaS-PD", best, best.p > 0, best.p < 1),
        ("homogeneous PD", homo, False, True),
        ("naive hetero", naive, True, False),
    ]
    rows: list[tuple[str, list[str]]] = [
        ("threshold t (tokens)", [_threshold(r) for _, r, _, _ in cols]),
        ("N_prfaas / N_p / N_d", [_counts(r, a, b) for _, r, a, b in cols]),
        ("offloaded p", [f"{r.p:.1%}" for _, r, _, _ in cols]),
        (
            "l_long / l_short",
            [
                f"{_tokens(r.l_long) if a else '-'} / {_tokens(r.l_short) if b else '-'}"
                for _, r, a, b in cols
            ],
        ),
        ("Theta_prfaas (req/s)", [_theta(r.theta_prfaas, a) for _, r, a, _ in cols]),
        ("Theta_pd-p (req/s)", [_theta(r.theta_pdp, b) for _, r, _, b in cols]),
        ("Theta_pd-d (req/s)", [f"{r.theta_pdd:.2f}" for _, r, _, _ in cols]),
        ("Lambda_max (req/s)", [f"{r.lambda_max:.2f}" for _, r, _, _ in cols]),
        (
            "ratio vs homogeneous",
            [f"{r.lambda_max / homo.lambda_max:.2f}x" for _, r, _, _ in cols]
            if homo.lambda_max > 0
            else ["-"] * 3,
        ),
        ("bottleneck", [r.bottleneck for _, r, _, _ in cols]),
        (
            "PrfaaS egress (Gbps)",
            [f"{r.egress_gbps_used:.1f}" if a else "-" for _, r, a, _ in cols],
        ),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [
        max(len(name), *(len(vals[i]) for _, vals in rows)) for i, (name, *_) in enumerate(cols)
    ]
    lines = [
        f"profile   {source}",
        f"PrfaaS    {profile.n_prfaas} x {profile.prfaas.name}, link {plan.bandwidth_gbps:g} Gbps"
        + (
            f" (profile says {profile.egress_gbps:g})"
            if plan.bandwidth_gbps != profile.egress_gbps
            else ""
        )
        + (
            " in "
            + ", ".join(f"{c.name} {c.instances} @ {c.egress_gbps:g} Gbps" for c in profile.fleet)
            if len(profile.fleet) > 1
            else ""
        ),
        f"PD        {profile.n_pd} x {profile.pd.name} "
        f"(homogeneous baseline: {profile.homogeneous_instances} x {profile.pd.name})",
        f"workload  {profile.workload.describe()}",
        "",
        " " * label_w
        + "  "
        + "  ".join(n.rjust(w) for (n, *_), w in zip(cols, col_w, strict=True)),
    ]
    for label, vals in rows:
        cells = "  ".join(v.rjust(w) for v, w in zip(vals, col_w, strict=True))
        lines.append(f"{label.ljust(label_w)}  {cells}")
    lines.append("")
    lines.append(
        f"PrfaaS-PD vs naive heterogeneous: {plan.vs_naive:.2f}x; egress uses "
        f"{best.egress_gbps_used:.1f} of {plan.bandwidth_gbps:g} Gbps"
        + (
            f" ({best.egress_gbps_used / plan.bandwidth_gbps:.0%})"
            if plan.bandwidth_gbps > 0
            else ""
        )
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.profile)
    except ValueError as e:
        print(f"xdc plan: {e}", file=sys.stderr)
        return 2
    bw: float | None = args.bandwidth_gbps
    if bw is not None and not (math.isfinite(bw) and bw >= 0):
        print(f"xdc plan: --bandwidth-gbps must be >= 0, got {bw}", file=sys.stderr)
        return 2
    plan = solve(profile, bandwidth_gbps=bw)
    if args.json:
        out = {"profile": str(args.profile), **plan.to_dict()}
        print(json.dumps(out, indent=2, allow_nan=False))
    else:
        print(render(profile, plan, str(args.profile)))
    return 0
