"""A slice of the Mooncake synthetic trace through the real system (`xdc up`'s: router,
gateway, PrfaaS vLLM + xdc sender, PD vLLM + xdc receiver across a 1 Gbit/s tbf veth), under
three plans side by side in one run, repeats interleaved (the order rotating each repeat):

* ``router``: the gateway asks the router (PrfaaS offload above t, cache-aware);
* ``local``: every request prefilled and decoded on the PD instance;
* ``remote``: every request prefilled on the PrfaaS instance and streamed across.

Lengths are scaled to the small model's context (input_length / 16, so one trace hash block of
512 tokens becomes 32 tokens = one vLLM block, capped at 3,800), outputs capped at 16 tokens,
arrivals at the trace's own timestamps x ``--rate-scale``. Prompts are built from the trace's
hash_ids (one deterministic 32-token block per id), so requests that share hash ids share
prefixes, as in the trace; each plan and repeat salts its blocks, so no run reuses another's
cache. Reports TTFT mean / P90 (time to the first streamed token at the client) and
throughput per plan (medians over repeats), the router's decisions, and what `xdc replay`
predicts for the same scaled slice (prfaas / homogeneous / naive policies).

    python bench/gateway_trace.py --requests 40 --repeats 2 [--decode-nodes 2] \
        [--json bench/results/gateway_trace_1node_2core.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from xdc.scheduler.drift import predicted_seconds  # noqa: E402
from xdc.scheduler.profile import Profile, load_profile  # noqa: E402
from xdc.scheduler.vllm_metrics import EngineLoad, parse_metrics, prefill_window  # noqa: E402

from xdc.gateway.up import PD_DECODE, PD_PREFILL, PRFAAS_NODE, LocalSystem, UpOptions  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
SCALE, BLOCK, CAP, MAX_OUT = 16, 32, 3800, 16


def load_slice(path: Path, n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            if len(rows) == n:
                break
            r = json.loads(line)
            length = max(BLOCK, min(r["input_length"] // SCALE, CAP))
            rows.append(
                {
                    "timestamp": r["timestamp"],
                    "input_length": length,
                    "output_length": max(1, min(r["output_length"], MAX_OUT)),
                    "hash_ids": r["hash_ids"][: -(-length // BLOCK)],
                }
            )
    return rows


def tokens_of(row: dict[str, Any], salt: int) -> list[int]:
    out: list[int] = []
    for h in row["hash_ids"]:
        out += [((h * 7919 + salt * 104729 + i * 2654435761) % 1900) + 50 for i in range(BLOCK)]
    return out[: row["input_length"]]


async def one(
    s: aiohttp.ClientSession, ids: list[int], out_tokens: int
) -> tuple[float, float, str]:
    body = {
        "model": "xdc-test",
        "prompt": ids,
        "max_tokens": out_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.monotonic()
    ttft = -1.0
    async with s.post("http://gw/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        route = r.headers.get("x-xdc-route", "")
        async for raw in r.content:
            if raw.startswith(b"data: {") and ttft < 0:
                ttft = time.monotonic() - t0
    return ttft, time.monotonic() - t0, route


async def run_plan(
    unix: str, rows: list[dict[str, Any]], salt: int, rate_scale: float
) -> dict[str, Any]:
    t_first = rows[0]["timestamp"] / 1000.0
    conn = aiohttp.UnixConnector(path=unix, limit=0)
    results: list[tuple[float, float, str]] = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        legs_before = await gateway_prefill(s)
        start = time.monotonic()

        async def fire(row: dict[str, Any]) -> None:
            delay = (row["timestamp"] / 1000.0 - t_first) / rate_scale
            await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
            results.append(await one(s, tokens_of(row, salt), row["output_length"]))

        async with asyncio.TaskGroup() as tg:
            for row in rows:
                tg.create_task(fire(row))
        makespan = time.monotonic() - start
        legs_after = await gateway_prefill(s)
    legs = legs_after[1] - legs_before[1]
    ttfts = sorted(r[0] for r in results)
    routes = [dict(p.split("=", 1) for p in r[2].split("; ") if "=" in p) for r in results]
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "throughput_rps": len(results) / makespan,
        "makespan_s": makespan,
        "paths": dict(Counter(r.get("path", "?") for r in routes)),
        "decode_nodes": dict(Counter(r.get("decode", "?") for r in routes)),
        "kv_recomputed": dict(Counter(r["kv_recomputed"] for r in routes if "kv_recomputed" in r)),
        # remote prefills as the gateway timed them (the PrfaaS engine's queue and prefill)
        "remote_prefill_mean_s": (legs_after[0] - legs_before[0]) / legs if legs else None,
    }


def engine_loads(system: LocalSystem) -> dict[str, EngineLoad | None]:
    """Each engine's counters now (vLLM /metrics, read from the PD side)."""
    urls = {"prfaas": system.prfaas_url, "pd": system.pd_nodes[0].url}
    out: dict[str, EngineLoad | None] = {}
    for kind, url in urls.items():
        text = system.ns_get("b", url + "/metrics")
        try:
            out[kind] = parse_metrics(text) if isinstance(text, str) else None
        except ValueError:
            out[kind] = None
    return out


