"""How long vLLM's OpenAI server (the CPU build, the lab's test model) takes to answer, with
its engine core forked from the server (xdc.integrations.vllm.api_server, the default) and
spawned as vLLM's CPU platform does on its own (XDC_VLLM_SPAWN_ENGINE_CORE=1), interleaved,
with the engine's speed (three 2,000-token prompts) and every token compared across the two.

    python bench/vllm_start.py --repeats 3 [--json bench/results/vllm_start_2core.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from xdc.transport.launcher import free_port

from xdc.lab.vllm_rig import VllmServer, prompt

MODES = {"fork": "0", "spawn": "1"}


def one(mode: str) -> dict[str, Any]:
    os.environ["XDC_VLLM_SPAWN_ENGINE_CORE"] = MODES[mode]
    t0 = time.monotonic()
    server = VllmServer("plain", free_port(), core=0)
    try:
        server.wait_ready()
        ready = time.monotonic() - t0
        me = psutil.Process(server.proc.pid)
        kids = [" ".join(k.cmdline())[:80] for k in me.children()]
        tokens = server.complete(prompt(300, seed=7), 8)["choices"][0]["token_ids"]
        core = next(k for k in me.children() if "EngineCore" in " ".join(k.cmdline()))
        c0 = sum(core.cpu_times()[:2])
        t1 = time.monotonic()  # then the engine's speed: three 2,000-token prefills + decodes
        for seed in (1, 2, 3):
            tokens += server.complete(prompt(2000, seed=seed), 8)["choices"][0]["token_ids"]
        work = time.monotonic() - t1
        work_cpu = sum(core.cpu_times()[:2]) - c0
    finally:
        server.close()
    return {
        "mode": mode,
        "ready_s": round(ready, 2),
        "work_s": round(work, 2),
        "work_cpu_s": round(work_cpu, 2),
        "children": kids,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="write every run and the medians")
    a = ap.parse_args()
    runs = []
    for i in range(a.repeats):
        for mode in MODES if i % 2 == 0 else reversed(MODES):
            r = one(mode)
            print(
                f"{mode:5s} ready in {r['ready_s']:5.1f} s, 3 x 2,000 tokens in "
                f"{r['work_s']:5.2f} s (engine core CPU {r['work_cpu_s']:5.2f} s); "
                f"children: {r['children']}",
                flush=True,
            )
            runs.append(r)
    med = {m: statistics.median(r["ready_s"] for r in runs if r["mode"] == m) for m in MODES}
    work = {m: statistics.median(r["work_s"] for r in runs if r["mode"] == m) for m in MODES}
    cpu = {m: statistics.median(r["work_cpu_s"] for r in runs if r["mode"] == m) for m in MODES}
    same = len({tuple(r["tokens"]) for r in runs}) == 1
    print(
        f"median ready: fork {med['fork']:.1f} s, spawn {med['spawn']:.1f} s "
        f"({med['spawn'] / med['fork']:.2f}x); 3 x 2,000 tokens: fork {work['fork']:.2f} s, "
        f"spawn {work['spawn']:.2f} s (engine core CPU {cpu['fork']:.2f} / {cpu['spawn']:.2f} s); "
        f"same tokens in every run: {same}"
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "runs": runs,
                    "median_ready_s": med,
                    "median_work_s": work,
                    "median_work_cpu_s": cpu,
                    "same": same,
                },
                indent=1,
            )
        )
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
