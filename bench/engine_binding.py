"""Two one-rank vLLM CPU engines busy at once, unbound (vLLM 0.32's own behaviour for a
``uni`` engine: a torch thread per host core, no affinity) against bound (xdc's engines:
``serve.bind_to_core``, one core and one thread each). Why xdc binds: a producer prefilling
while its consumer decodes, or a differential test's two references, are two such engines.

    python bench/engine_binding.py --model hybrid --repeats 3

For each prompt length: one engine alone, then both at once on the same prompt; medians of
``--repeats``, seconds. Needs the vLLM venv (deploy/install-vllm.sh).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xdc.lab.vllm_rig import (
    close_engines,
    hybrid_model,
    prompt,
    start_engines,
    test_model,
)

LENGTHS = (129, 1025, 3009)


def arm(bound: bool, model: str, repeats: int) -> dict[str, Any]:
    hybrid = model == "hybrid"
    kw: dict[str, Any] = {
        "model": hybrid_model() if hybrid else test_model(),
        "dtype": "bfloat16" if hybrid else "float32",
        "max_num_batched_tokens": 32 if hybrid else 0,
        "bind": bound,
    }
    a, b = start_engines(("plain", {"core": 0, **kw}), ("plain", {"core": 1, **kw}))
    out: dict[str, Any] = {}
    try:
        for n in LENGTHS:
            alone, together = [], []
            for r in range(repeats):
                s = prompt(n, seed=100 * r + n)  # another prompt each time: no cache to hit
                t = time.monotonic()
                a.generate([s], None, 4)
                alone.append(time.monotonic() - t)
                s = prompt(n, seed=100 * r + n + 50)
                t = time.monotonic()
                a.submit([s], None, 4)
                b.submit([s], None, 4)
                a.result(600)
                b.result(600)
                together.append(time.monotonic() - t)
            out[str(n)] = {
                "alone_s": round(statistics.median(alone), 3),
                "together_s": round(statistics.median(together), 3),
            }
            print(("bound" if bound else "unbound"), n, out[str(n)], flush=True)
    finally:
        close_engines([a, b])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["dense", "hybrid"], default="hybrid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/engine_binding.json"))
    a = ap.parse_args()
    if not 1 <= a.repeats <= 20:
        ap.error("--repeats 1..20")
    result = {
        "model": a.model,
        "cores": len(os.sched_getaffinity(0)),
        "unbound": arm(False, a.model, a.repeats),
        "bound": arm(True, a.model, a.repeats),
    }
    head = ("tokens", "unbound alone", "together", "bound alone", "together")
    print("{:>7} {:>14} {:>9} {:>12} {:>9}".format(*head))
    for n in LENGTHS:
        u, b = result["unbound"][str(n)], result["bound"][str(n)]
        print(
            f"{n:>7} {u['alone_s']:>14.2f} {u['together_s']:>9.2f} "
            f"{b['alone_s']:>12.2f} {b['together_s']:>9.2f}"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