def engine_prefill(
    before: dict[str, EngineLoad | None], after: dict[str, EngineLoad | None], profile: Profile
) -> dict[str, Any]:
    """What each engine reported for the prefills of one run (vLLM's prefill time: scheduled
    to first token, its queue excluded; prompt tokens include cached ones), beside what the
    profile's curve gives for the same prompt lengths (the drift estimator's comparison,
    ``predicted_seconds``: per bucket of the engine's prompt-length histogram)."""
    out: dict[str, Any] = {}
    for kind, inst in (("prfaas", profile.prfaas), ("pd", profile.pd)):
        a, b = after.get(kind), before.get(kind)
        w = prefill_window(a, b) if a is not None else None
        if w is None:
            continue
        mean_tokens = w.tokens / w.n
        mean_s = w.seconds / w.n
        expect = predicted_seconds(w, inst) / w.n
        out[kind] = {
            "n": w.n,
            "mean_tokens": round(mean_tokens, 1),
            "mean_s": round(mean_s, 4),
            "profile_s": round(expect, 4),
            "ratio": round(mean_s / expect, 3) if expect > 0 else None,
        }
    return out


async def gateway_prefill(s: aiohttp.ClientSession) -> tuple[float, int]:
    """The gateway's remote prefill calls so far: total seconds, count."""
    async with s.get("http://gw/metrics") as r:
        text = await r.text()
    total, n = 0.0, 0
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "xdc_gateway_prefill_seconds_sum":
                total += smp.value
            elif smp.name == "xdc_gateway_prefill_seconds_count":
                n += int(smp.value)
    return total, n


def replay_prediction(
    rows: list[dict[str, Any]], rate_scale: float, profile: Path, params: list[str]
) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "xdc",
            "replay",
            f.name,
            "--profile",
            str(profile),
            "--compare",
            "--json",
            "--quiet",
            "--block-tokens",
            str(BLOCK),
            "--rate-scale",
            str(rate_scale),
            *(x for p in params for x in ("--policy-param", p)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    Path(f.name).unlink()
    out = {}
    for r in json.loads(res.stdout)["results"]:
        out[r["policy"]] = {
            k: r[k] for k in ("ttft_mean_s", "ttft_p90_s", "throughput_rps", "offload_fraction")
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="the router's and the replay's profile (default: xdc up measures the engines)",
    )
    ap.add_argument(
        "--decode-nodes",
        type=int,
        default=1,
        help="PD instances (each a decode node with its own receiver); the router spreads "
        "over them, the static local/remote plans use the first",
    )
    a = ap.parse_args()
    rows = load_slice(a.trace, a.requests)
    system = LocalSystem(UpOptions(decode_nodes=a.decode_nodes, profile=a.profile))
    plans = {"router": system.gateway_unix}
    with system:
        system.start(progress=lambda m: print(m, file=sys.stderr))
        for name, prefill in (("local", PD_PREFILL), ("remote", PRFAAS_NODE)):
            unix = str(system.wd / f"gw-{name}.sock")
            system.add_gateway(
                f"gw-{name}",
                unix,
                8000 + len(plans),
                router=False,
                prefill=prefill,
                decode=PD_DECODE,
            )
            plans[name] = unix
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in plans}
        salt = 0
        names = list(plans)
        profile = load_profile(system.profile)
        for rep in range(a.repeats):
            # the order rotates, so no plan always runs first (onto engines idle since the last)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                unix = plans[name]
                salt += 1
                before = engine_loads(system)
                r = asyncio.run(run_plan(unix, rows, salt, a.rate_scale))
                r["engine_prefill"] = engine_prefill(before, engine_loads(system), profile)
                runs[name].append(r)
                print(f"repeat {rep} {name}: {json.dumps(r)}", file=sys.stderr)
        decisions = system.ns_get("b", system.router_url + "/metrics")
        state = system.router_state()
        drift = {
            "profile_drift": state.get("profile_drift"),
            "profile_corrections": state.get("counts", {}).get("profile_corrections"),
            "threshold": state.get("threshold"),
        }
        # what the router routed with (measured at start unless --profile), for the replay
        profile_text = system.profile.read_text()
        # the replay routes as the router did (its knob, the one source of which is xdc up)
        params = [f"keep_local_when_faster={system.keep_local_when_faster}"]
        predicted = replay_prediction(rows, a.rate_scale, system.profile, params)
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("ttft_mean_s", "ttft_p90_s", "throughput_rps")
        }
        for k in ("paths", "decode_nodes", "kv_recomputed"):
            summary[name][k] = rs[-1][k]
        legs = [r["remote_prefill_mean_s"] for r in rs if r["remote_prefill_mean_s"] is not None]
        summary[name]["remote_prefill_mean_s"] = statistics.median(legs) if legs else None
        summary[name]["engine_prefill_ratio"] = {
            kind: statistics.median(
                r["engine_prefill"][kind]["ratio"] for r in rs if kind in r["engine_prefill"]
            )
            for kind in ("prfaas", "pd")
            if any(kind in r["engine_prefill"] for r in rs)
        }
    counted = {}
    if isinstance(decisions, str):
        for line in decisions.splitlines():
            if line.startswith("xdc_router_decisions_total{"):
                counted[line.split('"')[1]] = float(line.split()[-1])
    out = {
        "machine": "2 cores, 24 GiB",
        "requests": len(rows),
        "decode_nodes": a.decode_nodes,
        "repeats": a.repeats,
        "rate_scale": a.rate_scale,
        "mean_input_tokens": statistics.fmean(r["input_length"] for r in rows),
        "measured": summary,
        "router_decisions_total": counted,
        "router_drift": drift,
        "replay_predicted": predicted,
        "profile": profile_text,
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
