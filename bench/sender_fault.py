"""Issue 28's fault as a new user meets it: `xdc up --loss 0.01`, vLLM's own serving benchmark
through the gateway (random prompts of 2,600 +- 50% tokens, 24 out, 60 prompts at 1.5 req/s),
and the PrfaaS sender daemon SIGKILLed 15 s into the run. The same benchmark runs first without
the fault, on the same system (other random prompts: no cache reuse), as the reference.

Reports, per run: requests completed / failed, TTFT P50 / P90 (vLLM's benchmark, at the
client), and from the gateway's metrics what ran after the kill (remote, local by the router,
recovered at once after a failed hand-over) and the recomputes it counted.

    python bench/sender_fault.py [--json bench/results/sender_fault.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xdc.transport.launcher import free_port  # noqa: E402

from xdc.gateway.up import MODEL, PROFILE, LocalSystem, UpOptions, _forward, _listener  # noqa: E402

BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def bench_serve(python: Path, port: int, tokenizer: Path, out: Path, seed: int) -> dict[str, Any]:
    argv = [
        str(python),
        "-c",
        BENCH,
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--endpoint",
        "/v1/completions",
        "--model",
        MODEL,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        "2600",
        "--random-range-ratio",
        "0.5",
        "--random-output-len",
        "24",
        "--num-prompts",
        "60",
        "--request-rate",
        "1.5",
        "--seed",
        str(seed),
        "--ignore-eos",
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft",
        "--metric-percentiles",
        "50,90",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


_COUNTER = re.compile(
    r"(xdc_gateway_(?:requests|kv_recomputed|prefill_failures)_total\{.*\}) (\S+)"
)


def gateway_counts(port: int) -> dict[str, float]:
    """The gateway's request and recompute counters, flattened to 'name{labels}' -> value."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _COUNTER.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def summary(res: dict[str, Any]) -> dict[str, Any]:
    return {
        "completed": res.get("completed"),
        "failed": res.get("failed", 0),
        "ttft_p50_ms": round(float(res["p50_ttft_ms"]), 1),
        "ttft_p90_ms": round(float(res["p90_ttft_ms"]), 1),
        "ttft_mean_ms": round(float(res["mean_ttft_ms"]), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kill-at", type=float, default=15.0, help="seconds into the fault run")
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    system = LocalSystem(UpOptions(loss=args.loss, profile=PROFILE))
    port = free_port()
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    fwd = threading.Thread(
        target=loop.run_until_complete,
        args=(_forward(_listener(port), system.gateway_unix, stop),),
    )
    results: dict[str, Any] = {"machine": "see bench/README.md", "loss": args.loss}
    with system, tempfile.TemporaryDirectory() as tmp:
        system.start(progress=lambda m: print(f"xdc up: {m}", flush=True))
        fwd.start()
        try:
            python = system.opts.vllm_python
            c0 = gateway_counts(port)
            ref = bench_serve(python, port, system.model_dir, Path(tmp) / "ref.json", seed=1)
            c1 = gateway_counts(port)
            results["no_fault"] = {**summary(ref), "gateway": diff(c1, c0)}
            print("no fault:", json.dumps(results["no_fault"], indent=1), flush=True)
            killed: dict[str, Any] = {}

            def kill() -> None:
                time.sleep(args.kill_at)
                killed["counts"] = gateway_counts(port)
                system.kill("sender")
                killed["at"] = time.monotonic()
                print(f"sender SIGKILLed {args.kill_at:g}s in", flush=True)

            killer = threading.Thread(target=kill)
            killer.start()
            res = bench_serve(python, port, system.model_dir, Path(tmp) / "fault.json", seed=2)
            killer.join()
            c2 = gateway_counts(port)
            results["sender_killed"] = {
                **summary(res),
                "kill_at_s": args.kill_at,
                "gateway_before_kill": diff(killed["counts"], c1),
                "gateway_after_kill": diff(c2, killed["counts"]),
            }
            state = system.ns_get("b", system.router_url + "/v1/state")
            results["router_outages"] = state.get("outages") if isinstance(state, dict) else None
        finally:
            loop.call_soon_threadsafe(stop.set)
            fwd.join(10)
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
