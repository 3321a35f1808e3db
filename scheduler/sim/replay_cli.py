"""`xdc replay`: run a trace or a synthetic workload through simulated clusters.

Offline and deterministic (given ``--seed``), so a routing policy can be judged, and its knobs
tuned, on the same arrivals as the alternatives before it touches a real deployment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

from xdc.scheduler.policy import PolicyParams
from xdc.scheduler.profile import Profile, ProfileError, load_profile
from xdc.scheduler.sim.policies import POLICIES, PolicyName
from xdc.scheduler.sim.replay import ReplayOptions, compare, replay
from xdc.scheduler.sim.replay_metrics import ReplayResult, render
from xdc.scheduler.sim.workload import (
    LinkSchedule,
    ReplayInputError,
    SimRequest,
    load_trace,
    parse_link_schedule,
    retime,
    synthetic,
)

from xdc.config_entries import BOOL_WORDS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", metavar="TRACE", help="Mooncake jsonl trace")
    parser.add_argument("--profile", required=True, metavar="FILE", help="profile TOML or JSON")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--policy", choices=POLICIES, default="prfaas", help="routing policy (default prfaas)"
    )
    which.add_argument(
        "--compare",
        action="store_true",
        help="run every policy on the same arrivals (with several PrfaaS clusters also "
        "better-link and single-cluster)",
    )
    src = parser.add_argument_group("arrivals")
    src.add_argument(
        "--synthetic",
        type=int,
        metavar="N",
        help="N requests sampled from the profile's workload (needs --rate)",
    )
    src.add_argument(
        "--rate", type=float, metavar="RPS", help="Poisson arrivals at RPS req/s (re-times a trace)"
    )
    src.add_argument(
        "--rate-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="replay trace timestamps X times faster (default 1)",
    )
    src.add_argument("--limit", type=int, metavar="N", help="use the first N trace requests")
    src.add_argument("--seed", type=int, default=0, help="seed for Poisson and sampling")
    sim = parser.add_argument_group("simulation")
    sim.add_argument(
        "--link-schedule",
        action="append",
        default=[],
        metavar="[CLUSTER=]T:GBPS,...",
        help="PrfaaS egress over time, e.g. '0:100,600:25' (default: profile egress_gbps); "
        "with several PrfaaS clusters, one per cluster: 'prfaas-a=0:40,300:4' (repeatable; "
        "without CLUSTER= it is the first cluster's)",
    )
    sim.add_argument(
        "--monitor-interval", type=float, default=1.0, metavar="S", help="link sample period"
    )
    sim.add_argument(
        "--replan-interval",
        type=float,
        default=300.0,
        metavar="S",
        help="prfaas long-term replan period; 0 disables (default 300, the router's)",
    )
    sim.add_argument(
        "--ttft-slo",
        type=float,
        metavar="S",
        help="router TTFT SLO for admission (default 10, the router's; 'inf' never rejects)",
    )
    sim.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a scheduler.policy.PolicyParams field (repeatable)",
    )
    sim.add_argument(
        "--cache-blocks",
        type=int,
        default=20_000,
        metavar="N",
        help="prefix-cache capacity per instance, in blocks (default 20000)",
    )
    sim.add_argument("--block-tokens", type=int, default=512, metavar="N", help="block size")
    sim.add_argument(
        "--decode-tpot-ms",
        type=float,
        default=25.0,
        metavar="MS",
        help="decode time per token that sizes decode slots (default 25 = 40 tokens/s)",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _fail(msg: str) -> int:
    print(f"xdc replay: {msg}", file=sys.stderr)
    return 2


def policy_params(block_tokens: int, slo: float | None, overrides: list[str]) -> PolicyParams:
    """The router's defaults with ``NAME=VALUE`` overrides; ValueError names a bad one."""
    params = PolicyParams(block_size=block_tokens)
    if slo is not None:
        if not slo > 0:
            raise ValueError(f"--ttft-slo must be > 0, got {slo}")
        params = dataclasses.replace(params, ttft_slo_s=slo)
    fields = {f.name: f for f in dataclasses.fields(PolicyParams)}
    changes: dict[str, Any] = {}
    for item in overrides:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            raise ValueError(
                f"--policy-param {item!r}: expected NAME=VALUE with NAME one of "
                + ", ".join(sorted(fields))
            )
        current = getattr(params, name)
        if isinstance(current, bool):
            flag = BOOL_WORDS.get(text.strip().lower())
            if flag is None:
                raise ValueError(f"--policy-param {name}: expected true or false, got {text!r}")
            changes[name] = flag
            continue
        try:
            value: float | int = int(text) if isinstance(current, int) else float(text)
        except ValueError:
            kind = "an integer" if isinstance(current, int) else "a number"
            raise ValueError(f"--policy-param {name}: expected {kind}, got {text!r}") from None
        if isinstance(value, float) and math.isnan(value):
            raise ValueError(f"--policy-param {name}: must not be nan")
        changes[name] = value
    return dataclasses.replace(params, **changes)


