"""A slice of the Mooncake synthetic trace through the real system (`xdc up`'s: router,
gateway, PrfaaS vLLM + xdc sender, PD vLLM + xdc receiver across a 1 Gbit/s tbf veth), under
three plans side by side in one run, repeats interleaved:

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
        start = time.monotonic()

        async def fire(row: dict[str, Any]) -> None:
            delay = (row["timestamp"] / 1000.0 - t_first) / rate_scale
            await asyncio.sleep(max(0.0, start + delay - time.monotonic()))
            results.append(await one(s, tokens_of(row, salt), row["output_length"]))

        async with asyncio.TaskGroup() as tg:
            for row in rows:
                tg.create_task(fire(row))
        makespan = time.monotonic() - start
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
    }


def replay_prediction(
    rows: list[dict[str, Any]], rate_scale: float, profile: Path
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
        for rep in range(a.repeats):
            for name, unix in plans.items():
                salt += 1
                r = asyncio.run(run_plan(unix, rows, salt, a.rate_scale))
                runs[name].append(r)
                print(f"repeat {rep} {name}: {json.dumps(r)}", file=sys.stderr)
        decisions = system.ns_get("b", system.router_url + "/metrics")
        # what the router routed with (measured at start unless --profile), for the replay
        profile_text = system.profile.read_text()
        predicted = replay_prediction(rows, a.rate_scale, system.profile)
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("ttft_mean_s", "ttft_p90_s", "throughput_rps")
        }
        for k in ("paths", "decode_nodes", "kv_recomputed"):
            summary[name][k] = rs[-1][k]
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