def link_schedules(
    items: list[str], profile: Profile
) -> tuple[LinkSchedule, dict[str, LinkSchedule]]:
    """``--link-schedule`` values: the first cluster's schedule and one per named cluster."""
    fleet = {c.name: c.egress_gbps for c in profile.fleet}
    first = profile.fleet[0].name
    per: dict[str, LinkSchedule] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            name, text = first, item
        name = name.strip()
        if name not in fleet:
            raise ReplayInputError(
                f"--link-schedule {item!r}: {name!r} is not a PrfaaS cluster of the profile "
                f"({', '.join(fleet)})"
            )
        if name in per:
            raise ReplayInputError(f"--link-schedule: {name} given twice")
        per[name] = parse_link_schedule(text, fleet[name])
    link = per.get(first) or parse_link_schedule("", fleet[first])
    return link, per


def _describe(link: LinkSchedule, links: dict[str, LinkSchedule], profile: Profile) -> str:
    if len(profile.fleet) == 1:
        return link.describe()
    return "; ".join(
        f"{c.name}: {(links.get(c.name) or parse_link_schedule('', c.egress_gbps)).describe()}"
        for c in profile.fleet
    )


def _arrivals(args: argparse.Namespace, workload_source: Any) -> list[SimRequest]:
    if (args.trace is None) == (args.synthetic is None):
        raise ReplayInputError("give a TRACE file or --synthetic N (exactly one)")
    if args.limit is not None and args.limit < 1:
        raise ReplayInputError(f"--limit must be >= 1, got {args.limit}")
    if args.synthetic is not None:
        if args.rate is None:
            raise ReplayInputError("--synthetic needs --rate RPS")
        if args.rate_scale != 1.0:
            raise ReplayInputError("--rate-scale applies to trace timestamps, not --synthetic")
        return synthetic(workload_source, args.synthetic, args.rate, args.seed)
    reqs = load_trace(args.trace, limit=args.limit, rate_scale=args.rate_scale)
    if args.rate is not None:
        if args.rate_scale != 1.0:
            raise ReplayInputError("--rate replaces trace timestamps; drop --rate-scale")
        reqs = retime(reqs, args.rate, args.seed)
    return reqs


def run(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        return _fail(str(e))
    try:
        requests = _arrivals(args, profile.workload)
        link, links = link_schedules(args.link_schedule, profile)
        params = policy_params(args.block_tokens, args.ttft_slo, args.policy_param)
        if args.decode_tpot_ms <= 0 or not math.isfinite(args.decode_tpot_ms):
            raise ReplayInputError("--decode-tpot-ms must be > 0")
        if args.replan_interval < 0 or math.isnan(args.replan_interval):
            raise ReplayInputError("--replan-interval must be >= 0 (0 disables)")
        opts = ReplayOptions(
            link=link,
            links=links,
            monitor_interval_s=args.monitor_interval,
            replan_interval_s=args.replan_interval if args.replan_interval > 0 else None,
            block_tokens=args.block_tokens,
            cache_blocks_per_instance=args.cache_blocks,
            decode_tpot_s=args.decode_tpot_ms / 1000.0,
            params=params,
        )
        problems = opts.problems()
        if problems:
            raise ReplayInputError("; ".join(problems))
    except (ReplayInputError, ValueError) as e:
        return _fail(str(e))

    def progress(name: PolicyName) -> Any:
        if args.quiet:
            return None

        def report(t: float, frac: float, done: int, total: int) -> None:
            print(
                f"replay {name}: sim t={t:.0f}s, {done}/{total} requests ({frac:.0%})",
                file=sys.stderr,
            )

        return report

    try:
        if args.compare:
            results = compare(profile, requests, opts, progress=progress)
        else:
            results = [replay(profile, requests, args.policy, opts, progress=progress(args.policy))]
    except ReplayInputError as e:
        return _fail(str(e))
    desc = _describe(link, links, profile)
    if args.json:
        print(json.dumps(_json(args, desc, requests, results), indent=2))
    else:
        print(_header(args, desc, requests))
        print(render(results))
    return 0


def _header(args: argparse.Namespace, link: str, requests: list[SimRequest]) -> str:
    src = args.trace if args.trace is not None else f"synthetic x{args.synthetic}"
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (
        f"replay of {src}: {len(requests)} requests over {span:.0f}s; profile {args.profile}; "
        f"link {link}\n"
    )


def _json(
    args: argparse.Namespace, link: str, requests: list[SimRequest], results: list[ReplayResult]
) -> dict[str, object]:
    return {
        "profile": args.profile,
        "source": args.trace if args.trace is not None else "synthetic",
        "requests": len(requests),
        "seed": args.seed,
        "link_schedule": link,
        "results": [r.to_json() for r in results],
    }


__all__ = ["configure", "policy_params", "run"]
